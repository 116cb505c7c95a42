"""Compute-bound GEMM1 + SwiGLU for large T: a persistent, warp-specialised FP8 WGMMA grouped GEMM.

`kernel.py`'s GEMM1 above MEDIUM_T_MAX_TOKENS (`Gemm1Feed.GATHERED_ROWS`), after the row gather (`gather_rows.py`).

Problem: A = token rows **already grouped by expert** in one contiguous buffer `a [R, 7168]` e4m3 with its 1 x 128
scales `a_scale [56, R]` f32 (transposed, as the definition's; R a multiple of 4 for the scales' tensor map), expert e
owning the packed rows [offset[e], offset[e] + counts[e]) with offset the exclusive prefix of `counts` (any offsets: an
expert's first row needs no alignment). B = W13 [32, 4096, 7168] e4m3 with its 128 x 128 block scales [32, 32, 56].
Out: C [rows, 2048] bf16 = silu(gate) x up, the second half of G1 the gate, each 32-column group in the order the
WGMMA GEMM2 reads (`intermediate_order.py`); rows past the experts' are not written.

Structure (after CUTLASS's Hopper `dense_gemm_persistent.py` and DeepGEMM's `sm90_fp8_gemm_1d2d.cuh`):
- Work item = (expert, row tile of TILE_M = 128 rows, column tile of 128 up columns and their 128 gate columns), so
  a B tile is TILE_N = 256 W13 rows (two 128-row boxes, each one scale block) and SwiGLU stays in the thread (the up
  and the gate accumulator share one fragment map). Per expert ceil(count / 128) x 16 items, expert-major, row tile
  then column tile (an expert's 16 column tiles of one row tile adjacent). The wide item streams 384 B through L2
  per 32 K MACs where 128 x 128 items streamed 512, and the stages' loads alone take ~3/4 of the GEMM's time
  (NOTES.md: 1.09-1.21x over 128 x 128 items, bitwise equal).
- The device tile scheduler: warp 0 turns `counts` into the streaming GEMMs' tables in shared memory
  (`streaming_gemm.build_expert_tables`: the inclusive prefix of 128-row tiles per expert, the counts, the experts'
  row offsets), so the item total and every item's location come from the device (item = row tile x 16 + column
  tile, `streaming_gemm.locate_row_tile`); the host launches `num_ctas` (the SM count) and never reads a count. CTA c
  walks items c, c + grid, ... In the call (`launch`) CTA 0 also copies the counts to `counts_out` for the combine.
- Warp specialisation, 384 threads, one CTA per SM: warpgroup 0 is the producer (its warp 0 issues every stage by
  TMA on the `PipelineTmaAsync` full barrier: the A tile (128 x 128 e4m3, 128-B swizzle, any first row), the B tile
  (128 up then 128 gate rows of the expert: two 128-row boxes of one tensor map over W13) and the A tile's
  scales of the K block (`SFA_ROWS` rows from the first row rounded down to `SFA_ALIGN`, see there); registers cut
  to 40); warpgroups 1 and 2 are consumers (64 rows each of the 128-row tile, registers raised to 232) that release
  each stage on the empty barrier (one arrive per warp).
- K stage = one 128-wide quantisation block (56 per item), NUM_STAGES deep (4: 4 x 48.5 KB). Per stage and column
  half (up, then gate) each consumer warpgroup issues four k32 WGMMAs (m64n128k32) into a fresh fp32 block
  accumulator, waits and promotes it into the half's accumulator: acc += block x (A scale of the row x B scale of
  the half); the stage is released once the gate half's MMAs are done, before its promotion. Registers: two 64-entry
  accumulators and one 64-entry block accumulator a thread (a block accumulator per half would not fit 232). The two
  warpgroups issue their batches together and promote together, the tensor core idle meanwhile: taking turns, or
  starting one batch apart, measured slower (NOTES.md).
- A scales arrive with each stage; the B scales (one per column half and K block) are read by every consumer thread
  from global memory while the block's MMAs run (an item's two 224-B rows stay in L1): no barrier between items.
- Epilogue: thread-local SwiGLU (entry i of the up and of the gate accumulator are one row and column,
  `fragment_row`/`fragment_col`), bf16 stores of the valid rows straight to global memory at GEMM2's column
  positions (`intermediate_order.stored_position` within each 32-column group; an item's 128 columns are four
  groups).

C stays bf16 (what today's GEMM2 reads): C requantised to one e4m3 term with 1 x 128 (or 1 x 64) scales gives a
relative L2 error of ~2.3e-2 (2.1e-2) on GEMM2's output (`probes/moe_activation_numerics.py`), above the contract's
1e-2; bf16 C 1.7e-3. An FP8 GEMM2 needs C as two e4m3 terms (hi + lo: 4.9e-4 per 128, 4.2e-4 per 64 columns, i.e. one
scale per row and item of this kernel), twice its FP8 MMAs but no e4m3 -> bf16 conversion of W2: the epilogue's
candidate once GEMM2 is built on this skeleton.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from .chain import enter
from .intermediate_order import GROUP, stored_position
from .shapes import BLOCK, GEMM1_OUT, HIDDEN, HIDDEN_BLOCKS, INTERMEDIATE, NUM_LOCAL_EXPERTS
from .standalone import compile_standalone, rowmajor
from .streaming_gemm import LinkedGemm, PersistentGemmConfig, fill_schedule_tables, locate_row_tile, smem_region
from .swiglu import swiglu_bf16x2

__all__ = ["GroupedGemm1", "GroupedGemm1Config", "compile_only", "fragment_col", "fragment_row", "stored_column"]

GPU_ARCH = "sm_90a"
WARPGROUP = 128
NUM_CONSUMERS = 2  # consumer (MMA) warpgroups
NUM_THREADS = (1 + NUM_CONSUMERS) * WARPGROUP  # 384: the producer warpgroup first
CONSUMER_THREADS = NUM_CONSUMERS * WARPGROUP
PRODUCER_REGS = 40
CONSUMER_REGS = 232
WG_ROWS = 64  # WGMMA's M: rows of A per consumer warpgroup
TILE_M = NUM_CONSUMERS * WG_ROWS  # 128 token rows per item
HALF_N = 128  # up columns of an item (and as many gate columns): one WGMMA N and one W13 scale block
TILE_N = 2 * HALF_N  # 256 W13 rows per item
TILE_K = BLOCK  # one quantisation block per stage
MMA_K = 32
K_BLOCKS = HIDDEN // TILE_K  # 56 stages per item
N_TILES = INTERMEDIATE // HALF_N  # 16 column tiles per row tile
ACC_SIZE = WG_ROWS * HALF_N // WARPGROUP  # 64 fp32 entries per consumer thread in each half's accumulator
# A's scales are f32 with the rows innermost ([56, R]). A TMA box must start on a 16-byte boundary of its innermost
# dimension (on Hopper an unaligned start is an illegal instruction, not a bounds-checked copy), and an expert's first
# row is any row: a stage's box starts at the item's first row rounded down to SFA_ALIGN rows and holds the tile's
# rows at (first row % SFA_ALIGN) + row, so TILE_M + SFA_ALIGN - 1 rows, rounded up to 16 bytes.
SFA_ALIGN = 16 // 4  # f32 rows per 16 bytes
SFA_ROWS = TILE_M + SFA_ALIGN  # 132 rows per box (528 B, a multiple of 16)
SFA_STAGE = (SFA_ROWS + 31) // 32 * 32  # f32 per stage slot: every slot's TMA destination 128-byte aligned
STAGE_BYTES = TILE_M * TILE_K + TILE_N * TILE_K + SFA_ROWS * 4  # A, B, A's scales (the TMA bytes of a stage)

assert HALF_N == BLOCK  # an item's up (gate) rows are one 128-row scale block and one TMA box
assert HIDDEN % TILE_K == 0 and INTERMEDIATE % HALF_N == 0
assert HALF_N % GROUP == 0  # an item's columns are whole groups of GEMM2's column order


def fragment_row(i: int) -> int:
    """Row of accumulator entry `i` relative to the thread's first row (the m64nNk32 fragment: pairs of adjacent
    columns, then the row 8 below, then the next 8 columns)."""
    return 8 * ((i // 2) % 2)


def fragment_col(i: int) -> int:
    """Column of accumulator entry `i` relative to the thread's first column."""
    return i % 2 + 8 * (i // 4)


def stored_column(n_tile, column):
    """C column of an item's natural column `column` (0..63) in column tile `n_tile`: its position in GEMM2's order
    (`intermediate_order.stored_position`) within its 32-column group. Plain arithmetic: the kernel calls it with DSL
    integers, the CPU tests with Python ints."""
    return n_tile * HALF_N + column - column % GROUP + stored_position(column % GROUP)


def promote(acc: cute.Tensor, block_acc: cute.Tensor, scales: tuple) -> None:
    """acc += block x scale, entry by entry; `scales` are the thread's two (row, half) products (row0, row0 + 8).
    Plain Python called while tracing: the loop unrolls as it is written, every index static."""
    for i in range(ACC_SIZE):
        acc[i] = acc[i] + block_acc[i] * scales[fragment_row(i) // 8]


class WarpSpecializedConfig(PersistentGemmConfig):
    """What the grouped GEMMs' configurations share: a pipeline of 2..`max_stages` stages (the default the most that
    fit) and one CTA per SM. Its shared memory is the subclass's `fields()` followed by the schedule's tables
    (`streaming_gemm.SCHEDULE_TABLES`: row-tile ends, counts, offsets per expert)."""

    max_stages: int

    def __init__(self, num_stages: int | None = None):
        num_stages = self.max_stages if num_stages is None else num_stages
        if not 2 <= num_stages <= self.max_stages:
            raise ValueError(f"num_stages must be 2..{self.max_stages}, got {num_stages}")
        self.num_stages = num_stages
        self.check_fits()

    def ctas_per_sm(self) -> int:
        """One: its 384 threads take the register file (40 x 128 + 232 x 256) and its stages the shared memory."""
        return 1


class GroupedGemm1Config(WarpSpecializedConfig):
    """Compile-time shape: the pipeline depth (2-4 stages of 48.5 KB; 4 by default)."""

    max_stages = 4
    gathered_rows = True  # A is the grouped rows of the row gather (`gather_rows.py`), not x: what the host reads

    def fields(self) -> dict:
        ns = self.num_stages
        return {
            "barriers": smem_region(cutlass.Int64, 2 * ns, 8),  # the pipeline's full and empty mbarriers
            "a_stages": smem_region(cutlass.Float8E4M3FN, ns * TILE_M * TILE_K, 1024),  # 128-B swizzle per 1 KB
            "b_stages": smem_region(cutlass.Float8E4M3FN, ns * TILE_N * TILE_K, 1024),  # per stage: up, gate box
            "a_scales": smem_region(Float32, ns * SFA_STAGE, 128),
        }


@cute.jit
def mma_operands(num_stages: cutlass.Constexpr):
    """The two-warpgroup FP8 tiled MMA (each 64 rows x 128 columns, k32) and the staged K_SW128 layouts of A and of B,
    whose 2 x `num_stages` slots hold each stage's up box then its gate box (HALF_N x TILE_K each)."""
    k_major = LayoutEnum.ROW_MAJOR
    tiled_mma = sm90_utils.make_trivial_tiled_mma(
        cutlass.Float8E4M3FN,
        cutlass.Float8E4M3FN,
        k_major.sm90_mma_major_mode(),
        k_major.sm90_mma_major_mode(),
        Float32,
        (NUM_CONSUMERS, 1, 1),
        tiler_mn=(WG_ROWS, HALF_N),
    )
    tile = (TILE_M, HALF_N, TILE_K)
    a_layout = sm90_utils.make_smem_layout_a(k_major, tile, cutlass.Float8E4M3FN, num_stages)
    b_layout = sm90_utils.make_smem_layout_b(k_major, tile, cutlass.Float8E4M3FN, 2 * num_stages)
    return tiled_mma, a_layout, b_layout


class GroupedGemm1(LinkedGemm):
    """The call's GEMM1 on grouped rows (`host.ExpertGemm`: `launch`, `with_link`), and `__call__(a, a_scale, w,
    w_scale, out, counts, num_ctas, stream)`, the host function of the standalone launcher (`compiled`)."""

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,
        a_scale: cute.Tensor,
        w: cute.Tensor,
        w_scale: cute.Tensor,
        out: cute.Tensor,
        counts: cute.Tensor,
        num_ctas: Int32,
        stream,
    ):
        self.launch(a, a_scale, w, w_scale, out, counts, None, num_ctas, stream)

    @cute.jit
    def launch(
        self,
        a: cute.Tensor,
        a_scale: cute.Tensor,
        w: cute.Tensor,
        w_scale: cute.Tensor,
        out: cute.Tensor,
        counts: cute.Tensor,
        expert_tokens,
        num_ctas: Int32,
        stream,
        routing=None,
        counts_out=None,
    ):
        """`a`, `a_scale`: the grouped rows and their scales (`gather_rows.py`), so `expert_tokens` is not read; no
        `routing` (the routing grid runs before the gather). `counts_out`: where CTA 0 copies the counts (the call's,
        for the combine; None standalone)."""
        if cutlass.const_expr(routing is not None):
            raise ValueError("the grouped GEMM1 takes rows gathered after the routing grid; it does not route")
        ns = self.cfg.num_stages
        tiled_mma, a_layout, b_layout = mma_operands(ns)
        tma_g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_a = cpasync.make_tiled_tma_atom(tma_g2s, a, cute.slice_(a_layout, (None, None, 0)), (TILE_M, TILE_K))
        # W13 as (rows, K, expert), boxes of HALF_N rows: column tile n's up box is row box n, its gate box N_TILES + n.
        w_view = cute.make_tensor(
            w.iterator,
            cute.make_layout((GEMM1_OUT, HIDDEN, w.shape[0]), stride=(HIDDEN, 1, GEMM1_OUT * HIDDEN)),
        )
        tma_b = cpasync.make_tiled_tma_atom(tma_g2s, w_view, cute.slice_(b_layout, (None, None, 0)), (HALF_N, TILE_K))
        # A's scales [56, R] seen as (R, 56): a stage's box is SFA_ROWS consecutive rows of one K block.
        sfa_view = cute.make_tensor(
            a_scale.iterator, cute.make_layout((a_scale.shape[1], HIDDEN_BLOCKS), stride=(1, a_scale.stride[0]))
        )
        tma_sfa = cpasync.make_tiled_tma_atom(tma_g2s, sfa_view, cute.make_layout((SFA_ROWS, 1)), (SFA_ROWS, 1))
        storage_type = self.cfg.shared_storage()
        self.kernel(
            tma_a, tma_b, tma_sfa, w_scale, out, counts, counts_out, tiled_mma, a_layout, b_layout, storage_type
        ).launch(
            grid=[num_ctas, 1, 1],
            block=[NUM_THREADS, 1, 1],
            smem=storage_type.size_in_bytes(),
            stream=stream,
            use_pdl=self.link.waits,
        )

    @cute.kernel
    def kernel(
        self,
        tma_a,
        tma_b,
        tma_sfa,
        w_scale: cute.Tensor,
        out: cute.Tensor,
        counts: cute.Tensor,
        counts_out,
        tiled_mma: cute.TiledMma,
        a_layout: cute.ComposedLayout,
        b_layout: cute.ComposedLayout,
        storage_type: cutlass.Constexpr,
    ):
        enter(self.link)  # the counts and the grouped rows are the previous kernels' (routing, gather)
        ns = self.cfg.num_stages
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        atom_a, coords_a = tma_a
        atom_b, coords_b = tma_b
        atom_sfa, coords_sfa = tma_sfa
        if warp == 0:
            cpasync.prefetch_descriptor(atom_a)
            cpasync.prefetch_descriptor(atom_b)
            cpasync.prefetch_descriptor(atom_sfa)

        storage = cutlass.memory.SmemAllocator().allocate(storage_type)
        tile_end, expert_count, expert_offset = fill_schedule_tables(
            storage, counts, TILE_M, cta, warp, lane, counts_out
        )  # the device tile scheduler's tables

        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=ns,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS // 32),
            tx_count=STAGE_BYTES,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )  # its CTA barrier also publishes the tables
        total_items = tile_end[NUM_LOCAL_EXPERTS - 1] * N_TILES
        tables = (tile_end, expert_count, expert_offset)

        s_a = storage.a_stages.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        s_b = storage.b_stages.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        s_sfa = storage.a_scales.get_tensor(cute.make_layout((SFA_ROWS, ns), stride=(1, SFA_STAGE)))

        if warp < WARPGROUP // 32:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                self.produce(
                    cta, grid, total_items, tables, pipe, atom_a, coords_a, atom_b, coords_b, atom_sfa, coords_sfa,
                    s_a, s_b, s_sfa,
                )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self.consume(
                cta, grid, total_items, tables, pipe, tiled_mma, s_a, s_b, s_sfa, w_scale, out,
                tidx - WARPGROUP,
            )  # fmt: skip

    @cute.jit
    def locate(self, item: Int32, tables):
        """(expert, first row of A, valid rows, column tile) of a work item: item = row tile x N_TILES + column tile,
        the row tiles numbered over the experts in order (`streaming_gemm.locate_row_tile`)."""
        tile_end, expert_count, expert_offset = tables
        expert, _, valid_rows, first_row = locate_row_tile(
            item // N_TILES, TILE_M, tile_end, expert_count, expert_offset
        )
        return expert, first_row, valid_rows, item % N_TILES

    @cute.jit
    def produce(
        self, cta, grid, total_items, tables, pipe, atom_a, coords_a, atom_b, coords_b, atom_sfa, coords_sfa, s_a, s_b,
        s_sfa,
    ):  # fmt: skip
        """Warp 0: every stage of the CTA's items by TMA, each on its slot's full barrier once the consumers released
        the slot (`producer_acquire`)."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.num_stages)
        g_b = cute.local_tile(coords_b, (HALF_N, TILE_K), (None, None, None))  # (box, row box, K block, expert)
        slots_b, tiles_b = cpasync.tma_partition(
            atom_b, 0, cute.make_layout(1), cute.group_modes(s_b, 0, 2), cute.group_modes(g_b, 0, 2)
        )
        # A's scale stages as the tensor map's (SFA_ROWS, 1) boxes
        sfa_layout = cute.make_layout((SFA_ROWS, 1, self.cfg.num_stages), stride=(1, 0, SFA_STAGE))
        s_sfa_staged = cute.make_tensor(s_sfa.iterator, sfa_layout)
        item = cta
        while item < total_items:
            expert, row0, _, n_tile = self.locate(item, tables)
            # A from row `row0` on (any row: the rows are A's outer dimension; rows past the expert's are another
            # expert's or out of bounds, filled with zeros, and never stored), its scales from row0 rounded down to
            # SFA_ALIGN (their rows are innermost).
            g_a = cute.local_tile(cute.domain_offset((row0, 0), coords_a), (TILE_M, TILE_K), (0, None))
            slots_a, tiles_a = cpasync.tma_partition(
                atom_a, 0, cute.make_layout(1), cute.group_modes(s_a, 0, 2), cute.group_modes(g_a, 0, 2)
            )
            sfa_row0 = row0 - row0 % SFA_ALIGN
            g_sfa = cute.local_tile(cute.domain_offset((sfa_row0, 0), coords_sfa), (SFA_ROWS, 1), (0, None))
            slots_sfa, tiles_sfa = cpasync.tma_partition(
                atom_sfa, 0, cute.make_layout(1), cute.group_modes(s_sfa_staged, 0, 2), cute.group_modes(g_sfa, 0, 2)
            )
            for kb in cutlass.range(K_BLOCKS, unroll=1):
                pipe.producer_acquire(state)
                full = pipe.producer_get_barrier(state)
                slot = state.index
                cute.copy(atom_a, tiles_a[(None, kb)], slots_a[(None, slot)], tma_bar_ptr=full)
                cute.copy(atom_b, tiles_b[(None, n_tile, kb, expert)], slots_b[(None, 2 * slot)], tma_bar_ptr=full)
                gate_box = tiles_b[(None, N_TILES + n_tile, kb, expert)]
                cute.copy(atom_b, gate_box, slots_b[(None, 2 * slot + 1)], tma_bar_ptr=full)
                cute.copy(atom_sfa, tiles_sfa[(None, kb)], slots_sfa[(None, slot)], tma_bar_ptr=full)
                pipe.producer_commit(state)
                state.advance()
            item = item + grid
        pipe.producer_tail(state)

    @cute.jit
    def consume(
        self, cta, grid, total_items, tables, pipe, tiled_mma, s_a, s_b, s_sfa, w_scale, out, mma_tidx,
    ):  # fmt: skip
        """Warpgroups 1-2: per item, 56 blocks of WGMMAs per column half each promoted in fp32 registers, then SwiGLU
        and the bf16 stores."""
        thr_mma = tiled_mma.get_slice(mma_tidx)
        t_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))  # (MMA, M, k32 steps, stage)
        t_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
        acc_shape = thr_mma.partition_shape_C((TILE_M, HALF_N))
        acc_up = cute.make_rmem_tensor(acc_shape, Float32)
        acc_gate = cute.make_rmem_tensor(acc_shape, Float32)
        block_acc = cute.make_rmem_tensor(acc_shape, Float32)
        coords = thr_mma.partition_C(cute.make_identity_tensor((TILE_M, HALF_N)))
        row0, col0 = coords[0]  # the thread's first (row, column) in the item; fragment_row/col give the others
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.num_stages)
        out_words = cute.recast_tensor(out, Int32)  # [rows, 1024]: bf16 pairs
        item = cta
        while item < total_items:
            expert, first_row, valid_rows, n_tile = self.locate(item, tables)
            sfa_row = row0 + first_row % SFA_ALIGN  # the thread's first row in the stage's scale box
            # The item's B scale rows, w_scale[expert, row, K block] for the up and the gate half: read per block
            # from global memory while the up half's MMAs run (a 224-B row, in L1 after its first blocks), so that no
            # barrier of the consumers stands between one item's last MMAs and the next item's first.
            up_row = n_tile
            gate_row = N_TILES + n_tile
            acc_up.fill(0.0)
            acc_gate.fill(0.0)
            # An expert's last row tile may hold no row of this warpgroup's 64 (at most 64 valid rows): its MMAs
            # are skipped (the other warpgroup's then have the tensor core alone), its stages still released.
            has_rows = row0 - row0 % WG_ROWS < valid_rows
            for kb in cutlass.range(K_BLOCKS, unroll=1):
                pipe.consumer_wait(state)
                slot = state.index
                if has_rows:
                    sa0, sa1, sb_up, sb_gate = Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)
                    for half in cutlass.range_constexpr(2):
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                        cute.nvgpu.warpgroup.fence()
                        for k in cutlass.range_constexpr(TILE_K // MMA_K):
                            b_k = t_b[None, None, k, 2 * slot + half]
                            cute.gemm(tiled_mma, block_acc, t_a[None, None, k, slot], b_k, block_acc)
                            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                        cute.nvgpu.warpgroup.commit_group()
                        if cutlass.const_expr(half == 0):
                            # The scales, read while the up half's MMAs run: rows row0 and row0 + 8, both halves.
                            sa0 = s_sfa[sfa_row, slot]
                            sa1 = s_sfa[sfa_row + 8, slot]
                            sb_up = w_scale[expert, up_row, kb]
                            sb_gate = w_scale[expert, gate_row, kb]
                        cute.nvgpu.warpgroup.wait_group(0)
                        if cutlass.const_expr(half == 0):
                            promote(acc_up, block_acc, (sa0 * sb_up, sa1 * sb_up))
                        else:
                            pipe.consumer_release(state)  # the stage's MMAs are done: the producer may refill it
                            promote(acc_gate, block_acc, (sa0 * sb_gate, sa1 * sb_gate))
                else:
                    pipe.consumer_release(state)
                state.advance()
            # SwiGLU: up entry i and gate entry i are one row and column of the thread; column c of the item stored at
            # its position in GEMM2's order within its 32-column group. Entries i and i + 1 (i even) are adjacent
            # columns c, c + 1 of one row (c even: col0 is), and GEMM2's order keeps such a pair adjacent, so each
            # pair is one 4-byte store.
            for i in cutlass.range_constexpr(0, ACC_SIZE, 2):
                row = row0 + fragment_row(i)
                if row < valid_rows:
                    column = stored_column(n_tile, col0 + fragment_col(i))
                    out_words[first_row + row, column // 2] = swiglu_bf16x2(
                        acc_gate[i], acc_up[i], acc_gate[i + 1], acc_up[i + 1]
                    )
            item = item + grid


@functools.cache
def compiled(arch: str = GPU_ARCH, num_stages: int = GroupedGemm1Config.max_stages, dump_dir: str = "") -> Callable:
    """The TVM-FFI launcher `(a, a_scale, w, w_scale, out, counts, num_ctas)` on the current torch stream (expert e's
    rows from the exclusive prefix of `counts` on), compiled once for symbolic row counts R (a multiple of 4); needs no
    GPU. With `dump_dir` the PTX and the cubin are also written there (`*.ptx`, `*.cubin`: what the CPU tests read the
    kernel's structure from)."""
    rows = cute.sym_int(divisibility=4)

    fp8, f32 = cutlass.Float8E4M3FN, Float32
    tensors = (
        rowmajor(fp8, (rows, HIDDEN)),
        rowmajor(f32, (HIDDEN_BLOCKS, rows)),
        rowmajor(fp8, (NUM_LOCAL_EXPERTS, GEMM1_OUT, HIDDEN)),
        rowmajor(f32, (NUM_LOCAL_EXPERTS, GEMM1_OUT // BLOCK, HIDDEN_BLOCKS)),
        rowmajor(cutlass.BFloat16, (rows, INTERMEDIATE)),
        rowmajor(Int32, (NUM_LOCAL_EXPERTS,)),
    )
    return compile_standalone(GroupedGemm1(GroupedGemm1Config(num_stages)), tensors, arch, dump_dir)


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the grouped GEMM1 for `arch` without touching a GPU."""
    return (compiled(arch),)
