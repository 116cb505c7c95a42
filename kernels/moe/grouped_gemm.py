"""Kernels 3 and 4 of the MoE: the grouped expert GEMMs (GEMM1 + SwiGLU, GEMM2) in bf16 mma.sync with
per-K-block promotion of the 128 x 128 block scales."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from .shapes import (
    BLOCK,
    BLOCK_M,
    HIDDEN,
    HIDDEN_BLOCKS,
    INTERMEDIATE,
    INTERMEDIATE_BLOCKS,
    NUM_LOCAL_EXPERTS,
    NUM_THREADS,
)
from .swiglu import swiglu_bf16

BLOCK_N = 128  # B rows per tile: GEMM1 64 up + 64 gate rows, GEMM2 128 output columns
BLOCK_K = BLOCK  # one quantisation block per main-loop step
GEMM1_HALF_N = BLOCK_N // 2  # C columns per GEMM1 tile
GEMM1_N_TILES = INTERMEDIATE // GEMM1_HALF_N  # 32
GEMM2_N_TILES = HIDDEN // BLOCK_N  # 56
NUM_STAGES = 2
# bf16 tiles in shared memory are padded by 16 B per row so that the 8 rows one ldmatrix reads fall
# on distinct bank groups.
BF16_ROW_STRIDE = BLOCK_K + 8
FP8_CHUNK = 16  # e4m3 elements per 16-B cp.async
BF16_CHUNK = 8  # bf16 elements per 16-B cp.async
C_TILE_STRIDE = BLOCK_N + 4  # fp32 staging of the GEMM1 accumulator for the SwiGLU epilogue

assert INTERMEDIATE % GEMM1_HALF_N == 0 and GEMM1_HALF_N <= BLOCK and BLOCK_N == BLOCK


# ------------------------------------------------------------------------------------------------
# grouped GEMMs
# ------------------------------------------------------------------------------------------------


@cute.jit
def _find_tile(counts: cute.Tensor, tile: cutlass.Int32):
    """(local expert or -1, row tile within the expert, packed row offset of the expert, its count)
    for the tile-th row tile, the tiles numbered expert by expert."""
    expert = cutlass.Int32(-1)
    expert_tile = cutlass.Int32(0)
    expert_offset = cutlass.Int32(0)
    expert_count = cutlass.Int32(0)
    remaining = tile
    offset = cutlass.Int32(0)
    for e in cutlass.range_constexpr(NUM_LOCAL_EXPERTS):
        count = counts[e]
        tiles = (count + BLOCK_M - 1) // BLOCK_M
        if expert < 0:
            if remaining < tiles:
                expert = cutlass.Int32(e)
                expert_tile = remaining
                expert_offset = offset
                expert_count = count
            else:
                remaining = remaining - tiles
        offset = offset + count
    return expert, expert_tile, expert_offset, expert_count


def _make_tiled_mma() -> cute.TiledMma:
    # 2 x 2 warps; each warp takes 16 columns (two n8 atoms) per 32-column step, which is what a
    # 4-matrix ldmatrix of the B operand fills.
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (16, 8, 16)),
        (2, 2, 1),
        permutation_mnk=(32, 32, 16),
    )


class GroupedGemm:
    """Both expert GEMMs; `gemm1` picks the operands and the epilogue (see the module docstring).

    GEMM1: a = hidden_states [T, 7168] e4m3 (rows gathered by token), a_scale = [56, T],
           b = W13 [32, 4096, 7168], b_scale = [32, 32, 56], out = C [rows, 2048] bf16.
    GEMM2: a = C [rows, 2048] bf16 (packed rows), a_scale unused,
           b = W2 [32, 7168, 2048], b_scale = [32, 56, 16], out = O [rows, 7168] fp32.
    """

    def __init__(self, gemm1: bool):
        self.gemm1 = gemm1
        self.k_blocks = HIDDEN_BLOCKS if gemm1 else INTERMEDIATE_BLOCKS
        self.n_tiles = GEMM1_N_TILES if gemm1 else GEMM2_N_TILES

    @cute.jit
    def launch(
        self,
        a: cute.Tensor,
        a_scale: cute.Tensor,
        b: cute.Tensor,
        b_scale: cute.Tensor,
        out: cute.Tensor,
        counts: cute.Tensor,
        expert_tokens: cute.Tensor,
        num_row_tiles: cutlass.Int32,
        stream,
    ):
        tiled_mma = _make_tiled_mma()
        bf16_a_layout = cute.make_layout((BLOCK_M, BLOCK_K), stride=(BF16_ROW_STRIDE, 1))
        bf16_b_layout = cute.make_layout((BLOCK_N, BLOCK_K), stride=(BF16_ROW_STRIDE, 1))
        fp8_a_stage_layout = cute.make_layout(
            (BLOCK_M, BLOCK_K, NUM_STAGES), stride=(BLOCK_K, 1, BLOCK_M * BLOCK_K)
        )
        bf16_a_stage_layout = cute.make_layout(
            (BLOCK_M, BLOCK_K, NUM_STAGES), stride=(BF16_ROW_STRIDE, 1, BLOCK_M * BF16_ROW_STRIDE)
        )
        fp8_b_stage_layout = cute.make_layout(
            (BLOCK_N, BLOCK_K, NUM_STAGES), stride=(BLOCK_K, 1, BLOCK_N * BLOCK_K)
        )
        c_tile_layout = cute.make_layout((BLOCK_M, BLOCK_N), stride=(C_TILE_STRIDE, 1))

        if cutlass.const_expr(self.gemm1):

            @cute.struct
            class SharedStorage:
                stage_a: cute.struct.Align[
                    cute.struct.MemRange[cutlass.Float8E4M3FN, NUM_STAGES * BLOCK_M * BLOCK_K], 128
                ]
                stage_b: cute.struct.Align[
                    cute.struct.MemRange[cutlass.Float8E4M3FN, NUM_STAGES * BLOCK_N * BLOCK_K], 128
                ]
                tile_a: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BLOCK_M * BF16_ROW_STRIDE], 128]
                tile_b: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BLOCK_N * BF16_ROW_STRIDE], 128]
                tile_c: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BLOCK_M * C_TILE_STRIDE], 128]
                scale_a: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BLOCK_M * HIDDEN_BLOCKS], 16]
                scale_b: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 2 * HIDDEN_BLOCKS], 16]
                row_token: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, BLOCK_M], 16]

        else:

            @cute.struct
            class SharedStorage:
                stage_a: cute.struct.Align[
                    cute.struct.MemRange[cutlass.BFloat16, NUM_STAGES * BLOCK_M * BF16_ROW_STRIDE], 128
                ]
                stage_b: cute.struct.Align[
                    cute.struct.MemRange[cutlass.Float8E4M3FN, NUM_STAGES * BLOCK_N * BLOCK_K], 128
                ]
                tile_b: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BLOCK_N * BF16_ROW_STRIDE], 128]
                scale_a: cute.struct.Align[
                    cute.struct.MemRange[cutlass.Float32, BLOCK_M * INTERMEDIATE_BLOCKS], 16
                ]
                scale_b: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 2 * INTERMEDIATE_BLOCKS], 16]
                row_token: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, BLOCK_M], 16]

        self.kernel(
            a,
            a_scale,
            b,
            b_scale,
            out,
            counts,
            expert_tokens,
            tiled_mma,
            bf16_a_layout,
            bf16_b_layout,
            fp8_a_stage_layout,
            bf16_a_stage_layout,
            fp8_b_stage_layout,
            c_tile_layout,
            SharedStorage,
        ).launch(
            grid=[num_row_tiles, self.n_tiles, 1],
            block=[NUM_THREADS, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        a: cute.Tensor,
        a_scale: cute.Tensor,
        b: cute.Tensor,
        b_scale: cute.Tensor,
        out: cute.Tensor,
        counts: cute.Tensor,
        expert_tokens: cute.Tensor,
        tiled_mma: cute.TiledMma,
        bf16_a_layout: cute.Layout,
        bf16_b_layout: cute.Layout,
        fp8_a_stage_layout: cute.Layout,
        bf16_a_stage_layout: cute.Layout,
        fp8_b_stage_layout: cute.Layout,
        c_tile_layout: cute.Layout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        row_tile, n_tile, _ = cute.arch.block_idx()
        expert, expert_tile, expert_offset, expert_count = _find_tile(counts, row_tile)
        if expert >= 0:
            first_row = expert_tile * BLOCK_M  # within the expert's list
            valid_rows = cutlass.min(expert_count - first_row, BLOCK_M)
            packed_row0 = expert_offset + first_row  # row of the packed C / O workspaces

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            stage_b = storage.stage_b.get_tensor(fp8_b_stage_layout)
            tile_b = storage.tile_b.get_tensor(bf16_b_layout)
            scale_a = storage.scale_a.get_tensor(cute.make_layout((BLOCK_M, self.k_blocks), stride=(self.k_blocks, 1)))
            scale_b = storage.scale_b.get_tensor(cute.make_layout((2, self.k_blocks), stride=(self.k_blocks, 1)))
            row_token = storage.row_token.get_tensor(cute.make_layout(BLOCK_M))
            if cutlass.const_expr(self.gemm1):
                stage_a = storage.stage_a.get_tensor(fp8_a_stage_layout)
                tile_a = storage.tile_a.get_tensor(bf16_a_layout)
            else:
                stage_a = storage.stage_a.get_tensor(bf16_a_stage_layout)

            # ---- per-tile tables: the token of each row, the scales of every K block ----
            # (A statement, not a conditional expression: the load must not run for rows past the
            # expert's list, which can lie past the end of expert_tokens.)
            if tidx < BLOCK_M:
                if tidx < valid_rows:
                    row_token[tidx] = expert_tokens[expert, first_row + tidx]
                else:
                    row_token[tidx] = cutlass.Int32(-1)
            # B rows [0, 64) of a GEMM1 tile are up rows n0.., rows [64, 128) gate rows 2048 + n0..;
            # a GEMM2 tile's 128 rows are output columns n0.. (one scale block, stored twice).
            if cutlass.const_expr(self.gemm1):
                up_block = n_tile * GEMM1_HALF_N // BLOCK
                gate_block = (INTERMEDIATE + n_tile * GEMM1_HALF_N) // BLOCK
            else:
                up_block = n_tile * BLOCK_N // BLOCK
                gate_block = up_block
            for i in cutlass.range_constexpr((2 * self.k_blocks + NUM_THREADS - 1) // NUM_THREADS):
                linear = i * NUM_THREADS + tidx
                if linear < 2 * self.k_blocks:
                    half = linear // self.k_blocks
                    kb = linear % self.k_blocks
                    scale_b[half, kb] = b_scale[expert, up_block if half == 0 else gate_block, kb]
            cute.arch.sync_threads()
            for i in cutlass.range_constexpr(BLOCK_M * self.k_blocks // NUM_THREADS):
                linear = i * NUM_THREADS + tidx
                row = linear // self.k_blocks
                kb = linear % self.k_blocks
                # Rows past the expert's tokens get scale 0, so their (zero-filled) products vanish.
                value = cutlass.Float32(0.0)
                if row < valid_rows:
                    if cutlass.const_expr(self.gemm1):
                        value = a_scale[kb, row_token[row]]
                    else:
                        value = cutlass.Float32(1.0)
                scale_a[row, kb] = value

            g2s_fp8 = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                cutlass.Float8E4M3FN,
                num_bits_per_copy=128,
            )
            g2s_bf16 = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                cutlass.BFloat16,
                num_bits_per_copy=128,
            )
            b_row0_up = n_tile * (GEMM1_HALF_N if self.gemm1 else BLOCK_N)

            self.load_k_block(
                g2s_fp8, g2s_bf16, a, b, stage_a, stage_b, row_token, expert, b_row0_up,
                packed_row0, valid_rows, 0, 0, tidx,
            )
            cute.arch.cp_async_commit_group()

            thr_mma = tiled_mma.get_slice(tidx)
            ldsm_a = cute.make_tiled_copy_A(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), cutlass.BFloat16),
                tiled_mma,
            )
            ldsm_b = cute.make_tiled_copy_B(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), cutlass.BFloat16),
                tiled_mma,
            )
            thr_ldsm_a = ldsm_a.get_slice(tidx)
            thr_ldsm_b = ldsm_b.get_slice(tidx)

            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK_M, BLOCK_N)), cutlass.Float32)
            acc.fill(0.0)
            block_acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK_M, BLOCK_N)), cutlass.Float32)
            # (row, column) of every accumulator element, for the per-row / per-half scales.
            tCcC = thr_mma.partition_C(cute.make_identity_tensor((BLOCK_M, BLOCK_N)))

            tBsB = thr_ldsm_b.partition_S(tile_b)
            tBrB = thr_mma.make_fragment_B(thr_mma.partition_B(tile_b))
            tBrB_view = thr_ldsm_b.retile(tBrB)

            for kb in cutlass.range(self.k_blocks, unroll=1):
                stage = kb % NUM_STAGES
                if kb + 1 < self.k_blocks:
                    self.load_k_block(
                        g2s_fp8, g2s_bf16, a, b, stage_a, stage_b, row_token, expert, b_row0_up,
                        packed_row0, valid_rows, kb + 1, (kb + 1) % NUM_STAGES, tidx,
                    )
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(1)  # block kb has landed (the prefetch may be in flight)
                cute.arch.sync_threads()

                # ---- e4m3 -> bf16 (exact) ----
                self.convert_rows(stage_b[None, None, stage], tile_b, BLOCK_N, tidx)
                if cutlass.const_expr(self.gemm1):
                    self.convert_rows(stage_a[None, None, stage], tile_a, BLOCK_M, tidx)
                    a_tile = tile_a
                else:
                    a_tile = stage_a[None, None, stage]
                cute.arch.sync_threads()

                # ---- block_acc = A_kb B_kb^T over the 128-wide K block ----
                tAsA = thr_ldsm_a.partition_S(a_tile)
                tArA = thr_mma.make_fragment_A(thr_mma.partition_A(a_tile))
                tArA_view = thr_ldsm_a.retile(tArA)
                block_acc.fill(0.0)
                for k in cutlass.range_constexpr(cute.size(tAsA.shape[2])):
                    cute.copy(ldsm_a, tAsA[None, None, k], tArA_view[None, None, k])
                    cute.copy(ldsm_b, tBsB[None, None, k], tBrB_view[None, None, k])
                    cute.gemm(tiled_mma, block_acc, tArA[None, None, k], tBrB[None, None, k], block_acc)

                # ---- promotion: acc += block_acc * scale_a[row] * scale_b[half] ----
                up_scale = scale_b[0, kb]
                gate_scale = scale_b[1, kb]
                for i in cutlass.range_constexpr(cute.size(acc)):
                    row = tCcC[i][0]
                    column = tCcC[i][1]
                    b_scale_i = up_scale if column < GEMM1_HALF_N else gate_scale
                    acc[i] = acc[i] + block_acc[i] * (scale_a[row, kb] * b_scale_i)
                # The next iteration overwrites the stage and the bf16 tiles read above.
                cute.arch.sync_threads()

            if cutlass.const_expr(self.gemm1):
                self.swiglu_epilogue(acc, thr_mma, c_tile_layout, storage, out, packed_row0, valid_rows, n_tile, tidx)
            else:
                out_tile = cute.make_tensor(
                    out.iterator + (packed_row0 * HIDDEN + n_tile * BLOCK_N),
                    cute.make_layout((BLOCK_M, BLOCK_N), stride=(HIDDEN, 1)),
                )
                tCgO = thr_mma.partition_C(out_tile)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    if tCcC[i][0] < valid_rows:
                        tCgO[i] = acc[i]

    @cute.jit
    def load_k_block(
        self,
        g2s_fp8: cute.CopyAtom,
        g2s_bf16: cute.CopyAtom,
        a: cute.Tensor,
        b: cute.Tensor,
        stage_a: cute.Tensor,
        stage_b: cute.Tensor,
        row_token: cute.Tensor,
        expert: cutlass.Int32,
        b_row0_up: cutlass.Int32,
        packed_row0: cutlass.Int32,
        valid_rows: cutlass.Int32,
        kb: cutlass.Int32,
        stage: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        """Issue the cp.async copies of K block `kb` of A (64 rows) and B (128 rows) into `stage`.
        A rows past the expert's tokens are zero-filled (they could hold another expert's rows,
        or NaN garbage that a zero scale would not cancel)."""
        fp8_segs = BLOCK_K // FP8_CHUNK  # 8 pieces of 16 B per fp8 row
        # ---- B: 128 weight rows of this expert ----
        for i in cutlass.range_constexpr(BLOCK_N * fp8_segs // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            row = linear // fp8_segs
            seg = linear % fp8_segs
            if cutlass.const_expr(self.gemm1):
                b_row = b_row0_up + row if row < GEMM1_HALF_N else INTERMEDIATE + b_row0_up + (row - GEMM1_HALF_N)
            else:
                b_row = b_row0_up + row
            cute.copy(
                g2s_fp8,
                cute.local_tile(b[expert, b_row, None], (FP8_CHUNK,), (kb * fp8_segs + seg,)),
                cute.local_tile(stage_b[row, None, stage], (FP8_CHUNK,), (seg,)),
            )
        # ---- A ----
        if cutlass.const_expr(self.gemm1):
            # fp8 rows of the tile's tokens (a gather from hidden_states).
            for i in cutlass.range_constexpr(BLOCK_M * fp8_segs // NUM_THREADS):
                linear = i * NUM_THREADS + tidx
                row = linear // fp8_segs
                seg = linear % fp8_segs
                dst = cute.local_tile(stage_a[row, None, stage], (FP8_CHUNK,), (seg,))
                if row < valid_rows:
                    source = cute.local_tile(a[row_token[row], None], (FP8_CHUNK,), (kb * fp8_segs + seg,))
                    cute.copy(g2s_fp8, source, dst)
                else:
                    dst.fill(0.0)
        else:
            # bf16 rows of the packed C workspace.
            bf16_segs = BLOCK_K // BF16_CHUNK  # 16 pieces of 16 B per bf16 row
            for i in cutlass.range_constexpr(BLOCK_M * bf16_segs // NUM_THREADS):
                linear = i * NUM_THREADS + tidx
                row = linear // bf16_segs
                seg = linear % bf16_segs
                dst = cute.local_tile(stage_a[row, None, stage], (BF16_CHUNK,), (seg,))
                if row < valid_rows:
                    cute.copy(
                        g2s_bf16,
                        cute.local_tile(a[packed_row0 + row, None], (BF16_CHUNK,), (kb * bf16_segs + seg,)),
                        dst,
                    )
                else:
                    dst.fill(0.0)

    @cute.jit
    def convert_rows(self, src: cute.Tensor, dst: cute.Tensor, num_rows: cutlass.Constexpr, tidx: cutlass.Int32):
        """dst[r, :] = bf16(src[r, :]) for a [num_rows, 128] e4m3 tile, 16 elements per step."""
        segs = BLOCK_K // FP8_CHUNK
        for i in cutlass.range_constexpr(num_rows * segs // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            row = linear // segs
            seg = linear % segs
            fragment = cute.make_rmem_tensor((FP8_CHUNK,), cutlass.Float8E4M3FN)
            cute.autovec_copy(cute.local_tile(src[row, None], (FP8_CHUNK,), (seg,)), fragment)
            cute.local_tile(dst[row, None], (FP8_CHUNK,), (seg,)).store(fragment.load().to(cutlass.BFloat16))

    @cute.jit
    def swiglu_epilogue(
        self,
        acc: cute.Tensor,
        thr_mma: cute.ThrMma,
        c_tile_layout: cute.Layout,
        storage,
        out: cute.Tensor,
        packed_row0: cutlass.Int32,
        valid_rows: cutlass.Int32,
        n_tile: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        """C[row, n0 + j] = silu(G1[row, 64 + j]) * G1[row, j] in bf16, for the tile's valid rows."""
        tile_c = storage.tile_c.get_tensor(c_tile_layout)
        cute.autovec_copy(acc, thr_mma.partition_C(tile_c))
        cute.arch.sync_threads()
        chunks_per_row = GEMM1_HALF_N // BF16_CHUNK  # 8
        for i in cutlass.range_constexpr(BLOCK_M * chunks_per_row // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            row = linear // chunks_per_row
            chunk = linear % chunks_per_row
            if row < valid_rows:
                values = cute.make_rmem_tensor((BF16_CHUNK,), cutlass.BFloat16)
                for j in cutlass.range_constexpr(BF16_CHUNK):
                    column = chunk * BF16_CHUNK + j
                    up = tile_c[row, column]
                    gate = tile_c[row, GEMM1_HALF_N + column]
                    values[j] = swiglu_bf16(gate, up)
                destination = cute.make_tensor(
                    out.iterator + ((packed_row0 + row) * INTERMEDIATE + n_tile * GEMM1_HALF_N + chunk * BF16_CHUNK),
                    cute.make_layout((BF16_CHUNK,)),
                )
                cute.autovec_copy(values, destination)


