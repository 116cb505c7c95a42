"""Roofline model of the DSA sparse attention track (hopper_anchors.md §2.3), for hopperbench.floors.

Without inputs: no padding, and no cache row shared between tokens. With inputs: the valid
entries of `sparse_indices` and the distinct rows they gather, exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hopperbench.floors import H200_PEAK_BF16_FLOP_PER_S, FloorInputError, Work, axis, tensor_input

TRACK = "dsa_attention"

# DSA (§2.3): one gathered cache row is 512 ckv + 64 kpe bf16 values; per token the indices
# (2048 int32), q_nope + q_pe (16 x 576 bf16), output (16 x 512 bf16) and lse (16 f32).
TOPK = 2048
BYTES_PER_ROW = (512 + 64) * 2
BYTES_PER_TOKEN = TOPK * 4 + 16 * 576 * 2 + 16 * 512 * 2 + 16 * 4
FLOP_PER_KEY = 2 * 16 * ((512 + 64) + 512)


def work(axes: Mapping[str, int], inputs: Mapping[str, object] | None) -> Work:
    num_tokens = axis(TRACK, axes, "num_tokens", 1)
    if inputs is None:
        # No padding, and no row shared between tokens (random indices overlap ~1 %, §2.3).
        valid_keys = distinct_rows = TOPK * num_tokens
    else:
        indices = tensor_input(TRACK, inputs, "sparse_indices")
        if indices.shape != (num_tokens, TOPK):
            raise FloorInputError(
                f"{TRACK}: sparse_indices has shape {tuple(indices.shape)}, expected ({num_tokens}, {TOPK})"
            )
        valid = indices[indices >= 0]  # -1 is padding
        valid_keys = int(valid.numel())
        distinct_rows = int(torch.unique(valid).numel())
    return Work(
        bytes_min=BYTES_PER_ROW * distinct_rows + BYTES_PER_TOKEN * num_tokens,
        flops=FLOP_PER_KEY * valid_keys,
        peak_flop_per_s=H200_PEAK_BF16_FLOP_PER_S,
    )
