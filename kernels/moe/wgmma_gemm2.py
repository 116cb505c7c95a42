"""GEMM2 of the MoE weight stream on Hopper's warpgroup MMA, with the e4m3 weights converted to bf16 in
registers (`wgmma.m64nNk16.f32.bf16.bf16`, A from registers, B from shared memory). NOTES.md has the
design.

Why (NOTES.md): at T = 901 `streaming_gemm.py`'s GEMM2 takes ~300 us for ~470 MB of W2
(~1.5 TB/s). Each warp's stage is a dependent chain of e4m3 -> bf16 conversions (80 % of its
instructions) and `mma.sync`, and each W2 is converted once per 16-token row tile. Here one warpgroup
converts a 64-row x 128-K block into registers and hands it to the asynchronous tensor core in eight
k16 steps; with 32-token row tiles each W2 is converted about once at ~28 tokens per expert, and the
two CTAs per SM overlap one's conversions with the other's MMAs.

Design (the schedule, the promotion and the numerics are `streaming_gemm.py`'s GEMM2):
- Work item = (row tile of `block_tokens` tokens of one expert, 64 output columns of 7168): 112 items
  per row tile; persistent CTAs walk them as the other streaming GEMMs do.
- One warpgroup per CTA; a flat `cp.async` pipeline of 256-wide K stages (two quantisation blocks):
  - the weights, 64 rows x 256 B, row-major with the 16-B chunk index XOR the row (mod 8), so that
    the 8-B loads of the eight row groups of a warp hit distinct banks;
  - C, `block_tokens` rows x 256 bf16, in the 128-B-swizzled K-major layout the warpgroup MMA reads
    (`wgmma_gemm1.swizzled_offset` with 512-B rows), then `fence.proxy.async`.
- A operand: thread (warp w, group g, quad t) holds rows 16 w + g and + 8 at K slots 2 t, 2 t + 1,
  2 t + 8, 2 t + 9 of a k16 step. It reads natural K 32 j + 8 t .. + 7 of both rows (one 8-B load
  each) for the two k16 steps of group j, and C is stored in the matching column order
  (`intermediate_order.py`, written so by GEMM1's epilogue), so no byte moves between threads.
- Per 128-K block: eight k16 MMAs into a fresh accumulator, then acc += block x the weight block
  scale (C is unscaled). Both blocks of a stage are in flight at once: the second block is converted
  while the first one's MMAs run, and the first promoted while the second one's run (two register
  sets; 1.01x over converting, multiplying and promoting each block in turn).
- Epilogue: the fp32 accumulator straight to `expert_out` for the item's valid tokens (columns of
  absent tokens hold whatever the stage held and are never stored).
- `f16_c` (`kernel.py` above 192 tokens): C holds f16 times a power of two per packed row (`c_to_f16.py`),
  the MMA multiplies f16 (`wgmma.m64nNk16.f32.f16.f16`), a pair of weights takes one conversion instead of four,
  and the epilogue multiplies each token's column by its row's inverse power: every product and partial sum is the
  bf16 path's times that power (except for elements of C below 2^-31 of their row's amax, which the f16 rewrite
  rounds by at most 2^-39 of it), so the output is the same bit for bit in every case tested (193-3000 tokens).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .chain import enter
from .intermediate_order import GROUP
from .shapes import BLOCK, HIDDEN, INTERMEDIATE
from .streaming_gemm import (
    LinkedGemm,
    PersistentGemmConfig,
    StreamingConfigError,
    e4m3x2_to_bf16x2,
    e4m3x2_to_f16x2,
    launch_persistent,
    lds_shared,
    locate_row_tile,
    schedule_tables,
    smem_region,
)
# The weight item and stage are GEMM1's: one warpgroup, 64 rows (here output columns) x 256 e4m3 per
# stage in two quantisation blocks, copied in 16-B chunks (`copy_weight_tile`).
from .wgmma_gemm1 import (
    BLOCKS_PER_STAGE,
    CHUNK,
    CHUNKS_PER_ROW,
    ITEM_ROWS,
    NUM_THREADS,
    STAGE_K,
    copy_weight_tile,
    swizzled_offset,
    weight_source,
)

__all__ = ["WgmmaGemm2", "WgmmaGemm2Config", "weight_offset"]

ITEMS_PER_ROW_TILE = HIDDEN // ITEM_ROWS  # 112
K_STAGES = INTERMEDIATE // STAGE_K  # 8
GROUPS_PER_BLOCK = BLOCK // GROUP  # 4 k32 groups, 8 k16 steps
C_ROW_BYTES = 2 * STAGE_K  # 512: a C row of a stage is 256 bf16
C_CHUNKS_PER_ROW = C_ROW_BYTES // CHUNK  # 32
THREAD_BYTES = 8  # one thread's bytes of a weight row per k32 group
ROW_GROUPS = 8  # rows g and g + 8 of a warp's 16: the 8 rows of one load phase

assert INTERMEDIATE % STAGE_K == 0 and HIDDEN % ITEM_ROWS == 0 and BLOCK % ITEM_ROWS == 0
assert GROUP == 4 * THREAD_BYTES  # four quads of 8 bytes cover a group


def weight_offset(row, k, stage):
    """Byte offset of weight byte `k` (0..255, natural K) of item row `row` of `stage`: row-major 256-B
    rows with the 16-B chunk index XOR the row mod 8 (the eight rows of one 8-B load phase then use
    distinct banks). Plain arithmetic, for the kernel and the CPU tests."""
    chunk = (k // CHUNK) ^ (row % ROW_GROUPS)
    return stage * ITEM_ROWS * STAGE_K + row * STAGE_K + chunk * CHUNK + k % CHUNK


class WgmmaGemm2Config(PersistentGemmConfig):
    """Compile-time shape of the WGMMA GEMM2: tokens per row tile (WGMMA's N) and pipeline depth; `f16_c`: C is
    f16 times a power of two per packed row (`c_to_f16.py`), the MMA multiplies f16, and three CTAs per SM run where
    their shared memory fits (32-token tiles with 2 stages, ~66 KB; 160 registers a thread, so three CTAs' 384 threads
    fit the register file); bf16 C keeps two. Two stages are enough for correctness: the load into a slot is issued
    after the barrier that follows every warp's wait for the MMAs that read it."""

    def __init__(self, block_tokens: int, num_stages: int, f16_c: bool = False):
        if block_tokens not in (8, 16, 32, 64):
            raise StreamingConfigError(f"block_tokens must be 8, 16, 32 or 64, got {block_tokens}")
        if num_stages < 2:
            raise StreamingConfigError(f"num_stages must be >= 2, got {num_stages}")
        self.set_max_ctas_per_sm(3 if f16_c else 2)
        self.block_tokens = block_tokens
        self.num_stages = num_stages
        self.f16_c = f16_c
        self.check_fits()

    @property
    def c_dtype(self):
        """The 16-bit type of C's elements and of both MMA operands."""
        return cutlass.Float16 if self.f16_c else cutlass.BFloat16

    # What `LinkedGemm.locate_load` reads besides block_tokens (no token: the item's first packed row).
    gemm1 = False
    k_stages = K_STAGES
    items_per_row_tile = ITEMS_PER_ROW_TILE

    def fields(self) -> dict:
        ns, bt = self.num_stages, self.block_tokens
        return {
            "w_stages": smem_region(cutlass.Float8E4M3FN, ns * ITEM_ROWS * STAGE_K, 128),
            # 1024-B aligned: the swizzle pattern repeats every 1024 B from the start of an atom
            "c_stages": smem_region(self.c_dtype, ns * bt * STAGE_K, 1024),
            "w_scales": smem_region(Float32, ns * BLOCKS_PER_STAGE, 16),
        }


@cute.jit
def wgmma_operands(block_tokens: cutlass.Constexpr, num_stages: cutlass.Constexpr, dtype: cutlass.Constexpr):
    """The 16-bit (`dtype`: bf16 or f16) tiled MMA (M = 64 weight rows from registers, N = the tokens, k16) and the
    staged K_SW128 layout of its C (B) tile."""
    k_major = LayoutEnum.ROW_MAJOR  # K-major for A and for B alike
    tiled_mma = sm90_utils.make_trivial_tiled_mma(
        dtype,
        dtype,
        k_major.sm90_mma_major_mode(),
        k_major.sm90_mma_major_mode(),
        Float32,
        (1, 1, 1),
        tiler_mn=(ITEM_ROWS, block_tokens),
        a_source=warpgroup.OperandSource.RMEM,
    )
    b_layout = sm90_utils.make_smem_layout_b(
        k_major, (ITEM_ROWS, block_tokens, STAGE_K), dtype, num_stages
    )
    return tiled_mma, b_layout


class WgmmaGemm2(LinkedGemm):
    """GEMM2 with `launch(c, c_scale, w, w_scale, out, counts, expert_tokens, num_ctas, stream)`,
    as `streaming_gemm.StreamingGemm` (c = C [rows, 2048] bf16 in `intermediate_order.py`'s column
    order, w = W2 [32, 7168, 2048], w_scale [32, 56, 16], out = O [rows, 7168] fp32; with `f16_c` c holds f16
    times a power of two per row and c_scale [rows] its inverse, otherwise c_scale is not read)."""

    @cute.jit
    def launch(
        self,
        c: cute.Tensor,
        c_scale: cute.Tensor,
        w: cute.Tensor,
        w_scale: cute.Tensor,
        out: cute.Tensor,
        counts: cute.Tensor,
        expert_tokens: cute.Tensor,
        num_ctas: Int32,
        stream,
    ):
        cfg = self.cfg
        tiled_mma, b_layout = wgmma_operands(cfg.block_tokens, cfg.num_stages, cfg.c_dtype)
        SharedStorage = cfg.shared_storage()
        if cutlass.const_expr(cfg.f16_c):
            c = cute.recast_tensor(c, cutlass.Float16)  # the same bits, rewritten by `c_to_f16.py`
        else:
            c_scale = None  # not a parameter of the bf16 kernel
        kernel = self.kernel(c, c_scale, w, w_scale, out, counts, tiled_mma, b_layout, SharedStorage)
        launch_persistent(kernel, self.link, num_ctas, SharedStorage, stream, cooperative=False)

    @cute.kernel
    def kernel(
        self,
        c: cute.Tensor,
        c_scale,  # None unless f16_c
        w: cute.Tensor,
        w_scale: cute.Tensor,
        out: cute.Tensor,
        counts: cute.Tensor,
        tiled_mma: cute.TiledMma,
        b_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
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
        group = lane // 4
        quad = lane % 4

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        s_c = storage.c_stages.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        w_bytes = storage.w_stages.get_tensor(cute.make_layout(ns * ITEM_ROWS * STAGE_K))
        c_bytes = storage.c_stages.get_tensor(cute.make_layout(ns * bt * STAGE_K))  # 16-bit elements
        w_scales = storage.w_scales.get_tensor(cute.make_layout((BLOCKS_PER_STAGE, ns)))
        tile_end, expert_count, expert_offset, total_stages = schedule_tables(
            storage, counts, bt, ITEMS_PER_ROW_TILE, K_STAGES, cta, grid, warp_id, lane
        )

        g2s_16_w = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Float8E4M3FN, num_bits_per_copy=128
        )
        g2s_16_c = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cfg.c_dtype, num_bits_per_copy=128
        )
        g2s_4_f32 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), Float32, num_bits_per_copy=32
        )

        thr_mma = tiled_mma.get_slice(tidx)
        t_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_c))  # (MMA, N, k16 steps, stage)
        # A fragments of a 128-K block: (values, M, k16 steps) of C's type, and one accumulator per block,
        # for each block of a stage (both are in flight at once).
        a_blocks = [
            cute.make_rmem_tensor(thr_mma.partition_shape_A((ITEM_ROWS, BLOCK)), cfg.c_dtype)
            for _ in range(BLOCKS_PER_STAGE)
        ]
        acc_shape = thr_mma.partition_shape_C((ITEM_ROWS, bt))
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        block_accs = [cute.make_rmem_tensor(acc_shape, Float32) for _ in range(BLOCKS_PER_STAGE)]
        coords = thr_mma.partition_C(cute.make_identity_tensor((ITEM_ROWS, bt)))  # (item row, token slot)
        acc.fill(0.0)
        row_g = warp_id * 16 + group
        # Where the next load's item lies, located at its first K stage only (as wgmma_gemm1.py):
        # (expert, valid rows, first packed row). The prologue's stages all belong to the CTA's first item.
        located = self.load_location(cta, grid, Int32(0), tile_end, expert_count, expert_offset, None, tidx)

        for p in cutlass.range_constexpr(ns - 1):
            if p < total_stages:
                self.load_stage(
                    p, p, cta, grid, located, c, w, w_scale, w_bytes, c_bytes, w_scales, g2s_16_w, g2s_16_c,
                    g2s_4_f32, tidx,
                )
            cute.arch.cp_async_commit_group()

        for s in cutlass.range(total_stages, unroll=1):
            # As wgmma_gemm1.py: stage s has landed, every thread's copies are visible to the async
            # proxy after the barrier, and the slot the next load overwrites is free.
            cute.arch.cp_async_wait_group(ns - 2)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()
            if s + ns - 1 < total_stages:
                if (s + ns - 1) % K_STAGES == 0:
                    located = self.load_location(cta, grid, s + ns - 1, tile_end, expert_count, expert_offset, None, tidx)
                self.load_stage(
                    s + ns - 1, (s + ns - 1) % ns, cta, grid, located, c, w, w_scale, w_bytes, c_bytes, w_scales,
                    g2s_16_w, g2s_16_c, g2s_4_f32, tidx,
                )
            cute.arch.cp_async_commit_group()

            item = cta + (s // K_STAGES) * grid
            k_stage = s % K_STAGES
            if k_stage == 0:
                acc.fill(0.0)
            slot = s % ns
            for b in cutlass.range_constexpr(BLOCKS_PER_STAGE):
                self.convert_block(a_blocks[b], w_bytes, b, row_g, quad, slot)
                self.issue_block(tiled_mma, block_accs[b], a_blocks[b], t_b, b, slot)
            for b in cutlass.range_constexpr(BLOCKS_PER_STAGE):
                warpgroup.wait_group(BLOCKS_PER_STAGE - 1 - b)
                self.promote(acc, block_accs[b], w_scales[b, slot])
            if k_stage == K_STAGES - 1:
                # the computed item, located once at its end (its K stages need no location)
                _, _, item_valid_rows, item_packed_row0 = locate_row_tile(
                    item // ITEMS_PER_ROW_TILE, bt, tile_end, expert_count, expert_offset
                )
                n_tile = item % ITEMS_PER_ROW_TILE
                for i in cutlass.range_constexpr(cute.size(acc)):
                    row, token_slot = coords[i]
                    if token_slot < item_valid_rows:
                        value = acc[i]
                        if cutlass.const_expr(cfg.f16_c):
                            value = value * c_scale[item_packed_row0 + token_slot]
                        out[item_packed_row0 + token_slot, n_tile * ITEM_ROWS + row] = value
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def item_bases(self, located, item: Int32, tidx: Int32):
        """(weights, C): this thread's element offsets of the item's first K stage, at its first weight row and
        16-B chunk and at its first packed row's chunk; computed when the item is located and carried with it."""
        w_row = located[0] * HIDDEN + (item % ITEMS_PER_ROW_TILE) * ITEM_ROWS + tidx // CHUNKS_PER_ROW
        w_base = w_row * INTERMEDIATE + (tidx % CHUNKS_PER_ROW) * CHUNK
        c_row = located[2] + tidx // C_CHUNKS_PER_ROW
        c_base = c_row * INTERMEDIATE + (tidx % C_CHUNKS_PER_ROW) * (CHUNK // 2)
        return w_base, c_base

    @cute.jit
    def convert_block(
        self, a_block: cute.Tensor, w_bytes: cute.Tensor, b: cutlass.Constexpr, row_g: Int32, quad: Int32, slot: Int32
    ):
        """This thread's weights of K block `b` of the stage in `slot`, converted (to C's type) into the A fragments of
        its eight k16 steps: 8 bytes of rows g and g + 8 per k32 group j, natural K 32 j + 8 t .. + 7
        (`intermediate_order.py`: word `step` of a row's load feeds k16 step 2 j + step, its halves K
        slots 2 t and 2 t + 8). Through the fragment's word view ((1, v1, v2), M, step): word v1 + 2 v2
        holds row g + 8 v1, K slots 2 t + 8 v2 and + 1."""
        a_words = cute.recast_tensor(a_block, Int32)
        for j in cutlass.range_constexpr(GROUPS_PER_BLOCK):
            k = b * BLOCK + j * GROUP + quad * THREAD_BYTES
            for v1 in cutlass.range_constexpr(2):
                words = lds_shared(w_bytes.iterator + weight_offset(row_g + 8 * v1, k, slot), 2)
                for step in cutlass.range_constexpr(2):
                    for v2 in cutlass.range_constexpr(2):
                        if cutlass.const_expr(self.cfg.f16_c):
                            a_words[(0, v1, v2), 0, 2 * j + step] = e4m3x2_to_f16x2(words[step], v2 == 1)
                        else:
                            a_words[(0, v1, v2), 0, 2 * j + step] = e4m3x2_to_bf16x2(words[step], v2 == 1)

    @cute.jit
    def issue_block(
        self,
        tiled_mma: cute.TiledMma,
        block_acc: cute.Tensor,
        a_block: cute.Tensor,
        t_b: cute.Tensor,
        b: cutlass.Constexpr,
        slot: Int32,
    ):
        """K block `b`'s eight k16 MMAs into a fresh `block_acc`, committed as one group (not waited for)."""
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        warpgroup.fence()
        for k16 in cutlass.range_constexpr(2 * GROUPS_PER_BLOCK):
            cute.gemm(tiled_mma, block_acc, a_block[None, None, k16], t_b[None, None, b * 2 * GROUPS_PER_BLOCK + k16, slot], block_acc)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def promote(self, acc: cute.Tensor, block_acc: cute.Tensor, scale: Float32):
        """The streaming GEMMs' promotion: the block's fp32 sum times the weight block scale (C is unscaled)."""
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = acc[i] + block_acc[i] * scale

    @cute.jit
    def load_stage(
        self,
        s: Int32,
        slot: Int32,
        cta: Int32,
        grid: Int32,
        located,
        c: cute.Tensor,
        w: cute.Tensor,
        w_scale: cute.Tensor,
        w_bytes: cute.Tensor,
        c_bytes: cute.Tensor,
        w_scales: cute.Tensor,
        g2s_16_w: cute.CopyAtom,
        g2s_16_c: cute.CopyAtom,
        g2s_4_f32: cute.CopyAtom,
        tidx: Int32,
    ):
        """Issue the cp.async copies of flat stage `s` of this CTA (weights, C rows, weight scales);
        `located` is `locate_load`'s (expert, valid rows, first packed row) and `item_bases`' two offsets for
        the stage's item."""
        bt = self.cfg.block_tokens
        item = cta + (s // K_STAGES) * grid
        k_stage = s % K_STAGES
        n_tile = item % ITEMS_PER_ROW_TILE
        expert, valid_rows = located[0], located[1]

        source = weight_source(w, located[3], k_stage, lambda row: row, INTERMEDIATE)
        copy_weight_tile(g2s_16_w, source, w_bytes, lambda row, byte: weight_offset(row, byte, slot), tidx)

        # ---- C: the row tile's packed rows (stored column order), 512 B each; rows past the tile's
        # tokens are not copied ----
        c_chunk_elems = CHUNK // 2
        c_rows_per_pass = NUM_THREADS // C_CHUNKS_PER_ROW
        c_stage = c.iterator + cute.assume(located[4] + k_stage * (C_ROW_BYTES // 2), divby=c_chunk_elems)
        for i in cutlass.range_constexpr(bt * C_CHUNKS_PER_ROW // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            token_slot = linear // C_CHUNKS_PER_ROW
            chunk = linear % C_CHUNKS_PER_ROW
            if token_slot < valid_rows:
                c_source = cute.make_tensor(c_stage + i * c_rows_per_pass * INTERMEDIATE, cute.make_layout(c_chunk_elems))
                cute.copy(
                    g2s_16_c,
                    c_source,
                    cute.local_tile(
                        c_bytes,
                        (c_chunk_elems,),
                        (swizzled_offset(token_slot, chunk * CHUNK, slot, bt, C_ROW_BYTES) // CHUNK,),
                    ),
                )

        # ---- weight block scales: the item's 128-row block, the stage's two K blocks ----
        if tidx < BLOCKS_PER_STAGE:
            cute.copy(
                g2s_4_f32,
                cute.local_tile(
                    w_scale[expert, (n_tile * ITEM_ROWS) // BLOCK, None], (1,), (k_stage * BLOCKS_PER_STAGE + tidx,)
                ),
                cute.local_tile(w_scales[None, slot], (1,), (tidx,)),
            )
