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
    def launch(self, counts: cute.Tensor, counts_out: cute.Tensor, stream, routed=None):
        """`routed`: the kept count of `route_then_meet` (candidate v2.16), zeroed with the counters; None
        where the call routes in a kernel of its own."""
        self.kernel(counts, counts_out, routed).launch(
            grid=[1, 1, 1], block=[NUM_LOCAL_EXPERTS, 1, 1], stream=stream, use_pdl=self.link.waits
        )

    @cute.kernel
    def kernel(self, counts: cute.Tensor, counts_out: cute.Tensor, routed):
        enter(self.link)
        tidx, _, _ = cute.arch.thread_idx()
        counts_out[tidx] = counts[tidx]
        counts[tidx] = cutlass.Int32(0)
        if cutlass.const_expr(routed is not None):
            if tidx == 0:
                routed[0] = cutlass.Int32(0)


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
    _write_choices(
        local_expert_offset, routed_scaling_factor, counts, expert_tokens, slot_expert, slot_rank, slot_weight,
        token, lane, my_expert, my_score,
    )  # fmt: skip


@cute.jit
def _write_choices(
    local_expert_offset: cutlass.Int32,
    routed_scaling_factor: cutlass.Float32,
    counts: cute.Tensor,
    expert_tokens: cute.Tensor,
    slot_expert: cute.Tensor,
    slot_rank: cute.Tensor,
    slot_weight: cute.Tensor,
    token: cutlass.Int32,
    lane: cutlass.Int32,
    my_expert: cutlass.Int32,
    my_score: cutlass.Float32,
):
    """Lane k < 8 holds the token's k-th choice and its unbiased score: the weights (normalised over the
    eight), and for a local expert a rank taken by an atomic increment of `counts` and the packed-list entry."""
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


LANES_PER_GROUP = 4  # `route_token_by_lanes`: each lane holds 8 consecutive experts of one group
EXPERTS_PER_LANE = GROUP_SIZE // LANES_PER_GROUP  # 8
NOT_CHOSEN = 0x7FFFFFFF  # above every expert id: `warp_redux_sync`'s unsigned min never picks it


@cute.jit
def _orderable(value: cutlass.Float32) -> cutlass.Int32:
    """value's bits, turned so that their unsigned order is value's order (finite values and -inf; a -0.0
    would sort below +0.0, but sigmoid + bias is never -0.0: both terms would have to be)."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 b, m; mov.b32 b, {$r0}; shr.s32 m, b, 31; or.b32 m, m, 0x80000000; xor.b32 {$w0}, b, m; }",
        write_only_types=[cutlass.Int32],
        read_only_args=[value],
    )


@cute.jit
def route_token_by_lanes(
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
    """`route_token`'s choices, weights and writes with a shorter dependent chain (v2.15, used by v2.16): lane l
    holds experts 8 l .. 8 l + 7 (group l / 4), so a group's two best come from the lane's own eight and two
    butterfly steps, and each of the eight picks is two `redux.sync` (the largest biased score as an ordered
    key, then the lowest expert holding it) instead of ten shuffles and their selects. The same comparisons
    and ties (lower group, lower expert) and the same float arithmetic as `route_token`: the same experts
    in the same slots with the same weights."""
    neg_inf = -cutlass.Float32.inf
    first = lane * EXPERTS_PER_LANE
    score = cute.make_rmem_tensor((EXPERTS_PER_LANE,), cutlass.Float32)
    biased = cute.make_rmem_tensor((EXPERTS_PER_LANE,), cutlass.Float32)
    for j in cutlass.range_constexpr(EXPERTS_PER_LANE):
        score[j] = _sigmoid(routing_logits[token, first + j])
        biased[j] = score[j] + routing_bias[first + j].to(cutlass.Float32)
    # The group's two largest biased scores (a tie counts twice): the lane's own, then merged over its
    # group's four lanes.
    top1 = neg_inf
    top2 = neg_inf
    for j in cutlass.range_constexpr(EXPERTS_PER_LANE):
        top2 = cute.arch.fmax(top2, cute.arch.fmin(top1, biased[j]))
        top1 = cute.arch.fmax(top1, biased[j])
    for shift in cutlass.range_constexpr(2):
        other1 = cute.arch.shuffle_sync_bfly(top1, offset=1 << shift)
        other2 = cute.arch.shuffle_sync_bfly(top2, offset=1 << shift)
        top2 = cute.arch.fmax(cute.arch.fmax(top2, other2), cute.arch.fmin(top1, other1))
        top1 = cute.arch.fmax(top1, other1)
    group_score = top1 + top2
    # Keep the lane's group if fewer than 4 groups beat it (ties: the lower group).
    group = lane // LANES_PER_GROUP
    better = cutlass.Int32(0)
    for h in cutlass.range_constexpr(NUM_GROUPS):
        other = cute.arch.shuffle_sync(group_score, offset=h * LANES_PER_GROUP)
        if other > group_score or (other == group_score and h < group):
            better = better + 1
    candidate = cute.make_rmem_tensor((EXPERTS_PER_LANE,), cutlass.Float32)
    for j in cutlass.range_constexpr(EXPERTS_PER_LANE):
        candidate[j] = biased[j] if better < TOP_K_GROUPS else neg_inf
    # Top-8 experts among the kept groups, in order; lane k keeps the k-th choice and its unbiased score.
    my_expert = cutlass.Int32(0)
    my_score = cutlass.Float32(0.0)
    for k in cutlass.range_constexpr(TOP_K):
        best = neg_inf
        best_j = cutlass.Int32(0)
        best_score = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(EXPERTS_PER_LANE):
            if candidate[j] > best:  # strict: the lane's lowest expert among equals
                best = candidate[j]
                best_j = cutlass.Int32(j)
                best_score = score[j]
        key = _orderable(best)
        top_key = cute.arch.warp_redux_sync(key, "umax")
        chosen = cute.arch.warp_redux_sync(first + best_j if key == top_key else cutlass.Int32(NOT_CHOSEN), "umin")
        chosen_score = cute.arch.shuffle_sync(best_score, offset=chosen // EXPERTS_PER_LANE)
        for j in cutlass.range_constexpr(EXPERTS_PER_LANE):
            if chosen == first + j:
                candidate[j] = neg_inf
        if lane == k:
            my_expert = chosen
            my_score = chosen_score
    _write_choices(
        local_expert_offset, routed_scaling_factor, counts, expert_tokens, slot_expert, slot_rank, slot_weight,
        token, lane, my_expert, my_score,
    )  # fmt: skip


@cute.jit
def route_then_meet(routing, counts: cute.Tensor, expert_tokens: cute.Tensor, cta: cutlass.Int32, grid: cutlass.Int32, tidx: cutlass.Int32):
    """The routing inside the first kernel of the call (candidate v2.16): warp w of CTA c routes tokens 4 c + w,
    + 4 grid, ... (`route_token_by_lanes`), then the CTAs meet: each adds its number of routed tokens to the kept
    count `routed[0]` and waits until it reaches T, so that every CTA's schedule reads complete counts and lists.
    The launch must be cooperative (every CTA resident, or the wait never ends); `routing` is (routing_logits,
    routing_bias, local_expert_offset, routed_scaling_factor, slot_expert, slot_rank, slot_weight, routed) and the
    call's last kernel zeroes `routed` again (`ReleaseCountsKernel`). The barrier is cooperative groups' grid sync:
    a CTA barrier, then thread 0 fences, adds, polls and fences again, then a CTA barrier."""
    (
        routing_logits, routing_bias, local_expert_offset, routed_scaling_factor, slot_expert, slot_rank,
        slot_weight, routed,
    ) = routing  # fmt: skip
    num_tokens = routing_logits.shape[0]
    warp_id = tidx // 32
    for token in cutlass.range(cta * ROUTING_WARPS + warp_id, num_tokens, grid * ROUTING_WARPS, unroll=1):
        route_token_by_lanes(
            routing_logits, routing_bias, local_expert_offset, routed_scaling_factor, counts, expert_tokens,
            slot_expert, slot_rank, slot_weight, token, tidx % 32,
        )  # fmt: skip
    cute.arch.sync_threads()
    if tidx == 0:
        mine = cutlass.Int32(0)
        for first in cutlass.range(cta * ROUTING_WARPS, num_tokens, grid * ROUTING_WARPS, unroll=1):
            mine = mine + cutlass.min(num_tokens - first, ROUTING_WARPS)
        cute.arch.fence_acq_rel_gpu()
        if mine > 0:
            cute.arch.atomic_add(routed.iterator.llvm_ptr, mine, scope="gpu")
        seen = cute.arch.atomic_add(routed.iterator.llvm_ptr, cutlass.Int32(0), scope="gpu")
        while seen < num_tokens:
            seen = cute.arch.atomic_add(routed.iterator.llvm_ptr, cutlass.Int32(0), scope="gpu")
        cute.arch.fence_acq_rel_gpu()
    cute.arch.sync_threads()


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
