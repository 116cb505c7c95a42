"""Both expert GEMMs of the MoE in one cooperative kernel (`kernel.py`'s FUSED_T variant, `Handover.FUSED`, from
EARLY_W2_MAX_TOKENS + 1 to WGMMA_GEMM1_MIN_TOKENS - 1): its CTAs go on from their GEMM1 items to GEMM2 items as soon as the
items' expert has all its GEMM1 items done, instead of two kernels chained by a programmatic launch.

Why (NOTES.md): at few tokens DRAM idles between the GEMMs: GEMM1's last round, the hand-over to GEMM2 (whose
CTAs become resident as GEMM1's retire, wait for the whole GEMM1 grid, build their schedule, then issue their first
stages) and GEMM2's own ramp. Here GEMM1's items are walked round robin in expert order, so the first experts complete
first, and a CTA that has no GEMM1 item left streams W2 for them while the others finish GEMM1 (7 tokens 1.028x,
14-32 tokens 1.024-1.068x over the two chained kernels).

The kernel: routing and meeting as the routing GEMM1's (`routing.route_then_meet`), CTA 0 zeroing the call's readiness
words before the meeting (so that every later signal follows the zeroing); GEMM1 + SwiGLU exactly as the `mma.sync`
streaming GEMM (items cta, cta + grid, ...), each item then signalled by thread 0 after the CTA barrier that follows its
epilogue (a gpu-scope fence and an add to its expert's counter and to the total, as a cooperative grid barrier
releases); GEMM2 as the `mma.sync` streaming GEMM computes it, CTA c's first item c and each later one the next
claim of a kept counter (`claim_item`), so that the SMs that finish first take the tail, thread 0 making sure of an
item's expert before the barrier after which its activations (C) are loaded: once the total shows every GEMM1 item
done it checks no more, else it polls the expert's counter (acquire) until all of that expert's GEMM1 items are in. No CTA waits for a
GEMM1 item that is not already its own or another resident CTA's, so the polls end (cooperative launch). The combine
stays the next kernel (programmatic dependent). The same items, products and promotions as the two streaming GEMMs:
outputs bit for bit.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .chain import ChainLink, chain_links, enter
from .combine import CombineKernel
from .routing import route_then_meet
from .shapes import NUM_LOCAL_EXPERTS
from .streaming_gemm import (
    GEMM1_ITEMS_PER_ROW_TILE,
    GEMM2_ITEMS_PER_ROW_TILE,
    M_TILES,
    StreamingConfigError,
    StreamingGemm,
    StreamingGemmConfig,
    copy_atoms,
    launch_persistent,
    locate_row_tile,
    schedule_tables,
    smem_region,
    stage_layouts,
)

__all__ = ["ITEM_CLAIMS_WORD", "READY_WORDS", "FusedExpertGemms", "FusedGemmsConfig", "FusedMoeHost"]

# Readiness words: GEMM1 items done per local expert, then their total.
TOTAL_WORD = NUM_LOCAL_EXPERTS
READY_WORDS = NUM_LOCAL_EXPERTS + 1
ITEM_CLAIMS_WORD = 1  # the word of the kept routed-count buffer that the GEMM2 phase claims its items from


class FusedGemmsConfig(StreamingGemmConfig):
    """The fused kernel's shared memory: the `mma.sync` GEMM2's (which holds GEMM1's: the same rings, GEMM1 viewing
    the activation ring, bf16 for C, as fp8) and the word in which thread 0 publishes its claims to the CTA."""

    def __init__(self, block_tokens: int, num_stages: int):
        super().__init__(gemm1=False, block_tokens=block_tokens, num_stages=num_stages)

    def fields(self) -> dict:
        return {**super().fields(), "claimed_item": smem_region(Int32, 4, 16)}


@cute.jit
def signal_item_done(ready: cute.Tensor, expert: Int32):
    """Thread 0, after the CTA barrier that follows an item's epilogue: release the CTA's C stores (gpu-scope fence,
    as a cooperative grid barrier does), then count the item for its expert and in the total."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.atomic_add((ready.iterator + expert).llvm_ptr, Int32(1), scope="gpu")
    cute.arch.atomic_add((ready.iterator + TOTAL_WORD).llvm_ptr, Int32(1), scope="gpu")


@cute.jit
def wait_for_expert(
    ready: cute.Tensor, item: Int32, total_gemm1_items: Int32, verified: Int32, tile_end: cute.Tensor,
    expert_count: cute.Tensor, expert_offset: cute.Tensor, block_tokens: cutlass.Constexpr,
) -> Int32:  # fmt: skip
    """Thread 0 of a CTA before the barrier after which GEMM2 item `item`'s activations are loaded: return with every
    GEMM1 item of its expert done and acquired. `verified` is the highest expert known complete (NUM_LOCAL_EXPERTS
    once the total was seen complete); claims only grow, so an expert at or below it needs no check. Returns the new
    `verified`."""
    expert, _, _, _ = locate_row_tile(
        item // GEMM2_ITEMS_PER_ROW_TILE, block_tokens, tile_end, expert_count, expert_offset
    )
    if expert > verified:
        done = cute.arch.atomic_add((ready.iterator + TOTAL_WORD).llvm_ptr, Int32(0), scope="gpu")
        if done == total_gemm1_items:
            verified = Int32(NUM_LOCAL_EXPERTS)
        else:
            first_tile = Int32(0)
            if expert > 0:
                first_tile = tile_end[expert - 1]
            needed = (tile_end[expert] - first_tile) * GEMM1_ITEMS_PER_ROW_TILE
            seen = cute.arch.atomic_add((ready.iterator + expert).llvm_ptr, Int32(0), scope="gpu")
            while seen < needed:
                seen = cute.arch.atomic_add((ready.iterator + expert).llvm_ptr, Int32(0), scope="gpu")
            verified = expert
        cute.arch.fence_acq_rel_gpu()
    return verified


@cute.jit
def claim_item(routed: cute.Tensor) -> Int32:
    """Thread 0 of a CTA in the GEMM2 phase: the next claim of the kept counter in word
    ITEM_CLAIMS_WORD of the kept routed-count buffer (`counters.kept_routed`); claim n is item grid + n. A CTA claims
    until a claim is past the last item, so each launch makes exactly one failing claim per CTA and the counter ends
    at max(items - grid, 0) + grid (`release_claims`)."""
    return cute.arch.atomic_add((routed.iterator + ITEM_CLAIMS_WORD).llvm_ptr, Int32(1), scope="gpu")


@cute.jit
def publish_claim(claimed_word: cute.Tensor, pending: Int32, routed: cute.Tensor, total_items: Int32, grid: Int32):
    """Thread 0 of a CTA in the GEMM2 phase, at the stage before its load side needs a new item: publish the
    pending claim in shared memory (its threads read it after the next barrier) and, if that claim is an item, claim
    the one after. Returns the claim now pending."""
    claimed_word[0] = pending
    if grid + pending < total_items:
        pending = claim_item(routed)
    return pending


@cute.jit
def release_claims(routed: cute.Tensor, last_claim: Int32, total_items: Int32, grid: Int32):
    """The CTA whose failing claim was the launch's last (every CTA has made its one failing claim, so no claim
    follows it) brings the counter back to zero for the next launch, which stream order places after this one."""
    final_claim = cutlass.max(total_items - grid, 0) + grid - 1
    if last_claim == final_claim:
        cute.arch.atomic_add((routed.iterator + ITEM_CLAIMS_WORD).llvm_ptr, -(final_claim + 1), scope="gpu")


class FusedExpertGemms:
    """GEMM1 + SwiGLU and GEMM2 in one cooperative persistent grid (the module's docstring), the call's first kernel:
    `gemm1` and `gemm2` are the two `mma.sync` streaming GEMMs whose loops it runs, on one row tile (one table serves
    both phases) and one pipeline depth, GEMM2 claiming its items."""

    def __init__(self, gemm1: StreamingGemm, gemm2: StreamingGemm, link: ChainLink):
        cfg1, cfg2 = gemm1.cfg, gemm2.cfg
        if not (cfg1.gemm1 and not cfg2.gemm1) or cfg1.routing_per_cta or cfg2.weights_before_wait:
            raise StreamingConfigError("the fused GEMMs are a GEMM1 that routes and meets, and a GEMM2")
        if (cfg1.block_tokens, cfg1.num_stages) != (cfg2.block_tokens, cfg2.num_stages):
            raise StreamingConfigError("the fused GEMMs share their row tiles and stages")
        self.link = link
        self.gemm1 = gemm1
        self.gemm2 = gemm2
        self.cfg = FusedGemmsConfig(cfg2.block_tokens, cfg2.num_stages)

    @cute.jit
    def launch(
        self, x: cute.Tensor, x_scale: cute.Tensor, w13: cute.Tensor, w13_scale: cute.Tensor, c: cute.Tensor,
        w2: cute.Tensor, w2_scale: cute.Tensor, expert_out: cute.Tensor, counts: cute.Tensor,
        expert_tokens: cute.Tensor, num_ctas: Int32, stream, routing, routed: cute.Tensor, counts_out: cute.Tensor,
        ready: cute.Tensor,
    ):  # fmt: skip
        SharedStorage = self.cfg.shared_storage()
        # The streaming GEMMs' layouts, in elements: fp8 x and bf16 C take the same count
        w_layout, x_layout, x_scale_layout, w_scale_layout, scratch_layout = stage_layouts(self.cfg)
        kernel = self.kernel(
            x, x_scale, w13, w13_scale, c, w2, w2_scale, expert_out, counts, expert_tokens, w_layout, x_layout,
            x_scale_layout, w_scale_layout, scratch_layout, SharedStorage, routing, routed, counts_out, ready,
        )  # fmt: skip
        launch_persistent(kernel, self.link, num_ctas, SharedStorage, stream, cooperative=True)

    @cute.kernel
    def kernel(
        self, x: cute.Tensor, x_scale: cute.Tensor, w13: cute.Tensor, w13_scale: cute.Tensor, c: cute.Tensor,
        w2: cute.Tensor, w2_scale: cute.Tensor, expert_out: cute.Tensor, counts: cute.Tensor,
        expert_tokens: cute.Tensor, w_layout: cute.Layout, x_layout: cute.Layout, x_scale_layout: cute.Layout,
        w_scale_layout: cute.Layout, scratch_layout: cute.Layout, SharedStorage: cutlass.Constexpr, routing,
        routed: cute.Tensor, counts_out: cute.Tensor, ready: cute.Tensor,
    ):  # fmt: skip
        enter(self.link)
        k1, k2, ns = self.gemm1.cfg.k_stages, self.gemm2.cfg.k_stages, self.cfg.num_stages
        bt = self.cfg.block_tokens
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_id = tidx // 32
        lane = tidx % 32
        group = lane // 4
        quad = lane % 4

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        w_stages = storage.w_stages.get_tensor(w_layout)
        x1_stages = storage.x_stages.get_tensor(x_layout, dtype=cutlass.Float8E4M3FN)
        x2_stages = storage.x_stages.get_tensor(x_layout)
        x_scales = storage.x_scales.get_tensor(x_scale_layout)
        w_scales = storage.w_scales.get_tensor(w_scale_layout)
        scratch = storage.scratch.get_tensor(scratch_layout)

        # Zeroed before CTA 0's add of the meeting, which every CTA acquires before its first signal or poll.
        if cta == 0:
            if tidx < READY_WORDS:
                ready[tidx] = Int32(0)
        route_then_meet(routing, counts, expert_tokens, cta, grid, tidx)
        tile_end, expert_count, expert_offset, total_stages = schedule_tables(
            storage, counts, bt, GEMM1_ITEMS_PER_ROW_TILE, k1, cta, grid, warp_id, lane, counts_out
        )

        atoms = copy_atoms()
        acc = cute.make_rmem_tensor((M_TILES * self.gemm1.cfg.n_tiles * 4,), cutlass.Float32)
        block_acc = cute.make_rmem_tensor((M_TILES * self.gemm1.cfg.n_tiles * 4,), cutlass.Float32)

        # ---- GEMM1 + SwiGLU: items cta, cta + grid, ... (expert order), each signalled once its C is stored ----
        located = self.gemm1.load_location(
            cta, grid, Int32(0), tile_end, expert_count, expert_offset, expert_tokens, tidx, (w13_scale.layout,)
        )
        valid_rows = Int32(0)
        for p in cutlass.range_constexpr(ns - 1):
            if p < total_stages:
                self.gemm1.load_stage(
                    p, p, located, x, x_scale, w13, w13_scale, w_stages, x1_stages, x_scales, w_scales, *atoms, tidx
                )
            cute.arch.cp_async_commit_group()
        acc.fill(0.0)
        for s in cutlass.range(total_stages, unroll=1):
            cute.arch.cp_async_wait_group(ns - 2)
            cute.arch.sync_threads()
            if s + ns - 1 < total_stages:
                if (s + ns - 1) % k1 == 0:
                    located = self.gemm1.load_location(
                        cta, grid, s + ns - 1, tile_end, expert_count, expert_offset, expert_tokens, tidx,
                        (w13_scale.layout,),
                    )  # fmt: skip
                self.gemm1.load_stage(
                    s + ns - 1, (s + ns - 1) % ns, located, x, x_scale, w13, w13_scale, w_stages, x1_stages,
                    x_scales, w_scales, *atoms, tidx,
                )  # fmt: skip
            cute.arch.cp_async_commit_group()
            if tidx == 0:
                if s > 0 and s % k1 == 0:  # the barrier above followed the previous item's epilogue
                    self.signal(ready, cta + (s // k1 - 1) * grid, tile_end, expert_count, expert_offset)
            valid_rows = self.gemm1.compute_stage(
                s, cta + (s // k1) * grid, located, valid_rows, acc, block_acc, w_stages, x1_stages, x_scales,
                w_scales, scratch, c, tile_end, expert_count, expert_offset, warp_id, group, quad, tidx,
            )  # fmt: skip
        # Every copy landed and every warp done with the rings and the last epilogue before GEMM2 reuses them.
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        if tidx == 0:
            if total_stages > 0:
                self.signal(ready, cta + (total_stages // k1 - 1) * grid, tile_end, expert_count, expert_offset)

        # ---- GEMM2: CTA c's first item is c, later ones claimed; an item's C is loaded once its expert is done ----
        total_gemm1_items = tile_end[NUM_LOCAL_EXPERTS - 1] * GEMM1_ITEMS_PER_ROW_TILE
        total_items = tile_end[NUM_LOCAL_EXPERTS - 1] * GEMM2_ITEMS_PER_ROW_TILE
        total_stages = cutlass.min(cutlass.max(total_items - cta, 0), 1) * k2
        base = cta
        claimed_word = storage.claimed_item.get_tensor(cute.make_layout(4))
        pending = Int32(0)
        verified = Int32(-1)  # thread 0's highest expert known complete
        if tidx == 0:
            pending = claim_item(routed)
            if total_stages > 0:
                verified = wait_for_expert(
                    ready, base, total_gemm1_items, verified, tile_end, expert_count, expert_offset, bt
                )
        cute.arch.sync_threads()
        located = self.gemm2.load_location(
            base, Int32(0), Int32(0), tile_end, expert_count, expert_offset, expert_tokens, tidx, (w2_scale.layout,)
        )
        for p in cutlass.range_constexpr(ns - 1):
            if p < total_stages:
                self.gemm2.load_stage(
                    p, p, located, c, x_scale, w2, w2_scale, w_stages, x2_stages, x_scales, w_scales, *atoms, tidx
                )
            cute.arch.cp_async_commit_group()
        acc.fill(0.0)
        s = Int32(0)
        computed_item = base
        while s < total_stages:
            cute.arch.cp_async_wait_group(ns - 2)
            if tidx == 0:
                if (s + ns - 1) % k2 == 0:  # the load side takes the claim thread 0 published last stage
                    upcoming = grid + claimed_word[0]
                    if upcoming < total_items:
                        verified = wait_for_expert(
                            ready, upcoming, total_gemm1_items, verified, tile_end, expert_count, expert_offset, bt
                        )
            cute.arch.sync_threads()
            if (s + ns - 1) % k2 == 0:
                claimed = grid + claimed_word[0]
                if claimed < total_items:
                    base = claimed
                    total_stages = total_stages + k2
                    located = self.gemm2.load_location(
                        base, Int32(0), Int32(0), tile_end, expert_count, expert_offset, expert_tokens, tidx,
                        (w2_scale.layout,),
                    )  # fmt: skip
            if s + ns - 1 < total_stages:
                self.gemm2.load_stage(
                    s + ns - 1, (s + ns - 1) % ns, located, c, x_scale, w2, w2_scale, w_stages, x2_stages, x_scales,
                    w_scales, *atoms, tidx,
                )  # fmt: skip
            cute.arch.cp_async_commit_group()
            if tidx == 0 and (s + ns) % k2 == 0:
                pending = publish_claim(claimed_word, pending, routed, total_items, grid)
            if s % k2 == 0:
                computed_item = base
            valid_rows = self.gemm2.compute_stage(
                s, computed_item, located, valid_rows, acc, block_acc, w_stages, x2_stages, x_scales, w_scales,
                scratch, expert_out, tile_end, expert_count, expert_offset, warp_id, group, quad, tidx,
            )  # fmt: skip
            s = s + 1
        if tidx == 0:
            release_claims(routed, pending, total_items, grid)
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def signal(self, ready: cute.Tensor, item: Int32, tile_end, expert_count, expert_offset):
        expert, _, _, _ = locate_row_tile(
            item // GEMM1_ITEMS_PER_ROW_TILE, self.cfg.block_tokens, tile_end, expert_count, expert_offset
        )
        signal_item_done(ready, expert)


class FusedMoeHost:
    """The call's two launches: the fused expert GEMMs (routing first, cooperative) and the combine, a programmatic
    dependent that also zeroes the kept counters. Arguments as `host.MoeHostSm90`'s with a routing GEMM1 (GEMM2 runs
    on GEMM1's grid: `gemm2_grid` is not read), then the call's readiness words."""

    def __init__(self, gemm1: StreamingGemm, gemm2: StreamingGemm):
        gemms_link, combine_link = chain_links(2)
        self.gemms = FusedExpertGemms(gemm1, gemm2, gemms_link)
        self.combine = CombineKernel(combine_link, loads_first=True)

    def kept_words(self) -> tuple[int, ...]:
        """The lengths of the int32 buffers after the stream argument (`host.compile_host`): the kept routed count,
        then the call's readiness words."""
        return NUM_LOCAL_EXPERTS, READY_WORDS

    @cute.jit
    def __call__(
        self, routing_logits: cute.Tensor, routing_bias: cute.Tensor, hidden_states: cute.Tensor,
        hidden_states_scale: cute.Tensor, gemm1_weights: cute.Tensor, gemm1_weights_scale: cute.Tensor,
        gemm2_weights: cute.Tensor, gemm2_weights_scale: cute.Tensor, local_expert_offset: Int32,
        routed_scaling_factor: cutlass.Float32, output: cute.Tensor, counts: cute.Tensor, counts_out: cute.Tensor,
        expert_tokens: cute.Tensor, slot_expert: cute.Tensor, slot_rank: cute.Tensor, slot_weight: cute.Tensor,
        intermediate: cute.Tensor, expert_out: cute.Tensor, c_scale: cute.Tensor, gemm1_grid: Int32, gemm2_grid: Int32, stream,
        routed: cute.Tensor, ready: cute.Tensor,
    ):  # fmt: skip
        routing = (
            routing_logits, routing_bias, local_expert_offset, routed_scaling_factor, slot_expert, slot_rank,
            slot_weight, routed,
        )  # fmt: skip
        self.gemms.launch(
            hidden_states, hidden_states_scale, gemm1_weights, gemm1_weights_scale, intermediate, gemm2_weights,
            gemm2_weights_scale, expert_out, counts, expert_tokens, gemm1_grid, stream, routing, routed, counts_out, ready,
        )  # fmt: skip
        self.combine.launch(
            counts_out, slot_expert, slot_rank, slot_weight, expert_out, output, stream, (counts, routed)
        )
