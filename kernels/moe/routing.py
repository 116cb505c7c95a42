"""Kernels 1 and 2 of the MoE: zero the per-expert counters; DeepSeek-V3 no-aux routing, one warp per token
(`route_token`). A self-cleaning call (every streaming call of `kernel.py`) instead keeps its counters
zeroed between calls (`ReleaseCountsKernel`, its last launch), so it starts with the routing."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .chain import Linked, enter
from .shapes import GROUP_SIZE, NORMALISATION_EPS, NUM_GROUPS, NUM_LOCAL_EXPERTS, TOP_K, TOP_K_GROUPS

ROUTING_WARPS = 4  # tokens per CTA


# ------------------------------------------------------------------------------------------------
# 1. counters
# ------------------------------------------------------------------------------------------------


class ZeroCountsKernel(Linked):
    @cute.jit
    def launch(self, counts: cute.Tensor, stream):
        self.kernel(counts).launch(grid=[1, 1, 1], block=[NUM_LOCAL_EXPERTS, 1, 1], stream=stream, use_pdl=self.link.waits)

    @cute.kernel
    def kernel(self, counts: cute.Tensor):
        enter(self.link)
        tidx, _, _ = cute.arch.thread_idx()
        counts[tidx] = cutlass.Int32(0)


class ReleaseCountsKernel(Linked):
    """The last kernel of a call (`host.MoeHostSm90`): copies the
    call's counters out for inspection and leaves the kept counter buffer at zero for the next call
    on the stream, so that no call has to start with the zeroing launch and its host gap."""

    @cute.jit
    def launch(self, counts: cute.Tensor, counts_out: cute.Tensor, stream):
        self.kernel(counts, counts_out).launch(
            grid=[1, 1, 1], block=[NUM_LOCAL_EXPERTS, 1, 1], stream=stream, use_pdl=self.link.waits
        )

    @cute.kernel
    def kernel(self, counts: cute.Tensor, counts_out: cute.Tensor):
        enter(self.link)
        tidx, _, _ = cute.arch.thread_idx()
        counts_out[tidx] = counts[tidx]
        counts[tidx] = cutlass.Int32(0)


# ------------------------------------------------------------------------------------------------
# 2. routing
# ------------------------------------------------------------------------------------------------


@cute.jit
def _warp_argmax(value: cutlass.Float32, index: cutlass.Int32):
    """(max, its index) over the warp, all lanes get the result; equal values: the lower index."""
    for shift in cutlass.range_constexpr(5):
        offset = 16 >> shift
        other_value = cute.arch.shuffle_sync_bfly(value, offset=offset)
        other_index = cute.arch.shuffle_sync_bfly(index, offset=offset)
        take = other_value > value or (other_value == value and other_index < index)
        value = other_value if take else value
        index = other_index if take else index
    return value, index


@cute.jit
def _warp_max(value: cutlass.Float32) -> cutlass.Float32:
    for shift in cutlass.range_constexpr(5):
        value = cute.arch.fmax(value, cute.arch.shuffle_sync_bfly(value, offset=16 >> shift))
    return value


@cute.jit
def _sigmoid(x: cutlass.Float32) -> cutlass.Float32:
    return cutlass.Float32(1.0) / (cutlass.Float32(1.0) + cute.math.exp(-x, fastmath=False))


@cute.jit
def route_token(
    routing_logits: cute.Tensor,
    routing_bias: cute.Tensor,
    local_expert_offset: cutlass.Int32,
    routed_scaling_factor: cutlass.Float32,
    counts: cute.Tensor,
    expert_tokens: cute.Tensor,
    slot_expert: cute.Tensor,
    slot_rank: cute.Tensor,
    slot_weight: cute.Tensor,
    token: cutlass.Int32,
    lane: cutlass.Int32,
):
    """One warp routes one token: its top-8 experts, their weights, and for each local one a rank
    taken by an atomic increment of `counts` and the packed-list entry."""
    neg_inf = -cutlass.Float32.inf
    # biased[g] = sigmoid(logit) + bias of expert g*32 + lane.
    biased = cute.make_rmem_tensor((NUM_GROUPS,), cutlass.Float32)
    group_score = cute.make_rmem_tensor((NUM_GROUPS,), cutlass.Float32)
    for g in cutlass.range_constexpr(NUM_GROUPS):
        expert = g * GROUP_SIZE + lane
        score = _sigmoid(routing_logits[token, expert])
        biased[g] = score + routing_bias[expert].to(cutlass.Float32)
    # Group score: the sum of the group's two largest biased scores (a tie counts twice).
    for g in cutlass.range_constexpr(NUM_GROUPS):
        top1, top1_lane = _warp_argmax(biased[g], lane)
        top2 = _warp_max(neg_inf if lane == top1_lane else biased[g])
        group_score[g] = top1 + top2
    # Keep the 4 best groups (ties: the lower group); every lane computes the same.
    candidate = cute.make_rmem_tensor((NUM_GROUPS,), cutlass.Float32)
    for g in cutlass.range_constexpr(NUM_GROUPS):
        better = cutlass.Int32(0)
        for h in cutlass.range_constexpr(NUM_GROUPS):
            if cutlass.const_expr(h != g):
                if group_score[h] > group_score[g] or (group_score[h] == group_score[g] and h < g):
                    better = better + 1
        candidate[g] = biased[g] if better < TOP_K_GROUPS else neg_inf
    # Top-8 experts among the kept groups; lane k keeps the k-th choice.
    my_expert = cutlass.Int32(0)
    for k in cutlass.range_constexpr(TOP_K):
        best = neg_inf
        best_expert = cutlass.Int32(lane)
        for g in cutlass.range_constexpr(NUM_GROUPS):
            if candidate[g] > best:
                best = candidate[g]
                best_expert = cutlass.Int32(g * GROUP_SIZE) + lane
        best, best_expert = _warp_argmax(best, best_expert)
        for g in cutlass.range_constexpr(NUM_GROUPS):
            if best_expert == g * GROUP_SIZE + lane:
                candidate[g] = neg_inf
        if lane == k:
            my_expert = best_expert
    # Weights from the unbiased scores of the 8 chosen experts (lanes 0..7).
    my_score = _sigmoid(routing_logits[token, my_expert])
    total = my_score if lane < TOP_K else cutlass.Float32(0.0)
    for shift in cutlass.range_constexpr(3):  # lanes 0..7 form one butterfly group
        total = total + cute.arch.shuffle_sync_bfly(total, offset=4 >> shift)
    weight = my_score / (total + cutlass.Float32(NORMALISATION_EPS)) * routed_scaling_factor
    if lane < TOP_K:
        local = my_expert - local_expert_offset
        if local >= 0 and local < NUM_LOCAL_EXPERTS:
            rank = cute.arch.atomic_add((counts.iterator + local).llvm_ptr, cutlass.Int32(1))
            expert_tokens[local, rank] = token
            slot_expert[token, lane] = local
            slot_rank[token, lane] = rank
            slot_weight[token, lane] = weight
        else:
            slot_expert[token, lane] = cutlass.Int32(-1)
            slot_rank[token, lane] = cutlass.Int32(0)
            slot_weight[token, lane] = cutlass.Float32(0.0)


class RoutingKernel(Linked):
    @cute.jit
    def launch(
        self,
        routing_logits: cute.Tensor,
        routing_bias: cute.Tensor,
        local_expert_offset: cutlass.Int32,
        routed_scaling_factor: cutlass.Float32,
        counts: cute.Tensor,
        expert_tokens: cute.Tensor,
        slot_expert: cute.Tensor,
        slot_rank: cute.Tensor,
        slot_weight: cute.Tensor,
        stream,
    ):
        num_tokens = routing_logits.shape[0]
        self.kernel(
            routing_logits,
            routing_bias,
            local_expert_offset,
            routed_scaling_factor,
            counts,
            expert_tokens,
            slot_expert,
            slot_rank,
            slot_weight,
        ).launch(
            grid=[(num_tokens + ROUTING_WARPS - 1) // ROUTING_WARPS, 1, 1],
            block=[ROUTING_WARPS * 32, 1, 1],
            stream=stream,
            use_pdl=self.link.waits,
        )

    @cute.kernel
    def kernel(
        self,
        routing_logits: cute.Tensor,
        routing_bias: cute.Tensor,
        local_expert_offset: cutlass.Int32,
        routed_scaling_factor: cutlass.Float32,
        counts: cute.Tensor,
        expert_tokens: cute.Tensor,
        slot_expert: cute.Tensor,
        slot_rank: cute.Tensor,
        slot_weight: cute.Tensor,
    ):
        enter(self.link)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        token = bidx * ROUTING_WARPS + tidx // 32
        if token < routing_logits.shape[0]:
            route_token(
                routing_logits, routing_bias, local_expert_offset, routed_scaling_factor, counts,
                expert_tokens, slot_expert, slot_rank, slot_weight, token, tidx % 32,
            )  # fmt: skip
