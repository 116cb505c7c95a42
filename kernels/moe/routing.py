"""The MoE's counters and routing: zero the per-expert counters of a new kept buffer (`ZeroCountsKernel`; a call's
last kernel, the combine, zeroes them again, so that no call starts with a zeroing launch); DeepSeek-V3 no-aux
routing, one warp per token (`route_token`), either as a grid of its own (`RoutingKernel`, above 1024 tokens) or
inside GEMM1's cooperative grid (`route_then_meet`; up to 4 tokens with `kernel.py`'s early-W2 variant every
CTA routes them all, `route_in_every_cta`)."""

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
        # One thread per word (32 counters; 256 walk slots): the shape is static where it is compiled.
        self.kernel(counts).launch(grid=[1, 1, 1], block=[counts.shape[0], 1, 1], stream=stream, use_pdl=self.link.waits)

    @cute.kernel
    def kernel(self, counts: cute.Tensor):
        enter(self.link)
        tidx, _, _ = cute.arch.thread_idx()
        counts[tidx] = cutlass.Int32(0)


# ------------------------------------------------------------------------------------------------
# 2. routing
# ------------------------------------------------------------------------------------------------


@cute.jit
def _sigmoid(x: cutlass.Float32) -> cutlass.Float32:
    return cutlass.Float32(1.0) / (cutlass.Float32(1.0) + cute.math.exp(-x, fastmath=False))


LANES_PER_GROUP = 4  # `route_token`: each lane holds 8 consecutive experts of one group
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
    """One warp routes one token: its top-8 experts (group-limited: the 4 groups with the best sum of their two
    best biased scores), their weights, and for each local one a rank taken by an atomic increment of `counts`
    and the packed-list entry. Lane l holds experts 8 l .. 8 l + 7 (group l / 4), so a group's two best come from
    the lane's own eight and two butterfly steps, and each of the eight picks is two `redux.sync` (the largest
    biased score as an ordered key, then the lowest expert holding it): a dependent chain ~170 shuffles shorter
    than one that holds one expert of each group per lane, with the same choices, slots and weights. Ties: the
    lower group, the lower expert."""
    my_expert, weight = choose_experts(routing_logits, routing_bias, routed_scaling_factor, token, lane)
    if lane < TOP_K:
        local = my_expert - local_expert_offset
        if local >= 0 and local < NUM_LOCAL_EXPERTS:
            rank = cute.arch.atomic_add((counts.iterator + local).llvm_ptr, cutlass.Int32(1))
            _record_local(expert_tokens, slot_expert, slot_rank, slot_weight, token, lane, local, rank, weight)
        else:
            _record_not_local(slot_expert, slot_rank, slot_weight, token, lane)


@cute.jit
def _record_local(expert_tokens, slot_expert, slot_rank, slot_weight, token, lane, local, rank, weight):
    """Slot `lane` of `token` holds local expert `local`, its rank among that expert's tokens and its weight; the
    expert's packed list holds the token at that rank."""
    expert_tokens[local, rank] = token
    slot_expert[token, lane] = local
    slot_rank[token, lane] = rank
    slot_weight[token, lane] = weight


@cute.jit
def _record_not_local(slot_expert, slot_rank, slot_weight, token, lane):
    """Slot `lane` of `token` chose an expert outside the 32 local ones: -1, rank 0, weight 0 (the combine skips it)."""
    slot_expert[token, lane] = cutlass.Int32(-1)
    slot_rank[token, lane] = cutlass.Int32(0)
    slot_weight[token, lane] = cutlass.Float32(0.0)


@cute.jit
def choose_experts(
    routing_logits: cute.Tensor,
    routing_bias: cute.Tensor,
    routed_scaling_factor: cutlass.Float32,
    token: cutlass.Int32,
    lane: cutlass.Int32,
):
    """`route_token`'s choice for one token by one warp: (the k-th chosen global expert, its weight) in lane k < 8."""
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
    # Weights from the unbiased scores of the 8 chosen experts (lanes 0..7).
    total = my_score if lane < TOP_K else cutlass.Float32(0.0)
    for shift in cutlass.range_constexpr(3):  # lanes 0..7 form one butterfly group
        total = total + cute.arch.shuffle_sync_bfly(total, offset=4 >> shift)
    weight = my_score / (total + cutlass.Float32(NORMALISATION_EPS)) * routed_scaling_factor
    return my_expert, weight


@cute.jit
def route_then_meet(
    routing,
    counts: cute.Tensor,
    expert_tokens: cute.Tensor,
    cta: cutlass.Int32,
    grid: cutlass.Int32,
    tidx: cutlass.Int32,
    choices=None,
    extra_warps: cutlass.Constexpr = False,
):
    """The routing inside GEMM1, the first kernel of a call up to 1024 tokens: warp w of CTA c routes
    tokens 4 c + w, + 4 grid, ... (`route_token`), then the CTAs meet: each adds its number of routed tokens to
    the kept count `routed[0]` and waits until it reaches T, so that every CTA's schedule reads complete counts
    and lists.
    The launch must be cooperative (every CTA resident, or the wait never ends); `routing` is (routing_logits,
    routing_bias, local_expert_offset, routed_scaling_factor, slot_expert, slot_rank, slot_weight, routed) and the
    call's last kernel zeroes `routed` again (`combine.release_counters`). The barrier is cooperative groups' grid
    sync: a CTA barrier, then thread 0 fences, adds, polls and fences again, then a CTA barrier.
    `choices` (ROUTING_WARPS x TOP_K words of shared memory): up to ROUTING_WARPS tokens every CTA routes
    them all instead (`route_in_every_cta`) and meets no other. `extra_warps` (the producer-warp GEMM1): the CTA has warps beyond the
    first ROUTING_WARPS, which route nothing but take part in the meeting's CTA barriers."""
    if cutlass.const_expr(choices is not None):
        if routing[0].shape[0] <= ROUTING_WARPS:
            route_in_every_cta(routing, counts, expert_tokens, choices, cta, tidx)
        else:
            _route_share_and_meet(routing, counts, expert_tokens, cta, grid, tidx)
    else:
        _route_share_and_meet(routing, counts, expert_tokens, cta, grid, tidx, extra_warps)


@cute.jit
def _route_share_and_meet(
    routing,
    counts: cute.Tensor,
    expert_tokens: cute.Tensor,
    cta: cutlass.Int32,
    grid: cutlass.Int32,
    tidx: cutlass.Int32,
    extra_warps: cutlass.Constexpr = False,
):
    """`route_then_meet`'s grid-shared routing and meeting."""
    (
        routing_logits, routing_bias, local_expert_offset, routed_scaling_factor, slot_expert, slot_rank,
        slot_weight, routed,
    ) = routing  # fmt: skip
    num_tokens = routing_logits.shape[0]
    warp_id = tidx // 32
    routed_end = num_tokens
    if cutlass.const_expr(extra_warps):
        if warp_id >= ROUTING_WARPS:
            routed_end = cutlass.Int32(0)  # its tokens are the next CTA's warps'
    for token in cutlass.range(cta * ROUTING_WARPS + warp_id, routed_end, grid * ROUTING_WARPS, unroll=1):
        route_token(
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
        wait_until_routed(routed, num_tokens)
    cute.arch.sync_threads()


@cute.jit
def route_in_every_cta(
    routing, counts: cute.Tensor, expert_tokens: cute.Tensor, choices: cute.Tensor, cta: cutlass.Int32, tidx: cutlass.Int32
):
    """Up to ROUTING_WARPS tokens: the CTA routes every token itself, warp w token w
    (`choose_experts`), keeps the chosen local experts in `choices` (shared memory, token-major) and takes each rank
    as the number of earlier tokens that chose the same expert (a token chooses an expert once). Every CTA computes the
    same counts, lists and slots and writes them (identical values), so none waits for another; its own schedule reads
    its own writes after the CTA barrier. CTA 0 then adds T to the kept routed count for a GEMM2 that reads the
    schedule before its programmatic wait (`wait_until_routed`); the call's last kernel zeroes it and the counts."""
    (
        routing_logits, routing_bias, local_expert_offset, routed_scaling_factor, slot_expert, slot_rank,
        slot_weight, routed,
    ) = routing  # fmt: skip
    num_tokens = routing_logits.shape[0]
    token = tidx // 32
    lane = tidx % 32
    local = cutlass.Int32(-1)
    weight = cutlass.Float32(0.0)
    if token < num_tokens:
        my_expert, my_weight = choose_experts(routing_logits, routing_bias, routed_scaling_factor, token, lane)
        weight = my_weight
        if lane < TOP_K:
            local = my_expert - local_expert_offset
            if local < 0 or local >= NUM_LOCAL_EXPERTS:
                local = cutlass.Int32(-1)
            choices[token * TOP_K + lane] = local
    cute.arch.sync_threads()
    if token < num_tokens and lane < TOP_K:
        if local >= 0:
            rank = cutlass.Int32(0)
            for earlier in cutlass.range(token * TOP_K, unroll=1):
                if choices[earlier] == local:
                    rank = rank + 1
            _record_local(expert_tokens, slot_expert, slot_rank, slot_weight, token, lane, local, rank, weight)
        else:
            _record_not_local(slot_expert, slot_rank, slot_weight, token, lane)
    if tidx < NUM_LOCAL_EXPERTS:
        count = cutlass.Int32(0)
        for slot in cutlass.range(num_tokens * TOP_K, unroll=1):
            if choices[slot] == tidx:
                count = count + 1
        counts[tidx] = count
    cute.arch.sync_threads()
    if cta == 0 and tidx == 0:
        # Release: the CTA's writes (ordered before this thread's by the barrier) before the count GEMM2 polls.
        cute.arch.fence_acq_rel_gpu()
        cute.arch.atomic_add(routed.iterator.llvm_ptr, num_tokens, scope="gpu")


@cute.jit
def wait_until_routed(routed: cute.Tensor, num_tokens: cutlass.Int32):
    """One thread polls the kept count of routed tokens until it reaches T, then fences (acquire): the counts and
    lists that every routing CTA released before its add are then visible to its CTA after a CTA barrier. Used by
    `route_then_meet` and by a GEMM2 that reads the schedule before its programmatic wait."""
    seen = cute.arch.atomic_add(routed.iterator.llvm_ptr, cutlass.Int32(0), scope="gpu")
    while seen < num_tokens:
        seen = cute.arch.atomic_add(routed.iterator.llvm_ptr, cutlass.Int32(0), scope="gpu")
    cute.arch.fence_acq_rel_gpu()


class RoutingKernel(Linked):
    @cute.jit
    def launch(self, routing_args, counts: cute.Tensor, expert_tokens: cute.Tensor, stream):
        """`routing_args`: (routing_logits, routing_bias, local_expert_offset, routed_scaling_factor, slot_expert,
        slot_rank, slot_weight), as the host hands them to either routing (`route_then_meet` appends `routed`)."""
        (
            routing_logits, routing_bias, local_expert_offset, routed_scaling_factor, slot_expert, slot_rank,
            slot_weight,
        ) = routing_args  # fmt: skip
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
