"""Roofline floors per track: the least time any H200 kernel could take on a workload.

    floor_us = max(bytes_min / bandwidth, flops / peak) + t_lat

The byte and FLOP models are those of `../shared/notes/hopper_anchors.md` (§1 constants,
§2.3 DSA, §3.4 GDN, §4.4 MoE). Every byte counts as an HBM byte because the timer flushes
L2 before every call. `t_lat` is the measured CUPTI span of an empty kernel on the device
(1.15 us on our H200, hopper_anchors.md §8); the caller passes it in so that a floor
always goes with the machine it was measured on.

Without `inputs` the data-dependent quantities are estimated (DSA: no padding and no index
shared between tokens; MoE: uniform routing; GDN: an input state is present). With
`inputs` (the workload's tensors by definition name) they are counted exactly.

Results rows use only exact floors: the worker records `trial_floor` of each timed trial's
inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict

from hopperbench.results import TrialFloor
from hopperbench.tracks import Track, get_track

# hopper_anchors.md §1: copy bandwidth measured on our H200; bf16 dense rate measured; FP8 rate
# assumed from DeepGEMM's 1550 TFLOPS on H800 (same SM array).
H200_BANDWIDTH_BYTES_PER_S = 4.3e12
H200_PEAK_BF16_FLOP_PER_S = 790e12
H200_PEAK_FP8_FLOP_PER_S = 1.5e15

# DSA (§2.3): one gathered cache row is 512 ckv + 64 kpe bf16 values; per token the indices
# (2048 int32), q_nope + q_pe (16 x 576 bf16), output (16 x 512 bf16) and lse (16 f32).
DSA_TOPK = 2048
DSA_BYTES_PER_ROW = (512 + 64) * 2
DSA_BYTES_PER_TOKEN = DSA_TOPK * 4 + 16 * 576 * 2 + 16 * 512 * 2 + 16 * 4
DSA_FLOP_PER_KEY = 2 * 16 * ((512 + 64) + 512)

# MoE (§4.4): per active local expert W13 [4096, 7168] + W2 [7168, 2048] in e4m3 plus their
# fp32 block scales; per token fp8 x, its 56 fp32 scales, 256 fp32 logits, the bf16 output.
MOE_NUM_EXPERTS = 256
MOE_NUM_LOCAL_EXPERTS = 32
MOE_TOP_K = 8
MOE_NUM_GROUPS = 8
MOE_TOPK_GROUPS = 4
MOE_WEIGHT_BYTES_PER_EXPERT = 4096 * 7168 + 7168 * 2048
MOE_SCALE_BYTES_PER_EXPERT = (32 * 56 + 56 * 16) * 4
MOE_BYTES_PER_TOKEN = 7168 + 56 * 4 + MOE_NUM_EXPERTS * 4 + 7168 * 2
MOE_FLOP_PER_ASSIGNMENT = 6 * 7168 * 2048  # GEMM1 2*H*2I plus GEMM2 2*I*H

# GDN (§3.4): per token q, k (4 x 128 bf16 each), v (8 x 128 bf16), a and b (8 bf16 each) and
# output (8 x 128 bf16); each state read or write is 8 x 128 x 128 fp32 per sequence. FLOP is
# the chunked form with chunk C = 64: T * HV * (6 d^2 + 10 C d + 0.7 C^2).
GDN_BYTES_PER_TOKEN = 1024 + 1024 + 2048 + 16 + 16 + 2048
GDN_STATE_BYTES_PER_SEQUENCE = 8 * 128 * 128 * 4
GDN_CHUNK = 64
GDN_FLOP_PER_TOKEN = 8 * (6 * 128**2 + 10 * GDN_CHUNK * 128 + 0.7 * GDN_CHUNK**2)


class FloorInputError(ValueError):
    """The axes or inputs given to `floor` do not describe a workload of the track."""


class Floor(BaseModel):
    """A roofline floor of one workload. Bytes and FLOP are expectations when estimated."""

    model_config = ConfigDict(frozen=True)

    bytes_min: float
    flops: float
    memory_us: float
    compute_us: float
    floor_us: float

    @property
    def core_us(self) -> float:
        """The floor without the empty-kernel span."""
        return max(self.memory_us, self.compute_us)


@dataclass(frozen=True)
class _Work:
    bytes_min: float
    flops: float
    peak_flop_per_s: float


def floor(
    track: Track | str,
    workload_axes: Mapping[str, int],
    *,
    t_lat_us: float,
    bandwidth: float = H200_BANDWIDTH_BYTES_PER_S,
    inputs: Mapping[str, object] | None = None,
) -> Floor:
    """The roofline floor of one workload of `track`.

    `workload_axes` are the workload's variable axes (e.g. `{"num_tokens": 8, "num_pages": 8462}`);
    `inputs`, when given, are the workload's inputs by definition name and make the
    data-dependent terms exact (DSA: `sparse_indices`; MoE: `routing_logits`, `routing_bias`,
    `local_expert_offset`; GDN: `state`, None when absent).
    """
    if t_lat_us < 0:
        raise FloorInputError(f"t_lat_us must be >= 0, got {t_lat_us}")
    if bandwidth <= 0:
        raise FloorInputError(f"bandwidth must be > 0 B/s, got {bandwidth}")
    name = track.name if isinstance(track, Track) else get_track(track).name
    work = _WORK_MODELS[name](workload_axes, inputs)
    memory_us = work.bytes_min / bandwidth * 1e6
    compute_us = work.flops / work.peak_flop_per_s * 1e6
    return Floor(
        bytes_min=work.bytes_min,
        flops=work.flops,
        memory_us=memory_us,
        compute_us=compute_us,
        floor_us=max(memory_us, compute_us) + t_lat_us,
    )


def _axis(track: str, axes: Mapping[str, int], name: str, minimum: int) -> int:
    if name not in axes:
        raise FloorInputError(f"{track}: workload axes lack {name!r} (got {sorted(axes)})")
    value = int(axes[name])
    if value < minimum:
        raise FloorInputError(f"{track}: axis {name!r} must be >= {minimum}, got {value}")
    return value


def _tensor_input(track: str, inputs: Mapping[str, object], name: str) -> torch.Tensor:
    value = inputs.get(name)
    if not isinstance(value, torch.Tensor):
        raise FloorInputError(f"{track}: inputs lack tensor {name!r}")
    return value


def _dsa_work(axes: Mapping[str, int], inputs: Mapping[str, object] | None) -> _Work:
    num_tokens = _axis("dsa_attention", axes, "num_tokens", 1)
    if inputs is None:
        # No padding, and no row shared between tokens (random indices overlap ~1 %, §2.3).
        valid_keys = distinct_rows = DSA_TOPK * num_tokens
    else:
        indices = _tensor_input("dsa_attention", inputs, "sparse_indices")
        if indices.shape != (num_tokens, DSA_TOPK):
            raise FloorInputError(
                f"dsa_attention: sparse_indices has shape {tuple(indices.shape)}, expected ({num_tokens}, {DSA_TOPK})"
            )
        valid = indices[indices >= 0]  # -1 is padding
        valid_keys = int(valid.numel())
        distinct_rows = int(torch.unique(valid).numel())
    return _Work(
        bytes_min=DSA_BYTES_PER_ROW * distinct_rows + DSA_BYTES_PER_TOKEN * num_tokens,
        flops=DSA_FLOP_PER_KEY * valid_keys,
        peak_flop_per_s=H200_PEAK_BF16_FLOP_PER_S,
    )


def expected_active_local_experts(seq_len: int) -> float:
    """Expected number of local experts hit by `seq_len` tokens under uniform routing.

    Each token picks 8 of 256 experts, so a given local expert is missed by one token with
    probability 31/32 and by all of them with (31/32)^T (T = 80 gives 29.5, as in §4.4).
    """
    miss = 1.0 - MOE_TOP_K / MOE_NUM_EXPERTS
    return min(float(MOE_NUM_LOCAL_EXPERTS), MOE_NUM_LOCAL_EXPERTS * (1.0 - miss**seq_len))


def moe_local_expert_counts(
    routing_logits: torch.Tensor, routing_bias: torch.Tensor, local_expert_offset: int
) -> torch.Tensor:
    """Tokens routed to each of the 32 local experts ([32] int64) by DeepSeek-V3 no-aux routing.

    Only the selection matters here (not the weights): sigmoid scores plus bias, keep the 4 of
    8 groups with the largest top-2 sums, then the top 8 experts of the kept groups.
    """
    num_tokens = routing_logits.shape[0]
    biased = torch.sigmoid(routing_logits.float()) + routing_bias.float().reshape(1, -1)
    grouped = biased.view(num_tokens, MOE_NUM_GROUPS, MOE_NUM_EXPERTS // MOE_NUM_GROUPS)
    group_scores = grouped.topk(2, dim=2).values.sum(dim=2)
    kept_groups = group_scores.topk(MOE_TOPK_GROUPS, dim=1).indices
    group_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_kept = group_kept.repeat_interleave(MOE_NUM_EXPERTS // MOE_NUM_GROUPS, dim=1)
    chosen = biased.masked_fill(~expert_kept, float("-inf")).topk(MOE_TOP_K, dim=1).indices
    local = chosen.flatten() - int(local_expert_offset)
    local = local[(local >= 0) & (local < MOE_NUM_LOCAL_EXPERTS)]
    return torch.bincount(local, minlength=MOE_NUM_LOCAL_EXPERTS)


def _moe_work(axes: Mapping[str, int], inputs: Mapping[str, object] | None) -> _Work:
    seq_len = _axis("moe", axes, "seq_len", 1)
    if inputs is None:
        # Uniform routing: E[assignments to local experts] = T * 8 * 32 / 256 = T.
        active_experts = expected_active_local_experts(seq_len)
        assignments = float(seq_len)
    else:
        logits = _tensor_input("moe", inputs, "routing_logits")
        if logits.shape != (seq_len, MOE_NUM_EXPERTS):
            raise FloorInputError(
                f"moe: routing_logits has shape {tuple(logits.shape)}, expected ({seq_len}, {MOE_NUM_EXPERTS})"
            )
        if "local_expert_offset" not in inputs:
            raise FloorInputError("moe: inputs lack 'local_expert_offset'")
        offset = int(inputs["local_expert_offset"])  # type: ignore[call-overload]
        counts = moe_local_expert_counts(logits, _tensor_input("moe", inputs, "routing_bias"), offset)
        active_experts = float((counts > 0).sum().item())
        assignments = float(counts.sum().item())
    per_expert = MOE_WEIGHT_BYTES_PER_EXPERT + MOE_SCALE_BYTES_PER_EXPERT
    return _Work(
        bytes_min=per_expert * active_experts + MOE_BYTES_PER_TOKEN * seq_len,
        flops=MOE_FLOP_PER_ASSIGNMENT * assignments,
        peak_flop_per_s=H200_PEAK_FP8_FLOP_PER_S,
    )


def _gdn_work(axes: Mapping[str, int], inputs: Mapping[str, object] | None) -> _Work:
    total_seq_len = _axis("gdn_prefill", axes, "total_seq_len", 1)
    num_seqs = _axis("gdn_prefill", axes, "num_seqs", 1)
    # Without inputs assume an input state, as in the contest (inference, §3.4).
    has_state = True if inputs is None else inputs.get("state") is not None
    state_transfers = 2 if has_state else 1  # new_state is always written
    return _Work(
        bytes_min=GDN_BYTES_PER_TOKEN * total_seq_len + GDN_STATE_BYTES_PER_SEQUENCE * num_seqs * state_transfers,
        flops=GDN_FLOP_PER_TOKEN * total_seq_len,
        peak_flop_per_s=H200_PEAK_BF16_FLOP_PER_S,
    )


_WORK_MODELS: dict[str, Callable[[Mapping[str, int], Mapping[str, object] | None], _Work]] = {
    "dsa_attention": _dsa_work,
    "moe": _moe_work,
    "gdn_prefill": _gdn_work,
}


# ------------------------------------------------------------------------------------------
# Per-trial floors of results rows


def trial_floor(track: Track | str, workload_axes: Mapping[str, int], inputs: Mapping[str, object]) -> TrialFloor:
    """The exact floor of one trial's inputs, without the empty-kernel span (each machine adds its own).

    May read GPU tensors and so synchronize; raises FloorInputError when the inputs do not fit the model."""
    f = floor(track, workload_axes, t_lat_us=0.0, inputs=inputs)
    return TrialFloor(bytes_min=f.bytes_min, core_us=f.core_us)


