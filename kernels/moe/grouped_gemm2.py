"""Compute-bound GEMM2 for large T: a persistent, warp-specialised f16 WGMMA grouped GEMM on the grouped GEMM1's
skeleton (`grouped_wgmma.py`), W2 converted e4m3 -> f16 in registers.

The problem is `wgmma_gemm2.py`'s with `f16_c`: C [R, 2048] (the call's bf16 workspace holding f16 times a power of
two per packed row, `c_to_f16.py`, its inverse in `c_scale` [R]; columns in `intermediate_order.py`'s order), expert e
owning the packed rows [offset[e], offset[e] + counts[e]) with offset the exclusive prefix of `counts`; W2
[32, 7168, 2048] e4m3 with its 128 x 128 block scales [32, 56, 16]. Out: expert_out [R, 7168] fp32 = (C W2^T) x
c_scale per packed row; rows past the experts' are not written. The W2 block scale is folded into the conversion
("Folded scale" below): against `wgmma_gemm2.py`'s per-block fp32 promotion, one more f16 rounding per W2 element
(~2-3e-4 relative L2, `tests/kernels/test_moe_grouped_gemm2.py`'s model).

Why: `wgmma_gemm2.py` converts each W2 element once per 32-token tile (~14 times per expert at ~440 tokens) on one
warpgroup per CTA. Here a W2 element is converted once per 128-token tile and two MMA warpgroups share a CTA, so the
conversions (one `cvt.rn.f16x2.e4m3x2` per pair) run while the other warpgroup's MMAs keep the tensor core busy.

Structure:
- Work item = (expert, token tile of TILE_T = 128 packed rows, W2 tile of TILE_W = 128 rows = 64 per consumer
  warpgroup). Per expert ceil(count / 128) x 56 items, expert-major, token tile then W2 tile: an expert's 56 W2 tiles
  of one token tile are adjacent, so a wave of 132 CTAs reads ~2.4 C tiles (512 KB each over K) ~56 times from L2,
  and all of the expert's W2 (14.7 MB, once from DRAM) which its next token tiles read again from L2.
- Device tile scheduler as the grouped GEMM1's: warp 0 builds the streaming GEMMs' tables from `counts`
  (`streaming_gemm.build_expert_tables`), item = token tile x 56 + W2 tile (`locate_row_tile`); CTA c walks c,
  c + grid, ...; no host sync, one compile for every R.
- Warp specialisation, 384 threads, one CTA per SM: warp 0 of the producer warpgroup (40 registers) issues per 128-K
  block by TMA on a `PipelineTmaAsync` of NUM_STAGES (4 x 48 KB): the W2 tile (128 rows x 128 K e4m3 in the K-major
  128-B swizzle, `w2_offset`, its rows permuted within each 8 by the tensor map, `w2_smem_row`) and the C tile (128
  packed rows x 128 K f16, 128-B swizzled K-major: WGMMA's B operand; from any first row). Warpgroups 1 and 2 (232
  registers) are the consumers.
- Consumer, per K block: its 64 W2 rows' A fragments from shared memory (two 8-B loads per k32 group: `wgmma_gemm2`'s
  map, natural K 32 j + 8 t .. + 7 of rows g and g + 8, which C's stored column order matches; swizzle and row order
  put the four rows of a half warp's load on distinct banks), converted in registers; eight k16 RS-WGMMAs m64n128k16
  accumulating into `acc`; while they run, the next block's fragments are loaded and converted into the other register
  set (two sets: a set is rewritten only after the MMAs that read it completed), then the stage is released.
- Epilogue per warpgroup: acc = [64 W2 rows x 128 tokens], i.e. expert_out's [token, column] transposed. In two passes
  of 64 tokens it goes through a swizzled 16 KB buffer (`epilogue_offset`: conflict-free both ways) and out as rows:
  16 threads per token write its 64 contiguous columns (256 B) as 16-B stores, times the row's `c_scale` and the
  item's s_item (below), valid rows only. The producer keeps filling the next item's stages meanwhile.

Folded scale. Promoting each block's fresh accumulator (acc += block x w_scale, as `wgmma_gemm2.py` does) is
latency-bound here (H200, ncu at 14107 tokens: 481 TFLOP/s, tensor pipe 58 %, a third of the stall cycles scoreboard
waits): every block ends in wait_group(0) and 64 promotion FMAs before the next block's MMAs may issue, and the
registers leave no room to pipeline deeper (the folded form is 1.06-1.11x faster, NOTES.md). A W2 block scale is uniform over an item's K block and A is converted in
registers anyway, so: s_item = the largest of the item's 16 block scales (w_scale[expert, W2 tile, :], loaded for the
next item while the last block's MMAs and the epilogue run), per block the factor f16(s_kb / s_item) in (0, 1] (one
`cvt.rn.f16x2.f32` per thread), A = f16(e4m3 x factor) (`mul.rn.f16x2` after each `cvt.rn.f16x2.e4m3x2`: |A| <= 448,
no overflow; values down to f16's subnormals lose only relative precision), every block's MMAs accumulating into
`acc` (the item's first fresh), and acc x s_item x c_scale in the epilogue. No block accumulator, no promotion. Per
block kb (set s = kb mod 2): fence, the eight MMAs from set s, commit; wait_group(1): block kb - 1's MMAs have
completed (kb's may run), so its stage is released and its set 1 - s is rewritten with block kb + 1 (consumer wait,
conversion) while kb's MMAs run; the next fence orders those register writes before the MMAs that read them. So a
warpgroup always has one block queued behind the running one. The item's blocks 0 and 1 are converted before the K
loop (block 0 issued between them: its set is free, the previous item ended in wait_group(0)), block 15 issued after
it, then wait_group(0) and the last two releases. ptxas reports no wgmma serialisation (C7513-style) or injected
`warpgroup.arrive` (C7519); in the SASS a K loop trip is ARRIVE, 8 HGMMA, DEPBAR.LE gsb0 1, release, conversion, twice.
A third A register set (conversions two blocks ahead) is not tried: 16 blocks do not cycle through three sets, and
one queued block already hides a conversion.

Shared memory: 4 stages x (16 KB W2 + 32 KB C) + 2 x 16 KB epilogue + barriers and tables = 225 KB of the 226 KB a CTA
may take. Registers per consumer thread: acc 64 + two A sets 2 x 32 + addresses (168 at launch; ptxas keeps ~10
loop-invariant epilogue addresses on the stack, 44 B: stored once per CTA, reloaded once per item).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .chain import enter
from .grouped_wgmma import WarpSpecializedConfig, fragment_col, fragment_row
from .intermediate_order import GROUP
from .shapes import BLOCK, HIDDEN, HIDDEN_BLOCKS, INTERMEDIATE, INTERMEDIATE_BLOCKS, NUM_LOCAL_EXPERTS
from .standalone import compile_standalone, rowmajor
from .streaming_gemm import CHUNK, LinkedGemm, fill_schedule_tables, lds_shared, locate_row_tile, smem_region

__all__ = [
    "GroupedGemm2",
    "GroupedGemm2Config",
    "compile_only",
    "epilogue_offset",
    "w2_offset",
    "w2_smem_row",
    "w2_view",
]

GPU_ARCH = "sm_90a"
WARPGROUP = 128
NUM_CONSUMERS = 2
NUM_THREADS = (1 + NUM_CONSUMERS) * WARPGROUP  # 384: the producer warpgroup first
CONSUMER_THREADS = NUM_CONSUMERS * WARPGROUP
PRODUCER_REGS = 40
CONSUMER_REGS = 232
WG_ROWS = 64  # WGMMA's M: W2 rows per consumer warpgroup
TILE_W = NUM_CONSUMERS * WG_ROWS  # 128 W2 rows (output columns) per item: one scale block
TILE_T = 128  # packed rows (tokens) per item: WGMMA's N
TILE_K = BLOCK  # one quantisation block per stage
MMA_K = 16
K_BLOCKS = INTERMEDIATE // TILE_K  # 16 stages per item
W_TILES = HIDDEN // TILE_W  # 56 W2 tiles per token tile
ACC_SIZE = WG_ROWS * TILE_T // WARPGROUP  # 64 fp32 accumulator entries per consumer thread
W_STAGE_BYTES = TILE_W * TILE_K  # 16 KB of e4m3
C_STAGE_BYTES = TILE_T * TILE_K * 2  # 32 KB of f16
STAGE_BYTES = W_STAGE_BYTES + C_STAGE_BYTES  # the TMA bytes of a stage
SWIZZLE_ROWS = 8  # rows of one 128-B swizzle atom (1 KB)
THREAD_BYTES = 8  # one thread's bytes of a W2 row per k32 group
GROUPS_PER_BLOCK = TILE_K // GROUP  # 4 k32 groups, 8 k16 steps
EPILOGUE_TOKENS = 64  # tokens per epilogue pass (two passes per item)
EPILOGUE_WORDS = EPILOGUE_TOKENS * WG_ROWS  # fp32 per warpgroup buffer (16 KB)
VEC = 4  # fp32 per 16-B store
EPILOGUE_BARRIER = 1  # named barriers 1 and 2: one per consumer warpgroup (0 is the CTA's)

assert TILE_W == BLOCK and HIDDEN % TILE_W == 0 and INTERMEDIATE % TILE_K == 0
assert K_BLOCKS % 2 == 0  # the consumers' loop alternates the two A register sets over pairs of blocks
assert TILE_T % EPILOGUE_TOKENS == 0 and EPILOGUE_TOKENS % 8 == 0
assert GROUP == 4 * THREAD_BYTES  # four quads of 8 bytes cover a group


def w2_smem_row(row):
    """The shared-memory row of W2 row `row` of the item: within each 8 rows, row 4 h + l (l < 4) at 2 l + h, so that
    the four rows g = 0..3 (or 4..7) of a half warp's 8-B loads sit at swizzle phases 0, 2, 4, 6 (or 1, 3, 5, 7) and
    their 32 bytes each, two chunks of one pair, at distinct banks (`w2_view` loads the tile so)."""
    return row - row % SWIZZLE_ROWS + 2 * (row % 4) + (row % SWIZZLE_ROWS) // 4


def w2_offset(smem_row, k, slot):
    """Byte offset of W2 byte `k` (0..127, natural K of the stage's block) of shared-memory row `smem_row` (0..127) in
    stage `slot`: TMA's 128-B swizzle of the K-major tile, rows of 128 B with the 16-B chunk index XOR the row mod 8
    (what `make_smem_layout_a` gives for e4m3 128 x 128). Plain arithmetic, for the kernel and the CPU tests."""
    chunk = (k // CHUNK) ^ (smem_row % SWIZZLE_ROWS)
    return slot * W_STAGE_BYTES + smem_row * TILE_K + chunk * CHUNK + k % CHUNK


def epilogue_offset(token, row):
    """fp32 index of (token 0..63 of a pass, W2 row 0..63 of the warpgroup) in its epilogue buffer: token-major rows of
    64, the row index XOR 8 x ((token / 2) mod 4). The accumulator's writes (a warp's lanes: 4 token pairs x 8 rows)
    and the 16-B reads of a token's row (8 lanes per 128 B) then hit distinct banks; the XOR keeps 4-word groups
    contiguous."""
    return token * WG_ROWS + (row ^ (8 * ((token // 2) % 4)))


def w2_view(num_experts):
    """W2 [E, 7168, 2048] as ((h, l, 8-row group), K, expert) with row 8 group + 4 h + l: a (128, 128) box is one W2
    tile's K block, its rows in `w2_smem_row`'s order (the row mode's index is the shared-memory row)."""
    rows = ((2, 4, HIDDEN // SWIZZLE_ROWS), (4 * INTERMEDIATE, INTERMEDIATE, SWIZZLE_ROWS * INTERMEDIATE))
    return cute.make_layout(
        (rows[0], INTERMEDIATE, num_experts), stride=(rows[1], 1, HIDDEN * INTERMEDIATE)
    )


class GroupedGemm2Config(WarpSpecializedConfig):
    """Compile-time shape: the pipeline depth (2-4 stages of 48 KB; 4 by default)."""

    max_stages = 4
    f16_c = True  # C rewritten as f16 times a power of two per row (`c_to_f16.py` runs before it): what the host reads

    def fields(self) -> dict:
        ns = self.num_stages
        return {
            "w_stages": smem_region(cutlass.Float8E4M3FN, ns * W_STAGE_BYTES, 1024),  # 128-B swizzle per 1 KB
            "c_stages": smem_region(cutlass.Float16, ns * TILE_T * TILE_K, 1024),
            "epilogue": smem_region(Float32, NUM_CONSUMERS * EPILOGUE_WORDS, 128),
            "barriers": smem_region(cutlass.Int64, 2 * ns, 8),  # the pipeline's full and empty mbarriers
        }


@cute.jit
def make_tiled_mma():
    """One consumer warpgroup's f16 tiled MMA: A = 64 W2 rows from registers, B = 128 tokens from shared memory
    (K-major), k16, fp32 accumulator."""
    k_major = LayoutEnum.ROW_MAJOR
    return sm90_utils.make_trivial_tiled_mma(
        cutlass.Float16,
        cutlass.Float16,
        k_major.sm90_mma_major_mode(),
        k_major.sm90_mma_major_mode(),
        Float32,
        (1, 1, 1),
        tiler_mn=(WG_ROWS, TILE_T),
        a_source=warpgroup.OperandSource.RMEM,
    )


@cute.jit
def mma_operands(num_stages: cutlass.Constexpr):
    """One consumer warpgroup's f16 tiled MMA (A = 64 W2 rows from registers, B = 128 tokens, k16), the staged K_SW128
    layout of C (B) and the TMA destination layout of W2 (e4m3 K_SW128, read back through `w2_offset`)."""
    k_major = LayoutEnum.ROW_MAJOR
    tiled_mma = make_tiled_mma()
    c_layout = sm90_utils.make_smem_layout_b(k_major, (WG_ROWS, TILE_T, TILE_K), cutlass.Float16, num_stages)
    w_layout = sm90_utils.make_smem_layout_a(k_major, (TILE_W, TILE_T, TILE_K), cutlass.Float8E4M3FN, num_stages)
    return tiled_mma, c_layout, w_layout


def block_factor(ratio: Float32) -> Int32:
    """A K block's factor s_kb / s_item (f32, in (0, 1]) as f16x2 in both halves (`cvt.rn`: relative error <= 2^-11)."""
    return cute.arch.inline_ptx(
        "cvt.rn.f16x2.f32 {$w0}, {$r0}, {$r0};",
        write_only_types=[Int32],
        read_only_args=[ratio],
    )


def e4m3x2_to_f16x2_scaled(word: Int32, high: bool, factor: Int32) -> Int32:
    """Two e4m3 bytes (the low or high half of `word`) as f16x2 (exact), times the f16x2 `factor` (`mul.rn.f16x2`:
    one f16 rounding per element; |e4m3| <= 448 and factor <= 1 cannot overflow)."""
    half = "hi" if high else "lo"
    return cute.arch.inline_ptx(
        "{ .reg .b16 lo, hi; .reg .b32 h2; mov.b32 {lo, hi}, {$r0}; cvt.rn.f16x2.e4m3x2 h2, " + half + "; "
        "mul.rn.f16x2 {$w0}, h2, {$r1}; }",
        write_only_types=[Int32],
        read_only_args=[word, factor],
    )


class GroupedGemm2(LinkedGemm):
    """The call's GEMM2 on grouped rows (`host.ExpertGemm`: `launch`, `with_link`), and `__call__(c, c_scale, w,
    w_scale, out, counts, num_ctas, stream)`, the host function of the standalone launcher (`compiled`)."""

    @cute.jit
    def __call__(
        self,
        c: cute.Tensor,
        c_scale: cute.Tensor,
        w: cute.Tensor,
        w_scale: cute.Tensor,
        out: cute.Tensor,
        counts: cute.Tensor,
        num_ctas: Int32,
        stream,
    ):
        self.launch(c, c_scale, w, w_scale, out, counts, None, num_ctas, stream)

    @cute.jit
    def launch(
        self,
        c: cute.Tensor,
        c_scale: cute.Tensor,
        w: cute.Tensor,
        w_scale: cute.Tensor,
        out: cute.Tensor,
        counts: cute.Tensor,
        expert_tokens,
        num_ctas: Int32,
        stream,
    ):
        """`c`: the call's bf16 workspace holding f16 bits (`c_to_f16.py`); the packed rows are the counts' exclusive
        prefix, so `expert_tokens` is not read."""
        ns = self.cfg.num_stages
        tiled_mma, c_layout, w_layout = mma_operands(ns)
        c = cute.recast_tensor(c, cutlass.Float16)  # the same bits, rewritten by `c_to_f16.py`
        tma_g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_c = cpasync.make_tiled_tma_atom(tma_g2s, c, cute.slice_(c_layout, (None, None, 0)), (TILE_T, TILE_K))
        w_view = cute.make_tensor(w.iterator, w2_view(w.shape[0]))
        tma_w = cpasync.make_tiled_tma_atom(tma_g2s, w_view, cute.slice_(w_layout, (None, None, 0)), (TILE_W, TILE_K))
        storage_type = self.cfg.shared_storage()
        self.kernel(tma_c, tma_w, c_scale, w_scale, out, counts, tiled_mma, c_layout, w_layout, storage_type).launch(
            grid=[num_ctas, 1, 1],
            block=[NUM_THREADS, 1, 1],
            smem=storage_type.size_in_bytes(),
            stream=stream,
            use_pdl=self.link.waits,
        )

    @cute.kernel
    def kernel(
        self,
        tma_c,
        tma_w,
        c_scale: cute.Tensor,
        w_scale: cute.Tensor,
        out: cute.Tensor,
        counts: cute.Tensor,
        tiled_mma: cute.TiledMma,
        c_layout: cute.ComposedLayout,
        w_layout: cute.ComposedLayout,
        storage_type: cutlass.Constexpr,
    ):
        enter(self.link)  # the counts and C are the previous kernels' (routing, GEMM1, C -> f16)
        ns = self.cfg.num_stages
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        atom_c, coords_c = tma_c
        atom_w, coords_w = tma_w
        if warp == 0:
            cpasync.prefetch_descriptor(atom_c)
            cpasync.prefetch_descriptor(atom_w)

        storage = cutlass.memory.SmemAllocator().allocate(storage_type)
        tile_end, expert_count, expert_offset = fill_schedule_tables(storage, counts, TILE_T, cta, warp, lane)

        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=ns,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS // 32),
            tx_count=STAGE_BYTES,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )  # its CTA barrier also publishes the tables
        total_items = tile_end[NUM_LOCAL_EXPERTS - 1] * W_TILES
        tables = (tile_end, expert_count, expert_offset)

        s_c = storage.c_stages.get_tensor(c_layout.outer, swizzle=c_layout.inner)
        s_w = storage.w_stages.get_tensor(w_layout.outer, swizzle=w_layout.inner)

        if warp < WARPGROUP // 32:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                self.produce(cta, grid, total_items, tables, pipe, atom_c, coords_c, atom_w, coords_w, s_c, s_w)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            w_bytes = storage.w_stages.get_tensor(cute.make_layout(ns * W_STAGE_BYTES))
            epilogue = storage.epilogue.get_tensor(cute.make_layout(NUM_CONSUMERS * EPILOGUE_WORDS))
            self.consume(
                cta, grid, total_items, tables, pipe, tiled_mma, s_c, w_bytes, epilogue, c_scale, w_scale, out,
                tidx - WARPGROUP,
            )  # fmt: skip

    @cute.jit
    def locate(self, item: Int32, tables):
        """(expert, first packed row, valid rows, W2 tile) of a work item: item = token tile x W_TILES + W2 tile, the
        token tiles numbered over the experts in order (`streaming_gemm.locate_row_tile`)."""
        tile_end, expert_count, expert_offset = tables
        expert, _, valid_rows, first_row = locate_row_tile(
            item // W_TILES, TILE_T, tile_end, expert_count, expert_offset
        )
        return expert, first_row, valid_rows, item % W_TILES

    @cute.jit
    def produce(self, cta, grid, total_items, tables, pipe, atom_c, coords_c, atom_w, coords_w, s_c, s_w):
        """Warp 0: every stage of the CTA's items by TMA, each on its slot's full barrier once the consumers released
        the slot (`producer_acquire`)."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.num_stages)
        g_w = cute.local_tile(coords_w, (TILE_W, TILE_K), (None, None, None))  # (tile, W2 tile, K block, expert)
        slots_w, tiles_w = cpasync.tma_partition(
            atom_w, 0, cute.make_layout(1), cute.group_modes(s_w, 0, 2), cute.group_modes(g_w, 0, 2)
        )
        item = cta
        while item < total_items:
            expert, row0, _, w_tile = self.locate(item, tables)
            # C from packed row `row0` on (any row: the rows are C's outer dimension; rows past the expert's are another
            # expert's or out of bounds, filled with zeros; their token columns are never stored).
            g_c = cute.local_tile(cute.domain_offset((row0, 0), coords_c), (TILE_T, TILE_K), (0, None))
            slots_c, tiles_c = cpasync.tma_partition(
                atom_c, 0, cute.make_layout(1), cute.group_modes(s_c, 0, 2), cute.group_modes(g_c, 0, 2)
            )
            for kb in cutlass.range(K_BLOCKS, unroll=1):
                pipe.producer_acquire(state)
                full = pipe.producer_get_barrier(state)
                slot = state.index
                cute.copy(atom_w, tiles_w[(None, w_tile, kb, expert)], slots_w[(None, slot)], tma_bar_ptr=full)
                cute.copy(atom_c, tiles_c[(None, kb)], slots_c[(None, slot)], tma_bar_ptr=full)
                pipe.producer_commit(state)
                state.advance()
            item = item + grid
        pipe.producer_tail(state)

    @cute.jit
    def consume(
        self, cta, grid, total_items, tables, pipe, tiled_mma, s_c, w_bytes, epilogue, c_scale, w_scale, out, mma_tidx,
    ):  # fmt: skip
        """Warpgroups 1-2: per item, 16 blocks of RS-WGMMAs on 64 W2 rows each (the next block converted while the
        MMAs run), then the epilogue through shared memory. The W2 block scale folded into the conversion, all blocks
        accumulating into `acc`."""
        wg = mma_tidx // WARPGROUP
        wg_tidx = mma_tidx % WARPGROUP
        thr_mma = tiled_mma.get_slice(wg_tidx)
        t_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_c))  # (MMA, N, k16 steps, stage)
        a_sets = [
            cute.make_rmem_tensor(thr_mma.partition_shape_A((WG_ROWS, TILE_K)), cutlass.Float16) for _ in range(2)
        ]
        acc_shape = thr_mma.partition_shape_C((WG_ROWS, TILE_T))
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        coords = thr_mma.partition_C(cute.make_identity_tensor((WG_ROWS, TILE_T)))
        row0, col0 = coords[0]  # the thread's first (W2 row, token); fragment_row/col give the others
        w_row = wg * WG_ROWS + (wg_tidx // 32) * 16 + (wg_tidx % 32) // 4  # the item's row of its A fragments' row g
        quad = wg_tidx % 4
        buffer = cute.make_tensor(
            epilogue.iterator + cute.assume(wg * EPILOGUE_WORDS, divby=EPILOGUE_WORDS), cute.make_layout(EPILOGUE_WORDS)
        )
        copy_16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        held = cute.make_rmem_tensor((VEC,), Float32)
        full_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.num_stages)
        empty_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.num_stages)
        # Folded scale: block kb's A = f16(e4m3 x f16(s_kb / s_item)), s_item the item's largest block scale (so
        # |A| <= 448), every block's MMAs accumulating into `acc` (the item's first fresh), x s_item in the
        # epilogue. Per block: fence, its eight MMAs, commit; wait_group(1) = the previous block's MMAs
        # completed (this block's may still run): only then its A set is rewritten (with the block after this
        # one) and its stage released. Block b's slot is `mma_state`'s; `empty_state` trails it by one block.
        # A third A set (converting two blocks ahead) is not tried: 16 blocks do not cycle through 3 sets, and
        # with one block's MMAs queued behind the running ones the conversion is already hidden (an estimate:
        # ~90 instructions a thread per block, ~1/5 of the issue slots of a block's ~1000 tensor cycles).
        # One tiled MMA per issue site, each made here: `issue_block` sets its ACCUMULATE field, a runtime value
        # that must not flow from one site's loop into another's.
        mma_first, mma_loop, mma_last = make_tiled_mma(), make_tiled_mma(), make_tiled_mma()
        mma_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.num_stages)
        # s_item of the CTA's first item here, of each next one while the item's last MMAs and its epilogue run
        # (`locate` gives an expert < 32 and a W2 tile < 56 for any item, so past the last item too).
        item = cta
        expert, _, _, w_tile = self.locate(item, tables)
        item_scale = self.item_scale(w_scale, expert, w_tile)
        while item < total_items:
            expert, first_row, valid_rows, w_tile = self.locate(item, tables)
            inverse = Float32(1.0) / item_scale
            # Blocks 0 and 1 into sets 0 and 1 (free: the previous item ended in wait_group(0)), block 0 issued
            # fresh between them.
            factor = block_factor(w_scale[expert, w_tile, 0] * inverse)
            self.next_block(pipe, full_state, a_sets[0], w_bytes, w_row, quad, factor)
            full_state.advance()
            self.issue_block(mma_first, acc, a_sets[0], t_b, mma_state.index)
            mma_state.advance()
            factor = block_factor(w_scale[expert, w_tile, 1] * inverse)
            self.next_block(pipe, full_state, a_sets[1], w_bytes, w_row, quad, factor)
            full_state.advance()
            for kk in cutlass.range((K_BLOCKS - 2) // 2, unroll=1):
                for half in cutlass.range_constexpr(2):
                    kb = 2 * kk + 1 + half  # issued now, from set 1 - half; block kb - 1 read set `half`
                    self.issue_block(mma_loop, acc, a_sets[1 - half], t_b, mma_state.index, fresh=False)
                    mma_state.advance()
                    scale = w_scale[expert, w_tile, kb + 1]  # block kb + 1's, loaded while waiting
                    warpgroup.wait_group(1)  # block kb - 1's MMAs completed: its A set and C stage are free
                    pipe.consumer_release(empty_state)
                    empty_state.advance()
                    factor = block_factor(scale * inverse)
                    self.next_block(pipe, full_state, a_sets[half], w_bytes, w_row, quad, factor)
                    full_state.advance()
            self.issue_block(mma_last, acc, a_sets[1], t_b, mma_state.index, fresh=False)  # block 15
            mma_state.advance()
            next_expert, _, _, next_w_tile = self.locate(item + grid, tables)
            next_scale = self.item_scale(w_scale, next_expert, next_w_tile)
            warpgroup.wait_group(0)
            for _ in cutlass.range_constexpr(2):  # blocks 14 and 15
                pipe.consumer_release(empty_state)
                empty_state.advance()
            self.store(
                acc, buffer, copy_16, held, row0, col0, first_row, valid_rows, w_tile, wg, wg_tidx, c_scale, out,
                item_scale,
            )  # fmt: skip
            item_scale = next_scale
            item = item + grid

    @cute.jit
    def item_scale(self, w_scale: cute.Tensor, expert: Int32, w_tile: Int32) -> Float32:
        """s_item: the largest of the item's 16 W2 block scales (w_scale[expert, w_tile, :]), at least 2^-126 (so
        that its inverse is finite: all-zero scales give zero factors and a zero output)."""
        largest = Float32(2.0**-126)
        for kb in cutlass.range_constexpr(K_BLOCKS):
            largest = cute.arch.fmax(largest, w_scale[expert, w_tile, kb])
        return largest

    @cute.jit
    def next_block(
        self, pipe, full_state, a_set: cute.Tensor, w_bytes: cute.Tensor, w_row: Int32, quad: Int32, factor: Int32
    ):
        """Wait for the next stage and convert its W2 block into `a_set` (times `factor`, f16x2). The caller
        advances `full_state`: the DSL carries a pipeline state through a dynamic loop only where the loop's own body
        calls one of its methods (a state advanced only inside a called function keeps its values of the loop's first
        iteration)."""
        pipe.consumer_wait(full_state)
        self.convert_block(a_set, w_bytes, w_row, quad, full_state.index, factor)

    @cute.jit
    def convert_block(
        self, a_set: cute.Tensor, w_bytes: cute.Tensor, w_row: Int32, quad: Int32, slot: Int32, factor: Int32
    ):
        """This thread's W2 bytes of the stage in `slot`, converted to f16 into the A fragments of its eight k16 steps:
        8 bytes of rows g and g + 8 per k32 group j, natural K 32 j + 8 t .. + 7 (`wgmma_gemm2.convert_block`'s map:
        word `step` of a row's load feeds k16 step 2 j + step, its halves K slots 2 t and 2 t + 8). Through the
        fragment's word view ((1, v1, v2), M, step): word v1 + 2 v2 holds row g + 8 v1, K slots 2 t + 8 v2 and + 1.
        Each pair is also multiplied by `factor` (the block's f16x2 s_kb / s_item, `mul.rn.f16x2`)."""
        a_words = cute.recast_tensor(a_set, Int32)
        for j in cutlass.range_constexpr(GROUPS_PER_BLOCK):
            k = j * GROUP + quad * THREAD_BYTES
            for v1 in cutlass.range_constexpr(2):
                words = lds_shared(w_bytes.iterator + w2_offset(w2_smem_row(w_row + 8 * v1), k, slot), 2)
                for step in cutlass.range_constexpr(2):
                    for v2 in cutlass.range_constexpr(2):
                        a_words[(0, v1, v2), 0, 2 * j + step] = e4m3x2_to_f16x2_scaled(words[step], v2 == 1, factor)

    @cute.jit
    def issue_block(
        self, tiled_mma: cute.TiledMma, acc: cute.Tensor, a_set: cute.Tensor, t_b, slot: Int32, fresh: bool = True
    ):
        """A K block's eight k16 MMAs into `acc` (fresh: its first MMA overwrites it; else all accumulate), committed
        as one group (not waited for)."""
        tiled_mma.set(warpgroup.Field.ACCUMULATE, not fresh)
        warpgroup.fence()
        for k16 in cutlass.range_constexpr(TILE_K // MMA_K):
            cute.gemm(tiled_mma, acc, a_set[None, None, k16], t_b[None, None, k16, slot], acc)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def store(
        self, acc, buffer, copy_16, held, row0, col0, first_row, valid_rows, w_tile, wg, wg_tidx, c_scale, out,
        item_scale,
    ):  # fmt: skip
        """The warpgroup's acc [64 W2 rows x 128 tokens] to expert_out rows: per pass of 64 tokens, into the buffer
        (`epilogue_offset`), then 16 threads per token store its 64 columns (16-B stores) times its `c_scale` and
        `item_scale`, valid tokens only. The barriers: the buffer is free (the previous pass read it),
        then full."""
        barrier = EPILOGUE_BARRIER + wg
        column0 = w_tile * TILE_W + wg * WG_ROWS
        for p in cutlass.range_constexpr(TILE_T // EPILOGUE_TOKENS):
            cute.arch.barrier(barrier_id=barrier, number_of_threads=WARPGROUP)
            for i in cutlass.range_constexpr(ACC_SIZE):
                # col0 < 8 and fragment_col(i) - i % 2 is a multiple of 8: entry i's pass is known while tracing
                if cutlass.const_expr((fragment_col(i) - i % 2) // EPILOGUE_TOKENS == p):
                    token = col0 + fragment_col(i) - p * EPILOGUE_TOKENS
                    buffer[epilogue_offset(token, row0 + fragment_row(i))] = acc[i]
            cute.arch.barrier(barrier_id=barrier, number_of_threads=WARPGROUP)
            for r in cutlass.range_constexpr(EPILOGUE_TOKENS * WG_ROWS // VEC // WARPGROUP):
                linear = r * WARPGROUP + wg_tidx
                token = linear // (WG_ROWS // VEC)
                column = (linear % (WG_ROWS // VEC)) * VEC
                if p * EPILOGUE_TOKENS + token < valid_rows:
                    row = first_row + p * EPILOGUE_TOKENS + token
                    source = buffer.iterator + cute.assume(epilogue_offset(token, column), divby=VEC)
                    cute.copy(copy_16, cute.make_tensor(source, cute.make_layout(VEC)), held)
                    scale = c_scale[row] * item_scale
                    for v in cutlass.range_constexpr(VEC):
                        held[v] = held[v] * scale
                    target = out.iterator + cute.assume(row * HIDDEN + column0 + column, divby=VEC)
                    cute.copy(copy_16, held, cute.make_tensor(target, cute.make_layout(VEC)))


@functools.cache
def compiled(arch: str = GPU_ARCH, num_stages: int = GroupedGemm2Config.max_stages, dump_dir: str = "") -> Callable:
    """The TVM-FFI launcher `(c, c_scale, w, w_scale, out, counts, num_ctas)` on the current torch stream (c the bf16
    workspace holding f16 bits; expert e's rows from the exclusive prefix of `counts` on), compiled once for symbolic
    row counts R; needs no GPU. With `dump_dir` the PTX and the cubin are also written there."""
    rows = cute.sym_int()

    fp8, f32 = cutlass.Float8E4M3FN, Float32
    tensors = (
        rowmajor(cutlass.BFloat16, (rows, INTERMEDIATE)),
        rowmajor(f32, (rows,)),
        rowmajor(fp8, (NUM_LOCAL_EXPERTS, HIDDEN, INTERMEDIATE)),
        rowmajor(f32, (NUM_LOCAL_EXPERTS, HIDDEN_BLOCKS, INTERMEDIATE_BLOCKS)),
        rowmajor(f32, (rows, HIDDEN)),
        rowmajor(Int32, (NUM_LOCAL_EXPERTS,)),
    )
    return compile_standalone(GroupedGemm2(GroupedGemm2Config(num_stages)), tensors, arch, dump_dir)


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the grouped GEMM2 for `arch` without touching a GPU."""
    return (compiled(arch),)
