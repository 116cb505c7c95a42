"""Roofline model of the GDN prefill track (hopper_anchors.md §3.4), for hopperbench.floors.

Without inputs: an input state is present (as in the contest). With inputs: `state` read only
when given (None when absent); `new_state` is always written.
"""

from __future__ import annotations

from collections.abc import Mapping

from hopperbench.floors import H200_PEAK_BF16_FLOP_PER_S, Work, axis

TRACK = "gdn_prefill"

# GDN (§3.4): per token q, k (4 x 128 bf16 each), v (8 x 128 bf16), a and b (8 bf16 each) and
# output (8 x 128 bf16); each state read or write is 8 x 128 x 128 fp32 per sequence. FLOP is
# the chunked form with chunk C = 64: T * HV * (6 d^2 + 10 C d + 0.7 C^2).
BYTES_PER_TOKEN = 1024 + 1024 + 2048 + 16 + 16 + 2048
STATE_BYTES_PER_SEQUENCE = 8 * 128 * 128 * 4
CHUNK = 64
FLOP_PER_TOKEN = 8 * (6 * 128**2 + 10 * CHUNK * 128 + 0.7 * CHUNK**2)


def work(axes: Mapping[str, int], inputs: Mapping[str, object] | None) -> Work:
    total_seq_len = axis(TRACK, axes, "total_seq_len", 1)
    num_seqs = axis(TRACK, axes, "num_seqs", 1)
    # Without inputs assume an input state, as in the contest (inference, §3.4).
    has_state = True if inputs is None else inputs.get("state") is not None
    state_transfers = 2 if has_state else 1  # new_state is always written
    return Work(
        bytes_min=BYTES_PER_TOKEN * total_seq_len + STATE_BYTES_PER_SEQUENCE * num_seqs * state_transfers,
        flops=FLOP_PER_TOKEN * total_seq_len,
        peak_flop_per_s=H200_PEAK_BF16_FLOP_PER_S,
    )
