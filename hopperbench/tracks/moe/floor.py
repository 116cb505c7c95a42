"""Roofline model of the MoE track (hopper_anchors.md §4.4), for hopperbench.floors.

Without inputs: uniform routing. With inputs (`routing_logits`, `routing_bias`,
`local_expert_offset`): the active local experts and the assignments of the definition's
routing, exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hopperbench.floors import H200_PEAK_FP8_FLOP_PER_S, FloorInputError, Work, axis, tensor_input

TRACK = "moe"

# MoE (§4.4): per active local expert W13 [4096, 7168] + W2 [7168, 2048] in e4m3 plus their
# fp32 block scales; per token fp8 x, its 56 fp32 scales, 256 fp32 logits, the bf16 output.
NUM_EXPERTS = 256
NUM_LOCAL_EXPERTS = 32
TOP_K = 8
NUM_GROUPS = 8
TOPK_GROUPS = 4
WEIGHT_BYTES_PER_EXPERT = 4096 * 7168 + 7168 * 2048
SCALE_BYTES_PER_EXPERT = (32 * 56 + 56 * 16) * 4
BYTES_PER_TOKEN = 7168 + 56 * 4 + NUM_EXPERTS * 4 + 7168 * 2
FLOP_PER_ASSIGNMENT = 6 * 7168 * 2048  # GEMM1 2*H*2I plus GEMM2 2*I*H


def expected_active_local_experts(seq_len: int) -> float:
    """Expected number of local experts hit by `seq_len` tokens under uniform routing.

    Each token picks 8 of 256 experts, so a given local expert is missed by one token with
    probability 31/32 and by all of them with (31/32)^T (T = 80 gives 29.5, as in §4.4).
    """
    miss = 1.0 - TOP_K / NUM_EXPERTS
    return min(float(NUM_LOCAL_EXPERTS), NUM_LOCAL_EXPERTS * (1.0 - miss**seq_len))


def local_expert_counts(
    routing_logits: torch.Tensor, routing_bias: torch.Tensor, local_expert_offset: int
) -> torch.Tensor:
    """Tokens routed to each of the 32 local experts ([32] int64) by DeepSeek-V3 no-aux routing.

    Only the selection matters here (not the weights): sigmoid scores plus bias, keep the 4 of
    8 groups with the largest top-2 sums, then the top 8 experts of the kept groups.
    """
    num_tokens = routing_logits.shape[0]
    biased = torch.sigmoid(routing_logits.float()) + routing_bias.float().reshape(1, -1)
    grouped = biased.view(num_tokens, NUM_GROUPS, NUM_EXPERTS // NUM_GROUPS)
    group_scores = grouped.topk(2, dim=2).values.sum(dim=2)
    kept_groups = group_scores.topk(TOPK_GROUPS, dim=1).indices
    group_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_kept = group_kept.repeat_interleave(NUM_EXPERTS // NUM_GROUPS, dim=1)
    chosen = biased.masked_fill(~expert_kept, float("-inf")).topk(TOP_K, dim=1).indices
    local = chosen.flatten() - int(local_expert_offset)
    local = local[(local >= 0) & (local < NUM_LOCAL_EXPERTS)]
    return torch.bincount(local, minlength=NUM_LOCAL_EXPERTS)


def work(axes: Mapping[str, int], inputs: Mapping[str, object] | None) -> Work:
    seq_len = axis(TRACK, axes, "seq_len", 1)
    if inputs is None:
        # Uniform routing: E[assignments to local experts] = T * 8 * 32 / 256 = T.
        active_experts = expected_active_local_experts(seq_len)
        assignments = float(seq_len)
    else:
        logits = tensor_input(TRACK, inputs, "routing_logits")
        if logits.shape != (seq_len, NUM_EXPERTS):
            raise FloorInputError(
                f"{TRACK}: routing_logits has shape {tuple(logits.shape)}, expected ({seq_len}, {NUM_EXPERTS})"
            )
        if "local_expert_offset" not in inputs:
            raise FloorInputError(f"{TRACK}: inputs lack 'local_expert_offset'")
        offset = int(inputs["local_expert_offset"])  # type: ignore[call-overload]
        counts = local_expert_counts(logits, tensor_input(TRACK, inputs, "routing_bias"), offset)
        active_experts = float((counts > 0).sum().item())
        assignments = float(counts.sum().item())
    per_expert = WEIGHT_BYTES_PER_EXPERT + SCALE_BYTES_PER_EXPERT
    return Work(
        bytes_min=per_expert * active_experts + BYTES_PER_TOKEN * seq_len,
        flops=FLOP_PER_ASSIGNMENT * assignments,
        peak_flop_per_s=H200_PEAK_FP8_FLOP_PER_S,
    )
