"""GEMM1 + SwiGLU of the MoE weight stream on Hopper's FP8 warpgroup MMA (`wgmma.m64nNk32.e4m3`).

Why (NOTES.md): `streaming_gemm.py`'s GEMM1 feeds `mma.sync` with e4m3 -> f16 conversions
in registers. At T = 901 it issues 153 M warp instructions from one warp per scheduler and is bound by
instruction issue (553 us, DRAM at 17 %). FP8 `mma.sync` compiles to the same conversions on sm_90a;
only the warpgroup MMA reads e4m3 operands from shared memory as they are.

Design (the schedule and the numerics are `streaming_gemm.py`'s):
- Work item = (row tile of `block_tokens` tokens of one expert, 32 up rows and their 32 gate rows).
  The 64 weight rows are WGMMA's M and the tokens its N (8, 16 or 32), so SwiGLU stays in the CTA.
  There are 64 items per row tile, and persistent CTAs walk them as the streaming GEMM does
  (`build_expert_tables`, `locate_row_tile`).
- One warpgroup per CTA. A flat `cp.async` pipeline over (item, K stage) never drains between
  items. A K stage is 256 wide: two 128-wide quantisation blocks.
  - The copies write the 128-B-swizzled K-major tiles WGMMA reads (the sm90 K_SW128 atom: 8 rows
    x 128 B, `Swizzle<3,4,3>`); `swizzled_offset` is that layout's formula.
  - A `fence.proxy.async` makes them visible to the tensor core before the barrier.
- Per 128-K block: four k32 WGMMAs into a fresh accumulator, wait, then
  acc += block x (the row half's weight block scale x the token's scale). This is the
  streaming GEMMs' promotion, as DeepGEMM does it.
- Epilogue: the accumulator through shared memory; C = silu(gate) * up, in bf16, for the item's
  valid tokens, each 32-column group in the order `wgmma_gemm2.py` reads (`intermediate_order.py`). Columns of
  absent tokens hold whatever the stage held and are never written out.
"""

from __future__ import annotations

from enum import Enum

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from . import streaming_gemm
from .chain import enter
from .intermediate_order import GROUP, stored_position
from .routing import route_then_meet
from .shapes import BLOCK, GEMM1_OUT, HIDDEN, INTERMEDIATE
from .streaming_gemm import (
    PAIRED_SLOTS,
    RANKS_WRITTEN,
    WALK_SLOT_WORDS,
    LinkedGemm,
    PersistentGemmConfig,
    StreamingConfigError,
    cta_stage_count,
    launch_persistent,
    locate_row_tile,
    schedule_tables,
    slot_token,
    smem_region,
    take_walk_slot,
)
from .swiglu import swiglu_bf16

__all__ = ["Gemm1Feed", "WgmmaGemm1", "WgmmaGemm1Config", "swizzled_offset"]

NUM_THREADS = streaming_gemm.NUM_THREADS  # 128: one warpgroup (`streaming_gemm.launch_persistent`'s block)
ITEM_ROWS = 64  # WGMMA's M: 32 up rows and their 32 gate rows
HALF_ROWS = ITEM_ROWS // 2
ITEMS_PER_ROW_TILE = INTERMEDIATE // HALF_ROWS  # 64
BLOCKS_PER_STAGE = 2
STAGE_K = BLOCKS_PER_STAGE * BLOCK  # 256
K_STAGES = HIDDEN // STAGE_K  # 28
K_STEPS_PER_BLOCK = BLOCK // 32  # k32 WGMMAs per quantisation block
CHUNK = 16  # bytes per cp.async
CHUNKS_PER_ROW = STAGE_K // CHUNK  # 16
ROWS_PER_PRODUCER_COPY = 32 // CHUNKS_PER_ROW  # token rows per warp-wide cp.async of the producer warp
SWIZZLE_ATOM_ROWS = 8
SWIZZLE_ROW_BYTES = 128

assert HIDDEN % STAGE_K == 0 and BLOCK % HALF_ROWS == 0 and BLOCK % 32 == 0
assert HALF_ROWS == GROUP  # an item's C columns are one group of the permuted order
assert ITEM_ROWS * 4 == STAGE_K  # a token's fp32 epilogue row is as long as its stage row (scratch_in_stage)


def swizzled_offset(row, k, stage, rows: int, row_bytes: int = STAGE_K):
    """Byte offset of byte `k` of row `row` of `stage` in a K-major tile of `rows` rows of `row_bytes`
    bytes (256 e4m3 here, 256 bf16 in `wgmma_gemm2.py`) staged as the sm90 K_SW128 layout that
    `sm90_utils.make_smem_layout_a/b` builds for it: 8-row x 128-B atoms, stacked along the rows, then
    along K, then by stage, with the 16-B chunk index XOR the row in the atom. Plain arithmetic: the
    kernel calls it with DSL integers, the CPU tests with Python ints."""
    linear = (
        (row % SWIZZLE_ATOM_ROWS) * SWIZZLE_ROW_BYTES
        + (row // SWIZZLE_ATOM_ROWS) * SWIZZLE_ATOM_ROWS * SWIZZLE_ROW_BYTES
        + k % SWIZZLE_ROW_BYTES
        + (k // SWIZZLE_ROW_BYTES) * rows * SWIZZLE_ROW_BYTES
        + stage * rows * row_bytes
    )
    return linear ^ (((linear >> 7) & 7) << 4)


PRODUCER_WARP = NUM_THREADS // 32  # producer_warp: the fifth warp, after the warpgroup
ROWS_PER_PASS = NUM_THREADS // CHUNKS_PER_ROW  # 8: copy i of a thread reads item row tidx / 16 + 8 i


def copy_weight_tile(atom, source, w_bytes, destination, tidx) -> None:
    """Issue the cp.async copies of one stage of a 64-row weight item (256 e4m3 per row), for both
    WGMMA GEMMs: 16 consecutive threads read one row's 256 contiguous bytes. `source(i, row, chunk)` is
    the 16-B global tile that copy i reads (item row `row`, chunk `chunk` of the stage) and
    `destination(row, byte)` its byte offset in `w_bytes`; plain Python, called while the kernel is traced."""
    for i in range(ITEM_ROWS * CHUNKS_PER_ROW // NUM_THREADS):
        linear = i * NUM_THREADS + tidx
        row = linear // CHUNKS_PER_ROW
        chunk = linear % CHUNKS_PER_ROW
        cute.copy(
            atom,
            source(i, row, chunk),
            cute.local_tile(w_bytes, (CHUNK,), (destination(row, chunk * CHUNK) // CHUNK,)),
        )


def weight_source(w, thread_base, k_stage, row_delta, row_elems):
    """`copy_weight_tile`'s source from the thread's per-item base (the element offset of its first copy at K
    stage 0): copy i adds the stage's K offset and `row_delta(i * ROWS_PER_PASS)` rows of `row_elems`, so that no
    copy rebuilds its 64-bit address from expert, row and K at every stage."""
    stage = w.iterator + cute.assume(thread_base + k_stage * STAGE_K, divby=CHUNK)
    return lambda i, row, chunk: cute.make_tensor(
        stage + row_delta(i * ROWS_PER_PASS) * row_elems, cute.make_layout(CHUNK)
    )


def item_weight_row(n_tile, row):
    """Weight row of item row `row` (0..63) of column tile `n_tile`: rows [0, 32) are the up rows
    32 n_tile + r, rows [32, 64) the gate rows 2048 + 32 n_tile + r - 32 (branch-free)."""
    half = row // HALF_ROWS
    return n_tile * HALF_ROWS + row + half * (INTERMEDIATE - HALF_ROWS)


def item_weight_scale_row(n_tile, half):
    """Row of the 128 x 128 weight block scales that holds the item's `half` (0: up, 1: gate)."""
    return (half * INTERMEDIATE + n_tile * HALF_ROWS) // BLOCK


def copy_token_scale(atom, x_scale, x_scales, token, token_slot, k_stage, slot, block) -> None:
    """Issue the copy of `token`'s scale of K block `block` of stage `k_stage` (x_scale is [56, T], transposed) into
    its token slot of the stage in `slot`; plain Python, called while the kernel is traced."""
    cute.copy(
        atom,
        cute.local_tile(x_scale[k_stage * BLOCKS_PER_STAGE + block, None], (1,), (token,)),
        cute.local_tile(x_scales[None, block, slot], (1,), (token_slot,)),
    )


def copy_weight_block_scale(atom, w_scale, w_scales, expert, n_tile, k_stage, slot, index) -> None:
    """Issue copy `index` (< 2 x BLOCKS_PER_STAGE) of a stage's weight block scales, one per (row half, K block), into
    the stage in `slot`; plain Python, called while the kernel is traced."""
    half = index // BLOCKS_PER_STAGE
    block = index % BLOCKS_PER_STAGE
    cute.copy(
        atom,
        cute.local_tile(
            w_scale[expert, item_weight_scale_row(n_tile, half), None],
            (1,),
            (k_stage * BLOCKS_PER_STAGE + block,),
        ),
        cute.local_tile(w_scales[half, None, slot], (1,), (block,)),
    )


class Gemm1Feed(Enum):
    """How the WGMMA GEMM1's stages are issued and its items walked (one choice: the parts travel together). All but
    GATHERED_ROWS are this file's GEMM1's."""

    # The warpgroup issues its own stages by `cp.async` and a CTA-wide barrier ends each K stage; two CTAs per SM walk
    # the items over the CTA index.
    WARPGROUP = "warpgroup"
    # A fifth warp issues every stage (the weights by TMA, `weight_tma`; the token rows by coalesced `cp.async`) on the
    # slot's full mbarrier, and the warpgroup waits on that alone and releases the slot on its empty mbarrier, so that
    # no CTA-wide barrier ends a K stage. Three CTAs per SM walk the items over slot x SMs + the SM's rank in
    # `l2_partitions.partition_ranks` (one L2 partition's SMs first), the slot drawn from kept per-SM counters
    # (`streaming_gemm.take_walk_slot`) and the ranks kept after them (`counters.kept_walk_slots`; before
    # `kernel.warm_up` measures them, and in a buffer made inside a CUDA-graph capture, none: the walk goes by `%smid`),
    # and an expert's items weight tile by weight tile (its row tiles adjacent, `item_row_tile`, `item_n_tile`): the
    # CTAs reading one weight tile at once sit on one partition's SMs, and the tile crosses the fabric between the
    # partitions at most once. Needs a cooperative launch (every CTA resident for the draw: a GEMM1 that routes),
    # 32-token tiles (a lane per token slot) and the epilogue tile in a stage (released after the epilogue).
    PRODUCER_WARP = "producer warp"
    # The token rows are first gathered by expert into grouped buffers by a kernel of their own (`gather_rows.py`),
    # from which `grouped_wgmma.GroupedGemm1` loads its stages by TMA: a producer warpgroup, two MMA warpgroups on
    # 128 x 128 tiles, one CTA per SM walking over its index. Needs the routing grid (the gather runs between it and
    # GEMM1).
    GATHERED_ROWS = "gathered rows"


class WgmmaGemm1Config(PersistentGemmConfig):
    """Compile-time shape of the WGMMA GEMM1: tokens per row tile (WGMMA's N), pipeline depth and `feed`; C's columns
    are stored in the order `wgmma_gemm2.py` reads (`intermediate_order.py`). `scratch_in_stage`: the epilogue's fp32
    tile (`block_tokens` x 64, as many bytes as a token stage) lives in the token stage the item's last K stage has
    just consumed instead of a region of its own, which no copy in flight targets (32-token tiles with 3 stages then
    take ~74 KB: three CTAs per SM at 87 registers a thread)."""

    def __init__(
        self, block_tokens: int, num_stages: int, scratch_in_stage: bool = False, feed: Gemm1Feed = Gemm1Feed.WARPGROUP
    ):
        if block_tokens not in (8, 16, 32):
            raise StreamingConfigError(f"block_tokens must be 8, 16 or 32, got {block_tokens}")
        if num_stages < 3:
            raise StreamingConfigError(f"num_stages must be >= 3, got {num_stages}")
        self.block_tokens = block_tokens
        self.num_stages = num_stages
        self.scratch_in_stage = scratch_in_stage
        if feed is Gemm1Feed.GATHERED_ROWS:
            raise StreamingConfigError("the gathered rows feed grouped_wgmma.GroupedGemm1, not this GEMM1")
        self.feed = feed
        # The producer warp's parts: the warp itself, and the walk by partition rank at three CTAs per SM.
        self.producer_warp = self.partition_walk = feed is Gemm1Feed.PRODUCER_WARP
        if self.producer_warp and (block_tokens != 32 or not scratch_in_stage):
            # A lane per token slot; the epilogue's tile in the slot it releases afterwards.
            raise StreamingConfigError("the producer warp needs block_tokens=32 and scratch_in_stage")
        self.set_max_ctas_per_sm(PAIRED_SLOTS if self.partition_walk else 2)
        self.num_threads = NUM_THREADS + 32 if self.producer_warp else NUM_THREADS
        self.threads_per_token = NUM_THREADS // block_tokens
        self.check_fits()
        if self.partition_walk and self.ctas_per_sm() != PAIRED_SLOTS:
            # The draw gives an SM's CTAs the slots 0, 1 and 2: it needs exactly three of them on every SM.
            raise StreamingConfigError("the partition walk needs three CTAs per SM (their shared memory)")

    # What `LinkedGemm.locate_load` reads besides block_tokens and threads_per_token.
    gemm1 = True
    k_stages = K_STAGES
    items_per_row_tile = ITEMS_PER_ROW_TILE

    def fields(self) -> dict:
        ns, bt = self.num_stages, self.block_tokens
        fields = {
            # 1024-B aligned: the swizzle pattern repeats every 1024 B from the start of an atom
            "w_stages": smem_region(cutlass.Float8E4M3FN, ns * ITEM_ROWS * STAGE_K, 1024),
            "x_stages": smem_region(cutlass.Float8E4M3FN, ns * bt * STAGE_K, 1024),
            "x_scales": smem_region(Float32, ns * BLOCKS_PER_STAGE * bt, 128),
            "w_scales": smem_region(Float32, ns * BLOCKS_PER_STAGE * 2, 128),
        }
        if not self.scratch_in_stage:
            fields["scratch"] = smem_region(Float32, ITEM_ROWS * bt, 128)
        if self.partition_walk:
            fields["walk_slot"] = smem_region(Int32, 4, 16)
        if self.producer_warp:
            fields["stage_full"] = smem_region(cutlass.Int64, ns, 8)  # mbarriers: a slot's copies have landed
            fields["stage_empty"] = smem_region(cutlass.Int64, ns, 8)  # the MMA warps are done with a slot
        return fields


@cute.jit
def wgmma_operands(block_tokens: cutlass.Constexpr, num_stages: cutlass.Constexpr):
    """The FP8 tiled MMA (M = 64 weight rows, N = the tokens, k32) and the staged K_SW128 layouts
    of its weight (A) and token (B) tiles."""
    k_major = LayoutEnum.ROW_MAJOR  # K-major for A and for B alike
    tiled_mma = sm90_utils.make_trivial_tiled_mma(
        cutlass.Float8E4M3FN,
        cutlass.Float8E4M3FN,
        k_major.sm90_mma_major_mode(),
        k_major.sm90_mma_major_mode(),
        Float32,
        (1, 1, 1),
        tiler_mn=(ITEM_ROWS, block_tokens),
    )
    tile = (ITEM_ROWS, block_tokens, STAGE_K)
    a_layout = sm90_utils.make_smem_layout_a(k_major, tile, cutlass.Float8E4M3FN, num_stages)
    b_layout = sm90_utils.make_smem_layout_b(k_major, tile, cutlass.Float8E4M3FN, num_stages)
    return tiled_mma, a_layout, b_layout


@cute.jit
def weight_tma(w: cute.Tensor, stage_layout: cute.ComposedLayout):
    """The TMA atom and coordinate tensor of GEMM1's weight stages (producer_warp): W13 seen as ((32 rows, 2 halves, 64
    items), K, expert), so that one (64, 256) tile is an item's 32 up rows and their 32 gate rows over a 256-wide K
    stage, landing in `stage_layout` (one stage of the MMA's 128-B swizzled K-major A layout): two 8-KB boxes, one per
    128-B K half, on a 5-dimensional tensor map (bit for bit the `cp.async` stages' bytes)."""
    rows, halves = HALF_ROWS, GEMM1_OUT // INTERMEDIATE
    view = cute.make_tensor(
        w.iterator,
        cute.make_layout(
            ((rows, halves, ITEMS_PER_ROW_TILE), HIDDEN, w.shape[0]),
            stride=((HIDDEN, INTERMEDIATE * HIDDEN, rows * HIDDEN), 1, GEMM1_OUT * HIDDEN),
        ),
    )
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), view, stage_layout, (ITEM_ROWS, STAGE_K))


class WgmmaGemm1(LinkedGemm):
    """GEMM1 + SwiGLU with `launch(x, x_scale, w, w_scale, out, counts, expert_tokens, num_ctas,
    stream)`, as `streaming_gemm.StreamingGemm` (x = hidden_states [T, 7168] e4m3 gathered by token,
    x_scale [56, T], w = W13 [32, 4096, 7168], w_scale [32, 32, 56], out = C [rows, 2048] bf16)."""

    @cute.jit
    def launch(
        self,
        x: cute.Tensor,
        x_scale: cute.Tensor,
        w: cute.Tensor,
        w_scale: cute.Tensor,
        out: cute.Tensor,
        counts: cute.Tensor,
        expert_tokens: cute.Tensor,
        num_ctas: Int32,
        stream,
        routing=None,
        counts_out=None,
        walk_slots=None,
    ):
        """`routing`, `counts_out` and `walk_slots` (with the partition walk): as `streaming_gemm.StreamingGemm.launch`'s."""
        cfg = self.cfg
        tiled_mma, a_layout, b_layout = wgmma_operands(cfg.block_tokens, cfg.num_stages)
        SharedStorage = cfg.shared_storage()
        tma = None
        if cutlass.const_expr(cfg.producer_warp):
            tma = weight_tma(w, cute.slice_(a_layout, (None, None, 0)))
        kernel = self.kernel(
            x, x_scale, w, w_scale, out, counts, expert_tokens, tiled_mma, a_layout, b_layout, SharedStorage, routing,
            counts_out, walk_slots, tma,
        )
        launch_persistent(
            kernel, self.link, num_ctas, SharedStorage, stream, cooperative=routing is not None, threads=cfg.num_threads
        )

    @cute.kernel
    def kernel(
        self,
        x: cute.Tensor,
        x_scale: cute.Tensor,
        w: cute.Tensor,
        w_scale: cute.Tensor,
        out: cute.Tensor,
        counts: cute.Tensor,
        expert_tokens: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_layout: cute.ComposedLayout,
        b_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
        routing,
        counts_out,
        walk_slots,
        tma,  # with producer_warp: `weight_tma`'s (atom, coordinate tensor)
    ):
        enter(self.link)
        cfg = self.cfg
        bt = cfg.block_tokens
        ns = cfg.num_stages
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_id = tidx // 32
        lane = tidx % 32

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        if cutlass.const_expr(cfg.partition_walk):
            # Drawn first, so that the atomic's round trip overlaps the routing (read after the schedule's barrier).
            walk_slot_word = storage.walk_slot.get_tensor(cute.make_layout(4))
            if tidx == 0:
                take_walk_slot(walk_slots, grid // PAIRED_SLOTS, walk_slot_word)
        if cutlass.const_expr(cfg.producer_warp):
            # Initialised before the schedule's CTA barrier, which publishes them.
            if tidx == 0:
                for i in cutlass.range_constexpr(ns):
                    cute.arch.mbarrier_init(storage.stage_full.data_ptr() + i, 1 + 32)  # the TMA's, each lane's
                    cute.arch.mbarrier_init(storage.stage_empty.data_ptr() + i, NUM_THREADS // 32)  # each MMA warp's
                cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(routing is not None):
            route_then_meet(routing, counts, expert_tokens, cta, grid, tidx, extra_warps=cfg.producer_warp)
        # The MMA's swizzled views, and flat byte views of the same buffers for the copies.
        s_w = storage.w_stages.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        s_x = storage.x_stages.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        w_bytes = storage.w_stages.get_tensor(cute.make_layout(ns * ITEM_ROWS * STAGE_K))
        x_bytes = storage.x_stages.get_tensor(cute.make_layout(ns * bt * STAGE_K))
        x_scales = storage.x_scales.get_tensor(
            cute.make_layout((bt, BLOCKS_PER_STAGE, ns), stride=(1, bt, BLOCKS_PER_STAGE * bt))
        )
        w_scales = storage.w_scales.get_tensor(
            cute.make_layout((2, BLOCKS_PER_STAGE, ns), stride=(1, 2, 2 * BLOCKS_PER_STAGE))
        )
        scratch = None  # the epilogue's tile, when it does not live in a stage
        if cutlass.const_expr(not cfg.scratch_in_stage):
            scratch = storage.scratch.get_tensor(cute.make_layout((bt, ITEM_ROWS), stride=(ITEM_ROWS, 1)))
        tile_end, expert_count, expert_offset, total_stages = schedule_tables(
            storage, counts, bt, ITEMS_PER_ROW_TILE, K_STAGES, cta, grid, warp_id, lane, counts_out
        )
        # The walk's index: items walk, walk + grid, ... (the CTA index, or slot x SMs + the SM's partition rank with
        # the partition walk). The routing above and the schedule's counts_out copy stay the CTA's.
        walk = cta
        if cutlass.const_expr(cfg.partition_walk):
            drawn = walk_slot_word[0]
            if drawn >= 0:
                round_base = drawn * (grid // PAIRED_SLOTS)
                sm_position = cute.arch.smid()
                if walk_slots[2 * WALK_SLOT_WORDS - 1] == RANKS_WRITTEN:
                    sm_position = walk_slots[WALK_SLOT_WORDS + sm_position]  # the SM's partition rank
                walk = round_base + sm_position
                total_stages = cta_stage_count(tile_end, ITEMS_PER_ROW_TILE, K_STAGES, walk, grid)

        g2s_16 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Float8E4M3FN, num_bits_per_copy=128
        )
        g2s_4_f32 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), Float32, num_bits_per_copy=32
        )

        tables = (tile_end, expert_count, expert_offset)
        if cutlass.const_expr(cfg.producer_warp):
            full, empty = storage.stage_full.data_ptr(), storage.stage_empty.data_ptr()
            if warp_id == PRODUCER_WARP:
                self.produce(
                    walk, grid, total_stages, tables, expert_tokens, x, x_scale, w_scale, x_bytes, x_scales, w_scales,
                    tma, s_w, full, empty, g2s_16, g2s_4_f32, tidx % 32,
                )  # fmt: skip
            else:
                fragments = self.mma_fragments(tiled_mma, s_w, s_x, tidx)
                for s in cutlass.range(total_stages, unroll=1):
                    slot = s % ns
                    cute.arch.mbarrier_wait(full + slot, (s // ns) % 2)  # the slot's (s // ns)-th fill
                    cute.arch.fence_view_async_shared()  # the producer's cp.async writes, for the MMAs' async proxy
                    self.compute_stage(
                        s, walk, grid, tiled_mma, fragments, w_scales, x_scales, x_bytes, None, out, tables, tidx
                    )
                    if tidx % 32 == 0:
                        cute.arch.mbarrier_arrive(empty + slot)  # after this warp's MMAs and epilogue on the slot
        else:
            fragments = self.mma_fragments(tiled_mma, s_w, s_x, tidx)
            # Where the next load's item lies, located at its first K stage only: (expert, valid rows,
            # this thread's token). The prologue's stages all belong to the CTA's first item.
            located = self.load_location(
                walk, grid, Int32(0), tile_end, expert_count, expert_offset, expert_tokens, tidx
            )

            for p in cutlass.range_constexpr(ns - 1):
                if p < total_stages:
                    self.load_stage(
                        p, p, walk, grid, located, x, x_scale, w, w_scale, w_bytes, x_bytes, x_scales, w_scales,
                        g2s_16, g2s_4_f32, tidx,
                    )  # fmt: skip
                cute.arch.cp_async_commit_group()

            for s in cutlass.range(total_stages, unroll=1):
                # Stage s has landed once at most ns - 2 younger groups are pending. Each thread makes
                # its own copies visible to the tensor core's (async) proxy; the barrier then covers
                # everyone's, and tells every thread that the slot the next load overwrites is free.
                cute.arch.cp_async_wait_group(ns - 2)
                cute.arch.fence_view_async_shared()
                cute.arch.sync_threads()
                if s + ns - 1 < total_stages:
                    if (s + ns - 1) % K_STAGES == 0:
                        located = self.load_location(
                            walk, grid, s + ns - 1, tile_end, expert_count, expert_offset, expert_tokens, tidx
                        )
                    self.load_stage(
                        s + ns - 1, (s + ns - 1) % ns, walk, grid, located, x, x_scale, w, w_scale, w_bytes, x_bytes,
                        x_scales, w_scales, g2s_16, g2s_4_f32, tidx,
                    )
                cute.arch.cp_async_commit_group()
                self.compute_stage(
                    s, walk, grid, tiled_mma, fragments, w_scales, x_scales, x_bytes, scratch, out, tables, tidx
                )
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def mma_fragments(self, tiled_mma: cute.TiledMma, s_w: cute.Tensor, s_x: cute.Tensor, tidx: Int32):
        """The warpgroup's MMA operands of every stage, its accumulators (the item's, zeroed, and a block's) and
        their (item row, token slot) coordinates."""
        bt = self.cfg.block_tokens
        thr_mma = tiled_mma.get_slice(tidx)
        t_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_w))  # (MMA, M, K steps, stage)
        t_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_x))
        acc_shape = thr_mma.partition_shape_C((ITEM_ROWS, bt))
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        block_acc = cute.make_rmem_tensor(acc_shape, Float32)
        coords = thr_mma.partition_C(cute.make_identity_tensor((ITEM_ROWS, bt)))  # (item row, token slot)
        acc.fill(0.0)
        return t_a, t_b, acc, block_acc, coords

    @cute.jit
    def compute_stage(
        self,
        s: Int32,
        walk: Int32,
        grid: Int32,
        tiled_mma: cute.TiledMma,
        fragments,
        w_scales: cute.Tensor,
        x_scales: cute.Tensor,
        x_bytes: cute.Tensor,
        scratch,
        out: cute.Tensor,
        tables,
        tidx: Int32,
    ):
        """The warpgroup's side of flat stage `s` of the walk walk, walk + grid, ...: its two blocks' MMAs and
        promotions, and at the item's last K stage the epilogue."""
        cfg = self.cfg
        bt, ns = cfg.block_tokens, cfg.num_stages
        t_a, t_b, acc, block_acc, coords = fragments
        tile_end, expert_count, expert_offset = tables
        item = walk + (s // K_STAGES) * grid
        k_stage = s % K_STAGES
        if k_stage == 0:
            acc.fill(0.0)
        slot = s % ns
        for b in cutlass.range_constexpr(BLOCKS_PER_STAGE):
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            cute.nvgpu.warpgroup.fence()
            for k in cutlass.range_constexpr(K_STEPS_PER_BLOCK):
                step = b * K_STEPS_PER_BLOCK + k
                cute.gemm(tiled_mma, block_acc, t_a[None, None, step, slot], t_b[None, None, step, slot], block_acc)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)
            # The promotion: the block's exact fp32 sum times (weight block scale x token scale)
            for i in cutlass.range_constexpr(cute.size(acc)):
                row, token_slot = coords[i]
                scale = w_scales[row // HALF_ROWS, b, slot] * x_scales[token_slot, b, slot]
                acc[i] = acc[i] + block_acc[i] * scale
        if k_stage == K_STAGES - 1:
            # the computed item, located once at its end (its K stages need no location)
            _, _, item_valid_rows, item_packed_row0 = locate_row_tile(
                self.item_row_tile(item, tables), bt, tile_end, expert_count, expert_offset
            )
            n_tile = self.item_n_tile(item, tables)
            if cutlass.const_expr(cfg.scratch_in_stage):
                # The token stage in `slot`. A warp's wait_group covers its own share of the
                # warpgroup's MMAs, which read all of the stage: the fence and barrier let no thread
                # write the tile before every warp's MMAs on it are done. The copies in flight target
                # the other slots, and the next load into this one comes after the barrier at the
                # top of the next stage (with producer_warp: after every MMA warp released the slot),
                # i.e. after every thread's epilogue.
                cute.arch.fence_view_async_shared()
                self.warpgroup_barrier()
                stage_scratch = cute.recast_ptr(x_bytes.iterator + slot * (bt * STAGE_K), dtype=Float32)
                scratch_layout = cute.make_layout((bt, ITEM_ROWS), stride=(ITEM_ROWS, 1))
                self.epilogue(
                    acc, coords, cute.make_tensor(stage_scratch, scratch_layout), out, n_tile, item_packed_row0,
                    item_valid_rows, tidx,
                )  # fmt: skip
            else:
                self.epilogue(acc, coords, scratch, out, n_tile, item_packed_row0, item_valid_rows, tidx)

    @cute.jit
    def expert_items(self, item: Int32, tables):
        """partition_walk: (the expert's first row tile, its row tiles R, the item's index among its 64 R items)."""
        tile_end, expert_count, expert_offset = tables
        bt = self.cfg.block_tokens
        tile = item // ITEMS_PER_ROW_TILE  # a tile of the item's expert (its items span its tiles' 64 x R)
        expert, first_row, _, _ = locate_row_tile(tile, bt, tile_end, expert_count, expert_offset)
        first_tile = tile - first_row // bt
        return first_tile, (expert_count[expert] + bt - 1) // bt, item - first_tile * ITEMS_PER_ROW_TILE

    @cute.jit
    def item_row_tile(self, item: Int32, tables):
        """The row tile of a walk item: item // 64 (a row tile's 64 items adjacent), or with partition_walk row tile
        local % R of its expert (the expert's R row tiles of one N tile adjacent, `expert_items`)."""
        row_tile = item // ITEMS_PER_ROW_TILE
        if cutlass.const_expr(self.cfg.partition_walk):
            first_tile, tiles, local = self.expert_items(item, tables)
            row_tile = first_tile + local % tiles
        return row_tile

    @cute.jit
    def item_n_tile(self, item: Int32, tables):
        """The N tile (32 up rows and their gate rows) of a walk item: item % 64, or with partition_walk local // R."""
        n_tile = item % ITEMS_PER_ROW_TILE
        if cutlass.const_expr(self.cfg.partition_walk):
            _, tiles, local = self.expert_items(item, tables)
            n_tile = local // tiles
        return n_tile

    @cute.jit
    def warpgroup_barrier(self):
        """A barrier of the MMA warpgroup: the CTA's, or with producer_warp named barrier 1 of its 128 threads (the
        producer warp does not take part)."""
        if cutlass.const_expr(self.cfg.producer_warp):
            cute.arch.barrier(barrier_id=1, number_of_threads=NUM_THREADS)
        else:
            cute.arch.sync_threads()

    @cute.jit
    def produce(
        self,
        walk: Int32,
        grid: Int32,
        total_stages: Int32,
        tables,
        expert_tokens: cute.Tensor,
        x: cute.Tensor,
        x_scale: cute.Tensor,
        w_scale: cute.Tensor,
        x_bytes: cute.Tensor,
        x_scales: cute.Tensor,
        w_scales: cute.Tensor,
        tma,
        s_w: cute.Tensor,
        full,
        empty,
        g2s_16: cute.CopyAtom,
        g2s_4_f32: cute.CopyAtom,
        lane: Int32,
    ):
        """The producer warp (producer_warp): every stage of the walk into its slot once the MMA warps released the
        slot's previous fill: the weight tile by TMA (`weight_tma`, on the slot's full mbarrier with its bytes), the
        token rows by coalesced `cp.async` (two rows per copy), lane t the scales of token slot t, lanes 0-3 the weight
        block scales; each lane then arrives on the full mbarrier when its copies land."""
        cfg = self.cfg
        bt, ns = cfg.block_tokens, cfg.num_stages
        tile_end, expert_count, expert_offset = tables
        tma_atom, tma_coords = tma
        cpasync.prefetch_descriptor(tma_atom)
        tiles = cute.local_tile(tma_coords, (ITEM_ROWS, STAGE_K), (None, None, None))
        slots_w, tiles_w = cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1), cute.group_modes(s_w, 0, 2), cute.group_modes(tiles, 0, 2)
        )
        expert, valid_rows, token = Int32(0), Int32(0), Int32(0)  # the item's, located at its first K stage
        # With partition_walk the N tile is located at the item's first K stage too; without it item % 64 stays where
        # it is computed (each stage), which keeps that walk's instructions as measured.
        item_n_tile = Int32(0)
        for s in cutlass.range(total_stages, unroll=1):
            slot = s % ns
            if s >= ns:
                cute.arch.mbarrier_wait(empty + slot, (s // ns - 1) % 2)  # the slot's previous fill released
            item = walk + (s // K_STAGES) * grid
            k_stage = s % K_STAGES
            n_tile = item % ITEMS_PER_ROW_TILE
            if k_stage == 0:
                expert, first_row, valid_rows, _ = locate_row_tile(
                    self.item_row_tile(item, tables), bt, tile_end, expert_count, expert_offset
                )
                token = slot_token(expert_tokens, expert, first_row, valid_rows, lane)
                if cutlass.const_expr(cfg.partition_walk):
                    item_n_tile = self.item_n_tile(item, tables)
            if cutlass.const_expr(cfg.partition_walk):
                n_tile = item_n_tile
            # the whole warp: the TMA copy elects its own lane
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(full + slot, ITEM_ROWS * STAGE_K)
            cute.copy(
                tma_atom, tiles_w[(None, n_tile, k_stage, expert)], slots_w[(None, slot)], tma_bar_ptr=full + slot
            )
            # Coalesced token rows: each copy covers ROWS_PER_PRODUCER_COPY rows, a row's lanes along its
            # bytes; a row's token comes from the lane that located it (token slot = lane).
            chunk = lane % CHUNKS_PER_ROW
            for i in cutlass.range_constexpr(bt // ROWS_PER_PRODUCER_COPY):
                row = i * ROWS_PER_PRODUCER_COPY + lane // CHUNKS_PER_ROW
                row_token = cute.arch.shuffle_sync(token, row)
                if row < valid_rows:
                    x_chunk = x.iterator + cute.assume(
                        row_token * HIDDEN + k_stage * STAGE_K + chunk * CHUNK, divby=CHUNK
                    )
                    cute.copy(
                        g2s_16,
                        cute.make_tensor(x_chunk, cute.make_layout(CHUNK)),
                        cute.local_tile(x_bytes, (CHUNK,), (swizzled_offset(row, chunk * CHUNK, slot, bt) // CHUNK,)),
                    )
            if lane < valid_rows:
                for block in cutlass.range_constexpr(BLOCKS_PER_STAGE):
                    copy_token_scale(g2s_4_f32, x_scale, x_scales, token, lane, k_stage, slot, block)
            if lane < 2 * BLOCKS_PER_STAGE:
                copy_weight_block_scale(g2s_4_f32, w_scale, w_scales, expert, n_tile, k_stage, slot, lane)
            cute.arch.cp_async_mbarrier_arrive_noinc(full + slot)

    @cute.jit
    def load_stage(
        self,
        s: Int32,
        slot: Int32,
        walk: Int32,
        grid: Int32,
        located,
        x: cute.Tensor,
        x_scale: cute.Tensor,
        w: cute.Tensor,
        w_scale: cute.Tensor,
        w_bytes: cute.Tensor,
        x_bytes: cute.Tensor,
        x_scales: cute.Tensor,
        w_scales: cute.Tensor,
        g2s_16: cute.CopyAtom,
        g2s_4_f32: cute.CopyAtom,
        tidx: Int32,
    ):
        """Issue the cp.async copies of flat stage `s` of the walk walk, walk + grid, ... (weights, tokens,
        scales); `located` is `locate_load`'s (expert, valid rows, this thread's token) and `item_bases`' two
        offsets for the stage's item."""
        cfg = self.cfg
        bt = cfg.block_tokens
        item = walk + (s // K_STAGES) * grid
        k_stage = s % K_STAGES
        n_tile = item % ITEMS_PER_ROW_TILE
        expert, valid_rows, token = located[0], located[1], located[2]

        source = weight_source(w, located[3], k_stage, lambda row: item_weight_row(0, row), HIDDEN)
        copy_weight_tile(g2s_16, source, w_bytes, lambda row, byte: swizzled_offset(row, byte, slot, ITEM_ROWS), tidx)

        # ---- tokens: thread group per token, the row's 16 chunks strided over the group ----
        tpt = cfg.threads_per_token
        token_slot = tidx // tpt
        sub = tidx % tpt
        if token_slot < valid_rows:
            x_stage = x.iterator + cute.assume(located[4] + k_stage * STAGE_K, divby=CHUNK)
            for i in cutlass.range_constexpr(CHUNKS_PER_ROW // tpt):
                chunk = sub + i * tpt
                x_source = cute.make_tensor(x_stage + i * tpt * CHUNK, cute.make_layout(CHUNK))
                cute.copy(
                    g2s_16,
                    x_source,
                    cute.local_tile(
                        x_bytes, (CHUNK,), (swizzled_offset(token_slot, chunk * CHUNK, slot, bt) // CHUNK,)
                    ),
                )
            if sub < BLOCKS_PER_STAGE:
                copy_token_scale(g2s_4_f32, x_scale, x_scales, token, token_slot, k_stage, slot, sub)

        # ---- weight block scales: one per (row half, K block) ----
        if tidx < 2 * BLOCKS_PER_STAGE:
            copy_weight_block_scale(g2s_4_f32, w_scale, w_scales, expert, n_tile, k_stage, slot, tidx)

    @cute.jit
    def item_bases(self, located, item: Int32, tidx: Int32):
        """(weights, tokens): this thread's element offsets of the item's first K stage, at its first weight row
        and 16-B chunk and at its token's row; computed when the item is located and carried with it."""
        w_row = item_weight_row(item % ITEMS_PER_ROW_TILE, tidx // CHUNKS_PER_ROW)
        w_base = (located[0] * GEMM1_OUT + w_row) * HIDDEN + (tidx % CHUNKS_PER_ROW) * CHUNK
        x_base = located[2] * HIDDEN + (tidx % self.cfg.threads_per_token) * CHUNK
        return w_base, x_base

    @cute.jit
    def epilogue(
        self,
        acc: cute.Tensor,
        coords: cute.Tensor,
        scratch: cute.Tensor,
        out: cute.Tensor,
        n_tile: Int32,
        packed_row0: Int32,
        valid_rows: Int32,
        tidx: Int32,
    ):
        """C = silu(gate) * up for the item's valid tokens, through shared memory (an up row and its
        gate row sit in different warps of the accumulator)."""
        bt = self.cfg.block_tokens
        for i in cutlass.range_constexpr(cute.size(acc)):
            row, token_slot = coords[i]
            scratch[token_slot, row] = acc[i]
        self.warpgroup_barrier()
        for i in cutlass.range_constexpr(HALF_ROWS * bt // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            token_slot = linear // HALF_ROWS
            column = linear % HALF_ROWS
            if token_slot < valid_rows:
                up = scratch[token_slot, column]
                gate = scratch[token_slot, HALF_ROWS + column]
                column = stored_position(column)
                out[packed_row0 + token_slot, n_tile * HALF_ROWS + column] = swiglu_bf16(gate, up)
