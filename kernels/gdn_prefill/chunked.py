"""GDN prefill for SM90 in CuTe-DSL, chunked on tensor cores: the chunk step whose methods the WY-prepass path's
kernels and the warp chain reuse (kernel.py takes this kernel alone for no batch; its `run` serves the device check).

The math is `chunked_model.py` (chunks of C = 64 tokens; A, P, T = (I + A)^-1, Xb, V', O, S as
written there), with the same rounding points: every tensor-core operand is fp16 (`mma.sync`
m16n8k16, fp32 accumulation), the state, the gates and every element-wise step are fp32.

Work split. One CTA = one (sequence, v-head, 32-row V-slice): grid (8 heads x 4 slices, N), row y
serving the sequence of rank y in decreasing length when the grid has more CTAs than the GPU has SMs
(`sequence_of_block`, the LPT rule: the CTAs started last share an SM or wait for a second wave). The V
rows of a state evolve independently, so slicing V is exact; the K-side work of a chunk (the
Gram products K K^T and Q K^T and the inverse T) is recomputed by each of the 4 slice CTAs. 128
threads = 4 warps; every product is split into per-warp tiles and computed by one warp with a
single-warp tiled MMA fed by `ldmatrix` (`warp_gemm`). The state slice [32, 128] lives in the
accumulators of the state-update product (warp w owns columns [32w, 32w + 32)), in fp32, for the
whole sequence; each chunk rounds a copy to fp16 in shared memory as the operand of K S0^T, Q S0^T.
The WY-prepass chain also runs these methods on 16-row slices (NARROW_SLICE_ROWS, 8 slice CTAs).

Per chunk (barriers between the phases):
  P0  wait for the chunk's cp.async loads; q/k rows bf16 -> fp16 (tokens past the end zeroed);
      gates of the 64 tokens by warp 0 (log g, beta, inclusive scan G); the fp16 state copy.
  P1  prefetch the next chunk's k, v-slice, a, b with cp.async;
      Gram tiles (16x16, lower triangle only, 5 tiles per warp) -> A (fp16, and fp32 diagonal
      blocks) and P (fp16); Yk = K S0^T -> Xb^T (fp16); Yq = Q S0^T -> the output accumulator.
  P2  prefetch the next chunk's q rows into kq; the four 16x16 diagonal blocks of T by forward
      substitution in fp32 (one thread per column).
  P3  T10 = -(T11 A10) T00 and T32 = -(T33 A32) T22 (warps 0, 1).
  P4  T[32:, :32] = -(T_B A_BA) T_A (4 warps, one 16x16 output tile each).
  P5  V' = T Xb -> V'^T and (V' exp(G_last - G_i))^T in fp16.
  P6  O += P V', scaled and stored (bf16); S = exp(G_last) S + V'c^T K.
Tokens past the end of the sequence have k = q = 0 (zeroed in P0), log g = 0 and beta = 0, so they
add nothing (T is the identity on them, G_last is the last real token's G); their outputs are not
stored. A sequence of length 0 runs no chunk and stores a zero state.

Decays (the chunk step is latency-bound, NOTES.md): G is kept in base 2, so that each of the ~90
decay factors a lane evaluates per chunk is one `ex2.approx`, and the masked epilogues of P1 are
branch-free (all of a tile's loads in flight, then its stores), which shortens the dependent chains.
The gates' own exponentials (softplus, sigmoid, exp(A_log)) stay accurate.

Shared memory (~107 KB, so that two CTAs fit on an SM: at one CTA per SM the step is latency-bound
with one warp per scheduler, NOTES.md): the q rows of the next
chunk are copied (bf16) straight into the q half of the fp16 operand buffer kq, which is dead after
P1, and converted there in place at the next P0; only k has a staging buffer. V'^T and V'c^T live
in A's storage (A is dead after P4), the inverse's per-warp scratch in the fp16 state copy's (dead
after P1). The carveout is set to the maximum.

Everything is compiled once (dynamic T and N) into one TVM-FFI function on the current torch
stream; `run` validates shapes (host metadata only) and launches it. No host sync, CUDA-graph safe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Callable

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from . import token_serial
from .token_serial import (
    GPU_ARCH,
    HEAD_SIZE,
    NUM_V_HEADS,
    SOFTPLUS_THRESHOLD,
    V_HEADS_PER_QK_HEAD,
    GdnShapeError,
    resolve_scale,
)

__all__ = [
    "GdnShapeError",
    "MAX_RANKED_SEQS",
    "NARROW_SLICE_ROWS",
    "compile_only",
    "compiled_for",
    "longest_first_order",
    "min_ranked_seqs",
    "resolve_scale",
    "run",
    "run_kernel",
]

CHUNK = 64  # tokens per chunk
BLOCK = 16  # MMA tile edge; diagonal blocks of T
NUM_BLOCKS = CHUNK // BLOCK  # 4
NUM_THREADS = 128
WARP_SIZE = 32
NUM_WARPS = NUM_THREADS // WARP_SIZE  # 4
SLICE_ROWS = 32  # V rows of the state per CTA
NUM_SLICES = HEAD_SIZE // SLICE_ROWS  # 4 CTAs per (sequence, head)
STATE_COLS_PER_WARP = HEAD_SIZE // NUM_WARPS  # 32
KQ_ROWS = 2 * CHUNK  # k rows 0..63, q rows 64..127 in one buffer
COPY_ELEMS = 8  # 16-bit elements per 16-B cp.async / vector access
PIECES_PER_ROW = HEAD_SIZE // COPY_ELEMS  # 16
# fp16 rows read by ldmatrix are padded by 16 B, so that the 8 row addresses of one 8x8 matrix fall
# on distinct bank groups (272 B and 144 B rows are odd multiples of 16 B).
WIDE_STRIDE = HEAD_SIZE + 8  # 136: rows of 128 fp16
NARROW_STRIDE = CHUNK + 8  # 72: rows of 64 fp16
DIAG_STRIDE = BLOCK + 1  # fp32 diagonal blocks of A
SCRATCH_COLS = 2 * BLOCK  # per-warp intermediate of the inverse, [16, 32] fp16
SCRATCH_STRIDE = SCRATCH_COLS + 8
NUM_STAGES = 2  # v, a, b double-buffered; k staged once and converted at the chunk start
LOG2_E = math.log2(math.e)  # G is kept in base 2, so that a decay factor is one ex2
MAX_SMEM_CARVEOUT = 100  # percent of the unified L1/shared storage given to shared memory

# (shape, stride) of the fp16 shared-memory views the MMAs read through ldmatrix (the tests emulate
# ldmatrix on exactly these). A "_T" view is the transposed reading of the same buffer (ldmatrix.trans).
KQ_VIEW = ((KQ_ROWS, HEAD_SIZE), (WIDE_STRIDE, 1))  # k rows 0..63, q rows 64..127
KQ_T_VIEW = ((HEAD_SIZE, KQ_ROWS), (1, WIDE_STRIDE))
SQUARE_VIEW = ((CHUNK, CHUNK), (NARROW_STRIDE, 1))  # A, T, P
SQUARE_T_VIEW = ((CHUNK, CHUNK), (1, NARROW_STRIDE))
STATE16_VIEW = ((SLICE_ROWS, HEAD_SIZE), (WIDE_STRIDE, 1))  # fp16 copy of the state slice
SLICE_BY_TOKEN_VIEW = ((SLICE_ROWS, CHUNK), (NARROW_STRIDE, 1))  # Xb^T, V'^T, V'c^T
SCRATCH_VIEW = ((NUM_WARPS, BLOCK, SCRATCH_COLS), (BLOCK * SCRATCH_STRIDE, SCRATCH_STRIDE, 1))

# The CTA's threads cover its copies and element loops exactly.
assert NUM_SLICES * SLICE_ROWS == HEAD_SIZE and NUM_WARPS * STATE_COLS_PER_WARP == HEAD_SIZE
assert KQ_ROWS * PIECES_PER_ROW % NUM_THREADS == 0
assert CHUNK * (SLICE_ROWS // COPY_ELEMS) % NUM_THREADS == 0
assert 2 * CHUNK == NUM_THREADS  # one a or b row per thread
assert 2 * WARP_SIZE == CHUNK  # the gate scan: two tokens per lane of warp 0
assert NUM_WARPS * BLOCK == CHUNK  # one 16-row block of every [64, x] product per warp
# The aliases: V'^T and V'c^T fill A's storage exactly; the scratch fits in the state copy's.
assert 2 * SLICE_ROWS * NARROW_STRIDE == CHUNK * NARROW_STRIDE
assert NUM_WARPS * BLOCK * SCRATCH_STRIDE <= SLICE_ROWS * WIDE_STRIDE


# Longest first: a CTA's time is its sequence's chunk count times the chunk step, and the hardware
# starts CTAs in the order of their block index. When the grid has more CTAs than the GPU has SMs, the
# order decides the call's time: past one wave a long sequence late in the list would run its chain
# alone at the end, and within one wave of two CTAs per SM the CTAs started last nearly all share an
# SM (WY chain, 16-row slices, 450 / 380 / 966 tokens on the H200: 60-62 of the longest sequence's 64
# CTAs when it comes last, 65 us, its calls 58-68; 25-33 when it comes first, 57.3 us, 56.8-58.6).
# Serving the sequences in order of decreasing length (the LPT rule) puts the long chains first. Each
# CTA ranks the lengths itself, one thread per sequence (O(N) per thread, hence the upper bound).
MAX_RANKED_SEQS = NUM_THREADS  # one sequence per thread
NUM_SMS = 132  # H200
# CTAs of this folder's chunked kernels resident at once: two per SM.
CTAS_PER_WAVE = 2 * NUM_SMS
# The ranking's scratch: the lengths, then the selected sequence, in the fp32 diagonal blocks of A.
assert MAX_RANKED_SEQS + 1 <= CHUNK * BLOCK

# V rows per CTA of the WY-prepass chain's narrow width: 16, eight CTAs per (sequence, head).
NARROW_SLICE_ROWS = 16


def min_ranked_seqs(ctas_per_sequence: int) -> int:
    """Fewest sequences for which a grid of `ctas_per_sequence` CTAs a sequence has more CTAs than the GPU
    has SMs: from there the kernels serve the sequences longest first."""
    return NUM_SMS // ctas_per_sequence + 1


def longest_first_order(lengths: Sequence[int], ctas_per_sequence: int) -> list[int]:
    """The sequence each grid row serves, by the kernel's ranking rule (ties by index, so the rows
    are a permutation whatever `cu_seqlens` holds); for tests and models."""
    if not min_ranked_seqs(ctas_per_sequence) <= len(lengths) <= MAX_RANKED_SEQS:
        return list(range(len(lengths)))
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


@cute.jit
def sequence_bounds(cu_seqlens: cute.Tensor, seq: cutlass.Int32, total_tokens: cutlass.Int32):
    """(start, length) of sequence `seq`, its bounds clamped to [0, T] with end >= start, so that
    malformed `cu_seqlens` cannot send a kernel out of the tokens."""
    start = cutlass.Int32(cu_seqlens[seq])
    end = cutlass.Int32(cu_seqlens[seq + 1])
    start = cutlass.min(cutlass.max(start, cutlass.Int32(0)), total_tokens)
    end = cutlass.min(cutlass.max(end, start), total_tokens)
    return start, end - start


def _make_warp_mma() -> cute.TiledMma:
    # One warp; the 16x16x16 tile holds two n8 atoms, matching a 4-matrix ldmatrix of B.
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(cutlass.Float16, cutlass.Float32, (16, 8, 16)),
        (1, 1, 1),
        permutation_mnk=(BLOCK, BLOCK, BLOCK),
    )


def _make_operand_copies(tiled_mma: cute.TiledMma) -> tuple[cute.TiledCopy, cute.TiledCopy, cute.TiledCopy]:
    """ldmatrix copies of a K-major A, a K-major B and an N-major B (transposed) operand."""
    ldsm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
    ldsm_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
    copy_a = cute.make_tiled_copy_A(cute.make_copy_atom(ldsm, cutlass.Float16), tiled_mma)
    copy_b = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm, cutlass.Float16), tiled_mma)
    copy_bt = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm_t, cutlass.Float16), tiled_mma)
    return copy_a, copy_b, copy_bt


def _layout(view: tuple[tuple[int, ...], tuple[int, ...]]) -> cute.Layout:
    shape, stride = view
    return cute.make_layout(shape, stride=stride)


class _Chunked:
    """The kernel: one CTA = one (sequence, v-head, 32-row V-slice); see the module docstring."""

    # V rows of the state per CTA: SLICE_ROWS here; NARROW_SLICE_ROWS in the WY-prepass chain's narrow width.
    slice_rows: int = SLICE_ROWS

    @property
    def num_slices(self) -> int:
        return HEAD_SIZE // self.slice_rows

    @property
    def ctas_per_sequence(self) -> int:
        """CTAs of the grid serving one sequence (a row of the grid)."""
        return NUM_V_HEADS * self.num_slices

    def state16_layout(self) -> cute.Layout:
        """The fp16 copy of the state slice, [slice_rows, 128] in padded rows (STATE16_VIEW at 32 rows)."""
        return cute.make_layout((self.slice_rows, HEAD_SIZE), stride=(WIDE_STRIDE, 1))

    def slice_by_token_layout(self) -> cute.Layout:
        """Xb^T, V'^T and V'c^T: [slice_rows, 64] (SLICE_BY_TOKEN_VIEW at 32 rows)."""
        return cute.make_layout((self.slice_rows, CHUNK), stride=(NARROW_STRIDE, 1))

    def raw_v_layout(self) -> cute.Layout:
        """The bf16 v rows of the slice as copied in, [NUM_STAGES, 64, slice_rows]."""
        rows = self.slice_rows
        return cute.make_layout((NUM_STAGES, CHUNK, rows), stride=(CHUNK * rows, rows, 1))

    @cute.jit
    def slice_coordinates(self):
        """(tidx, block_y, head, slice_idx, v0, warp_idx, lane) of this CTA of a (8 heads x num_slices, N) grid:
        its thread, grid row, v-head, V slice and the slice's first V row, and the thread's warp and lane."""
        tidx, _, _ = cute.arch.thread_idx()
        head_slice, block_y, _ = cute.arch.block_idx()
        head = head_slice // self.num_slices
        slice_idx = head_slice % self.num_slices
        v0 = slice_idx * self.slice_rows
        return tidx, block_y, head, slice_idx, v0, tidx // WARP_SIZE, tidx % WARP_SIZE

    @cute.jit
    def decay(self, log2_decay: cutlass.Float32) -> cutlass.Float32:
        """The decay factor exp(G_i - G_j) from a difference of base-2 cumulative log decays: one
        `ex2.approx.ftz` (relative error < 2^-22, against the 2^-11 of the fp16 operands it feeds;
        factors below 2^-126 flush to zero, where the exact ones are as negligible), where the
        accurate `exp` is a range reduction of 7-8 dependent instructions around it."""
        return cute.math.exp2(log2_decay, approx=True, ftz=True)

    @cute.jit
    def gram_tiles(
        self,
        tiled_mma: cute.TiledMma,
        copy_a: cute.TiledCopy,
        copy_b: cute.TiledCopy,
        lane: cutlass.Int32,
        warp_idx: cutlass.Int32,
        kq: cute.Tensor,
        acc_sq: cute.Tensor,
        coords_sq: cute.Tensor,
        cum_log_g: cute.Tensor,
        beta: cute.Tensor,
        a16: cute.Tensor,
        a_diag: cute.Tensor,
        p16: cute.Tensor,
        a32: cute.Tensor | None = None,
        slow=None,
    ):
        """P1's Gram tiles of warp w: A rows of k block w (columns 0..w) and P rows of q block 3 - w
        (columns 0..3-w), five 16x16 tiles per warp, the lower triangle of both [64, 64] products. `a32`,
        `slow`: `a_tile_epilogue`'s."""
        self.a_tiles(
            tiled_mma, copy_a, copy_b, lane, warp_idx, kq, acc_sq, coords_sq, cum_log_g, beta, a16, a_diag, a32, slow
        )
        self.p_tiles(tiled_mma, copy_a, copy_b, lane, NUM_BLOCKS - 1 - warp_idx, kq, acc_sq, coords_sq, cum_log_g, p16)

    @cute.jit
    def a_tiles(
        self,
        tiled_mma: cute.TiledMma,
        copy_a: cute.TiledCopy,
        copy_b: cute.TiledCopy,
        lane: cutlass.Int32,
        k_block: cutlass.Int32,
        kq: cute.Tensor,
        acc_sq: cute.Tensor,
        coords_sq: cute.Tensor,
        cum_log_g: cute.Tensor,
        beta: cute.Tensor,
        a16: cute.Tensor,
        a_diag: cute.Tensor,
        a32: cute.Tensor | None = None,
        slow=None,
    ):
        """The A tiles of row block `k_block` (columns 0..k_block) of the [64, 64] lower triangle."""
        for col_block in cutlass.range(k_block + 1, unroll=1):
            acc_sq.fill(0.0)
            self.warp_gemm(
                tiled_mma, copy_a, copy_b, lane,
                cute.local_tile(kq, (BLOCK, HEAD_SIZE), (k_block, 0)),
                cute.local_tile(kq, (BLOCK, HEAD_SIZE), (col_block, 0)),
                acc_sq,
            )  # fmt: skip
            self.a_tile_epilogue(acc_sq, coords_sq, k_block, col_block, cum_log_g, beta, a16, a_diag, a32, slow)

    @cute.jit
    def p_tiles(
        self,
        tiled_mma: cute.TiledMma,
        copy_a: cute.TiledCopy,
        copy_b: cute.TiledCopy,
        lane: cutlass.Int32,
        q_block: cutlass.Int32,
        kq: cute.Tensor,
        acc_sq: cute.Tensor,
        coords_sq: cute.Tensor,
        cum_log_g: cute.Tensor,
        p16: cute.Tensor,
    ):
        """The P tiles of row block `q_block` (columns 0..q_block) of the [64, 64] lower triangle;
        the q rows are kq's rows 64.., the k rows its rows 0..63."""
        for col_block in cutlass.range(q_block + 1, unroll=1):
            acc_sq.fill(0.0)
            self.warp_gemm(
                tiled_mma, copy_a, copy_b, lane,
                cute.local_tile(kq, (BLOCK, HEAD_SIZE), (NUM_BLOCKS + q_block, 0)),
                cute.local_tile(kq, (BLOCK, HEAD_SIZE), (col_block, 0)),
                acc_sq,
            )  # fmt: skip
            self.p_tile_epilogue(acc_sq, coords_sq, q_block, col_block, cum_log_g, p16)

    # The three masked epilogues of P1: every entry of a tile first, with its operands loaded
    # unconditionally (the indices are in bounds) and the mask as a select, then the stores, so that the
    # loads of a tile overlap (behind a branch per entry, with its store before the next entry's loads,
    # they ran one after the other).
    @cute.jit
    def a_tile_epilogue(
        self,
        acc: cute.Tensor,
        coords: cute.Tensor,
        row_block: cutlass.Int32,
        col_block: cutlass.Int32,
        cum_log_g: cute.Tensor,
        beta: cute.Tensor,
        a16: cute.Tensor,
        a_diag: cute.Tensor,
        a32: cute.Tensor | None = None,
        slow=None,
    ):
        """A[i, j] = beta_i exp(G_i - G_j) (k_i . k_j) strictly below the diagonal, else 0, for the
        16x16 tile (row_block, col_block): into a16, and into a_diag on a diagonal tile. The exponent
        is clamped at 0: above the diagonal it would overflow, below it G_i - G_j <= 0 already. With `a32`
        (the key side's, `accurate_inverse.py`) and `slow` set at run time, an off-diagonal tile goes to a32
        in fp32 instead and a16 is not written (a32 lies in its storage)."""
        values = cute.make_rmem_tensor(acc.layout, cutlass.Float32)
        for e in cutlass.range_constexpr(cute.size(acc)):
            i = row_block * BLOCK + coords[e][0]
            j = col_block * BLOCK + coords[e][1]
            below = beta[i] * self.decay(cutlass.min(cum_log_g[i] - cum_log_g[j], cutlass.Float32(0.0))) * acc[e]
            values[e] = cutlass.Float32(cutlass.select_(j < i, below, cutlass.Float32(0.0)))
        if cutlass.const_expr(a32 is None):
            self.store_a16_tile(values, coords, row_block, col_block, a16)
        elif slow:
            if col_block != row_block:
                block = row_block * (row_block - 1) // 2 + col_block  # the packed strictly-lower blocks
                for e in cutlass.range_constexpr(cute.size(acc)):
                    a32[block, coords[e][0], coords[e][1]] = values[e]
        else:
            self.store_a16_tile(values, coords, row_block, col_block, a16)
        if col_block == row_block:
            for e in cutlass.range_constexpr(cute.size(acc)):
                a_diag[row_block * BLOCK + coords[e][0], coords[e][1]] = values[e]

    @cute.jit
    def store_a16_tile(self, values: cute.Tensor, coords: cute.Tensor, row_block, col_block, a16: cute.Tensor):
        for e in cutlass.range_constexpr(cute.size(values)):
            a16[row_block * BLOCK + coords[e][0], col_block * BLOCK + coords[e][1]] = values[e].to(cutlass.Float16)

    @cute.jit
    def p_tile_epilogue(
        self,
        acc: cute.Tensor,
        coords: cute.Tensor,
        row_block: cutlass.Int32,
        col_block: cutlass.Int32,
        cum_log_g: cute.Tensor,
        p16: cute.Tensor,
    ):
        """P[i, j] = exp(G_i - G_j) (q_i . k_j) on and below the diagonal, else 0, for the tile."""
        values = cute.make_rmem_tensor(acc.layout, cutlass.Float32)
        for e in cutlass.range_constexpr(cute.size(acc)):
            i = row_block * BLOCK + coords[e][0]
            j = col_block * BLOCK + coords[e][1]
            below = self.decay(cutlass.min(cum_log_g[i] - cum_log_g[j], cutlass.Float32(0.0))) * acc[e]
            values[e] = cutlass.Float32(cutlass.select_(j <= i, below, cutlass.Float32(0.0)))
        for e in cutlass.range_constexpr(cute.size(acc)):
            p16[row_block * BLOCK + coords[e][0], col_block * BLOCK + coords[e][1]] = values[e].to(cutlass.Float16)

    @cute.jit
    def xb_epilogue(
        self,
        acc: cute.Tensor,
        coords: cute.Tensor,
        row0: cutlass.Int32,
        cum_log_g: cute.Tensor,
        beta: cute.Tensor,
        raw_v: cute.Tensor,
        stage: cutlass.Int32,
        tokens_here: cutlass.Int32,
        xb_t: cute.Tensor,
    ):
        """Xb^T[col, i] = beta_i (v_i - exp(G_i) k_i S0^T) for the warp's 16 token rows; 0 past the
        end, where raw_v may hold any bits, NaN included: the select drops them."""
        values = cute.make_rmem_tensor(acc.layout, cutlass.Float32)
        for e in cutlass.range_constexpr(cute.size(acc)):
            i = row0 + coords[e][0]
            real = beta[i] * (raw_v[stage, i, coords[e][1]].to(cutlass.Float32) - self.decay(cum_log_g[i]) * acc[e])
            values[e] = cutlass.Float32(cutlass.select_(i < tokens_here, real, cutlass.Float32(0.0)))
        for e in cutlass.range_constexpr(cute.size(acc)):
            xb_t[coords[e][1], row0 + coords[e][0]] = values[e].to(cutlass.Float16)


    @cute.jit
    def sequence_of_block(
        self,
        cu_seqlens: cute.Tensor,
        block_y: cutlass.Int32,
        num_seqs: cutlass.Int32,
        tidx: cutlass.Int32,
        scratch: cute.Tensor,
        recorded_ranks: tuple[int, ...] = (),
    ) -> cutlass.Int32:
        """The sequence this CTA's grid row serves: the one of rank `block_y` in decreasing length
        (`longest_first_order`) when the grid has more CTAs than SMs (up to MAX_RANKED_SEQS sequences),
        sequence `block_y` otherwise. `scratch` is shared memory free until the first chunk's P1: the
        lengths, then the selected sequence, then the lengths of `recorded_ranks` (`ranking_slots`)."""
        seq = block_y
        if num_seqs >= min_ranked_seqs(self.ctas_per_sequence) and num_seqs <= MAX_RANKED_SEQS:
            slots = self.ranking_slots(scratch, len(recorded_ranks))
            selected = MAX_RANKED_SEQS  # the slot after the lengths
            my_length = cutlass.Int32(0)
            if tidx < num_seqs:
                my_length = cutlass.Int32(cu_seqlens[tidx + 1]) - cutlass.Int32(cu_seqlens[tidx])
                slots[tidx] = my_length
            if tidx == 0:
                slots[selected] = block_y  # stays the identity if no rank matched (cannot happen)
            cute.arch.sync_threads()
            if tidx < num_seqs:
                rank = cutlass.Int32(0)
                for j in cutlass.range(num_seqs, unroll=4):
                    other = slots[j]
                    if other > my_length or (other == my_length and j < tidx):
                        rank += 1
                if rank == block_y:
                    slots[selected] = tidx
                for i in cutlass.range_constexpr(len(recorded_ranks)):
                    if rank == recorded_ranks[i]:
                        slots[selected + 1 + i] = my_length
            cute.arch.sync_threads()
            seq = slots[selected]
        return seq

    def ranking_slots(self, scratch: cute.Tensor, num_recorded: int = 0) -> cute.Tensor:
        """`sequence_of_block`'s Int32 view of its scratch: MAX_RANKED_SEQS lengths, the selected sequence, then
        `num_recorded` lengths by rank."""
        return cute.make_tensor(
            cute.recast_ptr(scratch.iterator, dtype=cutlass.Int32), cute.make_layout(MAX_RANKED_SEQS + 1 + num_recorded)
        )

    def staging_views(self, st, k_staged_in_kq: bool = False) -> tuple[cute.Tensor, ...]:
        """(raw_k, raw_a, raw_b, kq, kq_raw) over the like-named fields of a kernel's shared storage: the bf16
        k rows and a, b rows as copied in, the fp16 k and q operand rows (kq), and kq read as bf16 (kq_raw: the
        q rows are copied there and converted in place). With `k_staged_in_kq` the k rows are too (raw_k is
        kq_raw, whose rows 0..63 are k's), and the storage needs no raw_k field: for a kernel that loads k only
        once, with nothing to overlap. Built while a kernel is traced."""
        ab_layout = cute.make_layout((NUM_STAGES, CHUNK, NUM_V_HEADS), stride=(CHUNK * NUM_V_HEADS, NUM_V_HEADS, 1))
        raw_a = st.raw_a.get_tensor(ab_layout)
        raw_b = st.raw_b.get_tensor(ab_layout)
        kq = st.kq.get_tensor(_layout(KQ_VIEW))
        kq_raw = cute.make_tensor(cute.recast_ptr(kq.iterator, dtype=cutlass.BFloat16), _layout(KQ_VIEW))
        if k_staged_in_kq:
            raw_k = kq_raw
        else:
            raw_k = st.raw_k.get_tensor(cute.make_layout((CHUNK, HEAD_SIZE), stride=(HEAD_SIZE, 1)))
        return raw_k, raw_a, raw_b, kq, kq_raw

    @cute.jit
    def launch(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        state: cute.Tensor,
        A_log: cute.Tensor,
        a: cute.Tensor,
        dt_bias: cute.Tensor,
        b: cute.Tensor,
        cu_seqlens: cute.Tensor,
        scale: cutlass.Float32,
        has_state: cutlass.Int32,
        output: cute.Tensor,
        new_state: cute.Tensor,
        stream,
    ):
        tiled_mma = _make_warp_mma()
        f16, bf16, f32 = cutlass.Float16, cutlass.BFloat16, cutlass.Float32
        rows = self.slice_rows
        s16_elems = max(rows * WIDE_STRIDE, NUM_WARPS * BLOCK * SCRATCH_STRIDE)

        @cute.struct
        class SharedStorage:
            raw_k: cute.struct.Align[cute.struct.MemRange[bf16, CHUNK * HEAD_SIZE], 128]
            raw_v: cute.struct.Align[cute.struct.MemRange[bf16, NUM_STAGES * CHUNK * rows], 128]
            raw_a: cute.struct.Align[cute.struct.MemRange[bf16, NUM_STAGES * CHUNK * NUM_V_HEADS], 128]
            raw_b: cute.struct.Align[cute.struct.MemRange[bf16, NUM_STAGES * CHUNK * NUM_V_HEADS], 128]
            kq: cute.struct.Align[cute.struct.MemRange[f16, KQ_ROWS * WIDE_STRIDE], 128]
            # A (P1-P4), then V'^T and V'c^T (P5-P6) in the same storage.
            a16: cute.struct.Align[cute.struct.MemRange[f16, CHUNK * NARROW_STRIDE], 128]
            a_diag: cute.struct.Align[cute.struct.MemRange[f32, CHUNK * DIAG_STRIDE], 128]
            t16: cute.struct.Align[cute.struct.MemRange[f16, CHUNK * NARROW_STRIDE], 128]
            p16: cute.struct.Align[cute.struct.MemRange[f16, CHUNK * NARROW_STRIDE], 128]
            # The fp16 state copy (P0-P1), then the inverse's per-warp scratch (P3-P4).
            s16: cute.struct.Align[cute.struct.MemRange[f16, s16_elems], 128]
            xb_t: cute.struct.Align[cute.struct.MemRange[f16, rows * NARROW_STRIDE], 128]
            cum_log_g: cute.struct.Align[cute.struct.MemRange[f32, CHUNK], 16]
            beta: cute.struct.Align[cute.struct.MemRange[f32, CHUNK], 16]

        kernel = self.kernel(
            q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state,
            tiled_mma, SharedStorage,
        )  # fmt: skip
        self.launch_grid(kernel, [NUM_V_HEADS * self.num_slices, new_state.shape[0], 1], SharedStorage, stream)

    @staticmethod
    def launch_grid(kernel, grid: list, SharedStorage, stream, threads: int = NUM_THREADS, min_blocks: int = 0) -> None:
        """Launch a traced kernel of this folder's chunked family (this one, the WY-prepass pair, the WGMMA
        chain): `threads` threads (NUM_THREADS but for the WGMMA chain's two warpgroups), `SharedStorage` as its
        dynamic shared memory, the largest carveout (two or three CTAs per SM, or one of ~148 KB, need it).
        `min_blocks` CTAs an SM (0: unsaid) fixes the registers a thread at entry, which `setmaxnreg` needs."""
        kernel.launch(
            grid=grid,
            block=[threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            preferred_smem_carveout=MAX_SMEM_CARVEOUT,
            min_blocks_per_mp=min_blocks,
        )

    @cute.kernel
    def kernel(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        state: cute.Tensor,
        A_log: cute.Tensor,
        a: cute.Tensor,
        dt_bias: cute.Tensor,
        b: cute.Tensor,
        cu_seqlens: cute.Tensor,
        scale: cutlass.Float32,
        has_state: cutlass.Int32,
        output: cute.Tensor,
        new_state: cute.Tensor,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, block_y, head, slice_idx, v0, warp_idx, lane = self.slice_coordinates()
        rows = self.slice_rows

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(SharedStorage)
        a_diag = st.a_diag.get_tensor(cute.make_layout((CHUNK, BLOCK), stride=(DIAG_STRIDE, 1)))
        # a_diag is first written in chunk 0's P1, so the hook may use it as scratch.
        seq = self.sequence_of_block(cu_seqlens, block_y, new_state.shape[0], tidx, a_diag)

        # Sequence bounds, clamped to [0, T] so that malformed cu_seqlens cannot read out of bounds.
        total_tokens = cutlass.Int32(q.shape[0])
        start, length = sequence_bounds(cu_seqlens, seq, total_tokens)
        num_chunks = (length + CHUNK - 1) // CHUNK

        # ---- shared memory views ----
        raw_k, raw_a, raw_b, kq, kq_raw = self.staging_views(st)
        raw_v = st.raw_v.get_tensor(self.raw_v_layout())
        # kq_t[d, r] = kq[r, d]: the B operand of S += V'c^T K (ldmatrix.trans).
        kq_t = cute.make_tensor(kq.iterator, _layout(KQ_T_VIEW))
        a16 = st.a16.get_tensor(_layout(SQUARE_VIEW))
        a16_t = cute.make_tensor(a16.iterator, _layout(SQUARE_T_VIEW))
        t16 = st.t16.get_tensor(_layout(SQUARE_VIEW))
        t16_t = cute.make_tensor(t16.iterator, _layout(SQUARE_T_VIEW))
        p16 = st.p16.get_tensor(_layout(SQUARE_VIEW))
        s16 = st.s16.get_tensor(self.state16_layout())
        xb_t = st.xb_t.get_tensor(self.slice_by_token_layout())
        vn_t = cute.make_tensor(a16.iterator, self.slice_by_token_layout())
        vnc_t = cute.make_tensor(a16.iterator + rows * NARROW_STRIDE, self.slice_by_token_layout())
        scratch = cute.make_tensor(s16.iterator, _layout(SCRATCH_VIEW))[warp_idx, None, None]
        cum_log_g = st.cum_log_g.get_tensor(cute.make_layout(CHUNK))
        beta = st.beta.get_tensor(cute.make_layout(CHUNK))

        # ---- MMA and ldmatrix plumbing (one warp per tile) ----
        copy_a, copy_b, copy_bt = _make_operand_copies(tiled_mma)
        thr_mma = tiled_mma.get_slice(lane)
        coords_sq = thr_mma.partition_C(cute.make_identity_tensor((BLOCK, BLOCK)))
        coords_rows = thr_mma.partition_C(cute.make_identity_tensor((BLOCK, rows)))
        coords_state = thr_mma.partition_C(cute.make_identity_tensor((rows, STATE_COLS_PER_WARP)))

        # ---- the state slice: [rows, 128] fp32 in the accumulators, warp w holds columns 32w.. ----
        acc_state = self.load_state_slice(thr_mma, state, seq, head, slice_idx, warp_idx, has_state, length)

        # T and P are lower triangular; their upper 16x16 blocks are never written: zero them once.
        for i in cutlass.range_constexpr(CHUNK * CHUNK // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            t16[linear // CHUNK, linear % CHUNK] = cutlass.Float16(0.0)
            p16[linear // CHUNK, linear % CHUNK] = cutlass.Float16(0.0)

        g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.BFloat16, num_bits_per_copy=128
        )
        neg_decay_rate = -cute.math.exp(A_log[head]) * LOG2_E  # log g, hence G, in base 2
        bias = dt_bias[head]
        if num_chunks > 0:
            self.load_chunk(g2s, k, v, a, b, raw_k, raw_v, raw_a, raw_b, start, length, 0, 0, head, v0, tidx)
            self.load_q(g2s, q, kq_raw, start, length, 0, head, tidx)
        cute.arch.cp_async_commit_group()

        acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK, rows)), cutlass.Float32)
        acc_y = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK, rows)), cutlass.Float32)
        acc_sq = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK, BLOCK)), cutlass.Float32)
        # P4's [16, 32] products: acc_y itself at 32 rows (its registers are free then); its own at 16.
        acc_half, coords_half = acc_y, coords_rows
        if cutlass.const_expr(rows != CHUNK // 2):
            acc_half = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK, CHUNK // 2)), cutlass.Float32)
            coords_half = thr_mma.partition_C(cute.make_identity_tensor((BLOCK, CHUNK // 2)))

        for chunk in cutlass.range(num_chunks, unroll=1):
            stage = chunk % NUM_STAGES
            chunk_start = chunk * CHUNK
            tokens_here = cutlass.min(length - chunk_start, cutlass.Int32(CHUNK))

            # ---- P0: inputs in fp16, gates, the fp16 state copy ----
            self.enter_chunk(
                raw_k, kq_raw, kq, raw_a, raw_b, stage, head, neg_decay_rate, bias, tokens_here, cum_log_g, beta,
                acc_state, coords_state, s16, tidx, warp_idx, lane,
            )  # fmt: skip

            # ---- P1: prefetch the next chunk; Gram tiles; K S0^T and Q S0^T ----
            if chunk + 1 < num_chunks:
                self.load_chunk(
                    g2s, k, v, a, b, raw_k, raw_v, raw_a, raw_b, start, length,
                    chunk + 1, (chunk + 1) % NUM_STAGES, head, v0, tidx,
                )  # fmt: skip
            cute.arch.cp_async_commit_group()

            self.gram_tiles(
                tiled_mma, copy_a, copy_b, lane, warp_idx, kq, acc_sq, coords_sq, cum_log_g, beta, a16, a_diag, p16
            )

            self.state_products(
                tiled_mma, copy_a, copy_b, lane, warp_idx, kq, s16, acc_y, acc_o, coords_rows, cum_log_g, beta,
                raw_v, stage, tokens_here, xb_t,
            )  # fmt: skip
            cute.arch.sync_threads()

            # ---- P2: prefetch the next chunk's q rows (the q half of kq is dead after P1);
            # diagonal blocks of T = (I + A)^-1, one thread per column, fp32 ----
            if chunk + 1 < num_chunks:
                self.load_q(g2s, q, kq_raw, start, length, chunk + 1, head, tidx)
            cute.arch.cp_async_commit_group()
            self.invert_unit_lower(
                tiled_mma, copy_a, copy_bt, lane, warp_idx, tidx, a16_t, a_diag, t16, t16_t, scratch,
                acc_sq, acc_half, coords_sq, coords_half,
            )  # fmt: skip

            # ---- P5: V' = T Xb ----
            g_last = cum_log_g[CHUNK - 1]
            self.new_values(
                tiled_mma, copy_a, copy_b, lane, warp_idx, t16, xb_t, acc_y, coords_rows, cum_log_g, g_last, vn_t, vnc_t
            )
            cute.arch.sync_threads()

            # ---- P6: O = exp(G) Q S0^T + P V'; S = exp(G_last) S + V'c^T K ----
            self.output_and_carry(
                tiled_mma, copy_a, copy_b, copy_bt, lane, warp_idx, p16, vn_t, vnc_t, kq_t, acc_o, acc_state, coords_rows,
                g_last, tokens_here, output, start, chunk_start, head, v0, scale,
            )  # fmt: skip
            # The next chunk's P0 barrier orders these reads before kq's k rows, s16, A ... are
            # rewritten; kq's q rows are not read after P1.

        cute.autovec_copy(acc_state, thr_mma.partition_C(self.state_tile(new_state, seq, head, slice_idx, warp_idx)))

    @cute.jit
    def state_tile(
        self,
        state: cute.Tensor,
        seq: cutlass.Int32,
        head: cutlass.Int32,
        slice_idx: cutlass.Int32,
        warp_idx: cutlass.Int32,
    ) -> cute.Tensor:
        """The [slice_rows, 32] tile of a [N, 8, 128, 128] state that warp `warp_idx` of slice `slice_idx`
        holds in its accumulators (rows of the slice, columns 32 w..)."""
        return cute.local_tile(
            state[seq, head, None, None], (self.slice_rows, STATE_COLS_PER_WARP), (slice_idx, warp_idx)
        )

    @cute.jit
    def load_state_slice(
        self,
        thr_mma: cute.ThrMma,
        state: cute.Tensor,
        seq: cutlass.Int32,
        head: cutlass.Int32,
        slice_idx: cutlass.Int32,
        warp_idx: cutlass.Int32,
        has_state: cutlass.Int32,
        length: cutlass.Int32,
    ) -> cute.Tensor:
        """The state slice in fp32 accumulators: the initial state's tile, or zeros without one (and
        for an empty sequence, whose new state is zero whatever the initial one)."""
        acc_state = cute.make_rmem_tensor(
            thr_mma.partition_shape_C((self.slice_rows, STATE_COLS_PER_WARP)), cutlass.Float32
        )
        acc_state.fill(0.0)
        if has_state != 0 and length > 0:
            cute.autovec_copy(thr_mma.partition_C(self.state_tile(state, seq, head, slice_idx, warp_idx)), acc_state)
        return acc_state

    @cute.jit
    def enter_chunk(
        self,
        raw_k: cute.Tensor,
        kq_raw: cute.Tensor,
        kq: cute.Tensor,
        raw_a: cute.Tensor,
        raw_b: cute.Tensor,
        stage: cutlass.Int32,
        head: cutlass.Int32,
        neg_decay_rate: cutlass.Float32,
        bias: cutlass.Float32,
        tokens_here: cutlass.Int32,
        cum_log_g: cute.Tensor,
        beta: cute.Tensor,
        acc_state: cute.Tensor,
        coords_state: cute.Tensor,
        s16: cute.Tensor,
        tidx: cutlass.Int32,
        warp_idx: cutlass.Int32,
        lane: cutlass.Int32,
    ):
        """P0: wait for the chunk's cp.async loads; k and q rows to fp16 (tokens past the end
        zeroed); the gates (warp 0); the fp16 copy of the state slice. Barriers before and after."""
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        self.convert_kq(raw_k, kq_raw, kq, tokens_here, tidx)
        if warp_idx == 0:
            self.chunk_gates(raw_a, raw_b, stage, head, neg_decay_rate, bias, tokens_here, lane, cum_log_g, beta)
        for e in cutlass.range_constexpr(cute.size(acc_state)):
            s16[coords_state[e][0], warp_idx * STATE_COLS_PER_WARP + coords_state[e][1]] = acc_state[e].to(
                cutlass.Float16
            )
        cute.arch.sync_threads()

    @cute.jit
    def state_products(
        self,
        tiled_mma: cute.TiledMma,
        copy_a: cute.TiledCopy,
        copy_b: cute.TiledCopy,
        lane: cutlass.Int32,
        warp_idx: cutlass.Int32,
        kq: cute.Tensor,
        s16: cute.Tensor,
        acc_y: cute.Tensor,
        acc_o: cute.Tensor,
        coords_rows: cute.Tensor,
        cum_log_g: cute.Tensor,
        beta: cute.Tensor,
        raw_v: cute.Tensor,
        stage: cutlass.Int32,
        tokens_here: cutlass.Int32,
        xb_t: cute.Tensor,
    ):
        """P1's products with the state copy s16: Xb^T[v, i] = beta_i (v_i - exp(G_i) k_i S0^T) (zero past the
        end, where raw_v holds garbage), and the inter-chunk part of the output, exp(G_i) q_i S0^T, which stays
        in acc_o until P6. The warp's 16 token rows; no barrier."""
        row0 = warp_idx * BLOCK
        acc_y.fill(0.0)
        self.warp_gemm(
            tiled_mma, copy_a, copy_b, lane, cute.local_tile(kq, (BLOCK, HEAD_SIZE), (warp_idx, 0)), s16, acc_y
        )
        self.xb_epilogue(acc_y, coords_rows, row0, cum_log_g, beta, raw_v, stage, tokens_here, xb_t)
        acc_o.fill(0.0)
        self.warp_gemm(
            tiled_mma, copy_a, copy_b, lane,
            cute.local_tile(kq, (BLOCK, HEAD_SIZE), (NUM_BLOCKS + warp_idx, 0)), s16, acc_o,
        )  # fmt: skip
        for e in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[e] = self.decay(cum_log_g[row0 + coords_rows[e][0]]) * acc_o[e]

    @cute.jit
    def new_values(
        self,
        tiled_mma: cute.TiledMma,
        copy_a: cute.TiledCopy,
        copy_b: cute.TiledCopy,
        lane: cutlass.Int32,
        warp_idx: cutlass.Int32,
        t16: cute.Tensor,
        xb_t: cute.Tensor,
        acc_y: cute.Tensor,
        coords_rows: cute.Tensor,
        cum_log_g: cute.Tensor,
        g_last: cutlass.Float32,
        vn_t: cute.Tensor,
        vnc_t: cute.Tensor,
    ):
        """P5: V' = T Xb for the warp's 16 token rows (`new_value_rows`); no barrier."""
        self.new_value_rows(
            tiled_mma, copy_a, copy_b, lane, cute.local_tile(t16, (BLOCK, CHUNK), (warp_idx, 0)), xb_t,
            warp_idx * BLOCK, acc_y, coords_rows, cum_log_g, g_last, vn_t, vnc_t,
        )  # fmt: skip

    @cute.jit
    def new_value_rows(
        self,
        tiled_mma: cute.TiledMma,
        copy_a: cute.TiledCopy,
        copy_b: cute.TiledCopy,
        lane: cutlass.Int32,
        t_rows: cute.Tensor,
        xb: cute.Tensor,
        row0: cutlass.Int32,
        acc_y: cute.Tensor,
        coords_rows: cute.Tensor,
        cum_log_g: cute.Tensor,
        g_last: cutlass.Float32,
        vn_t: cute.Tensor,
        vnc_t: cute.Tensor,
    ):
        """V' = T Xb for the 16 token rows from `row0` (`t_rows`: their rows of T over the chunk's tokens; `xb`: Xb^T
        over the same tokens), stored transposed in fp16 as V'^T and, decayed to the chunk's end,
        (V' exp(G_last - G_i))^T."""
        acc_y.fill(0.0)
        self.warp_gemm(tiled_mma, copy_a, copy_b, lane, t_rows, xb, acc_y)
        for e in cutlass.range_constexpr(cute.size(acc_y)):
            i = row0 + coords_rows[e][0]
            col = coords_rows[e][1]
            vn_t[col, i] = acc_y[e].to(cutlass.Float16)
            vnc_t[col, i] = (acc_y[e] * self.decay(g_last - cum_log_g[i])).to(cutlass.Float16)

    @cute.jit
    def output_and_carry(
        self,
        tiled_mma: cute.TiledMma,
        copy_a: cute.TiledCopy,
        copy_b: cute.TiledCopy,
        copy_bt: cute.TiledCopy,
        lane: cutlass.Int32,
        warp_idx: cutlass.Int32,
        p16: cute.Tensor,
        vn_t: cute.Tensor,
        vnc_t: cute.Tensor,
        kq_t: cute.Tensor,
        acc_o: cute.Tensor,
        acc_state: cute.Tensor,
        coords_rows: cute.Tensor,
        g_last: cutlass.Float32,
        tokens_here: cutlass.Int32,
        output: cute.Tensor,
        start: cutlass.Int32,
        chunk_start: cutlass.Int32,
        head: cutlass.Int32,
        v0: cutlass.Int32,
        scale: cutlass.Float32,
    ):
        """The chunk's last phase for the warp's 16 token rows (`output_rows`) and its 32 state columns
        (`carry_state`)."""
        self.output_rows(
            tiled_mma, copy_a, copy_b, lane, cute.local_tile(p16, (BLOCK, CHUNK), (warp_idx, 0)), vn_t,
            warp_idx * BLOCK, acc_o, coords_rows, tokens_here, output, start, chunk_start, head, v0, scale,
        )  # fmt: skip
        self.carry_state(
            tiled_mma, copy_a, copy_bt, lane, vnc_t, cute.local_tile(kq_t, (STATE_COLS_PER_WARP, CHUNK), (warp_idx, 0)),
            acc_state, g_last,
        )  # fmt: skip

    @cute.jit
    def output_rows(
        self,
        tiled_mma: cute.TiledMma,
        copy_a: cute.TiledCopy,
        copy_b: cute.TiledCopy,
        lane: cutlass.Int32,
        p_rows: cute.Tensor,
        vn: cute.Tensor,
        row0: cutlass.Int32,
        acc_o: cute.Tensor,
        coords_rows: cute.Tensor,
        tokens_here: cutlass.Int32,
        output: cute.Tensor,
        start: cutlass.Int32,
        chunk_start: cutlass.Int32,
        head: cutlass.Int32,
        v0: cutlass.Int32,
        scale: cutlass.Float32,
    ):
        """O += P V' for the 16 token rows from `row0` (acc_o holds exp(G) Q S0^T; `p_rows`: their rows of P,
        `vn`: V'^T over the same tokens), scaled and stored for the chunk's tokens (rows start + chunk_start.. of
        `output`)."""
        self.warp_gemm(tiled_mma, copy_a, copy_b, lane, p_rows, vn, acc_o)
        for e in cutlass.range_constexpr(cute.size(acc_o)):
            i = row0 + coords_rows[e][0]
            if i < tokens_here:
                output[start + chunk_start + i, head, v0 + coords_rows[e][1]] = (scale * acc_o[e]).to(
                    cutlass.BFloat16
                )

    @cute.jit
    def carry_state(
        self,
        tiled_mma: cute.TiledMma,
        copy_a: cute.TiledCopy,
        copy_bt: cute.TiledCopy,
        lane: cutlass.Int32,
        vnc: cute.Tensor,
        k_cols: cute.Tensor,
        acc_state: cute.Tensor,
        g_last: cutlass.Float32,
    ):
        """S = exp(G_last) S + V'c^T K on the warp's state columns (`vnc`: (V' exp(G_last - G_i))^T, `k_cols`: the
        warp's columns of K^T, over the chunk's tokens)."""
        chunk_decay = self.decay(g_last)
        for e in cutlass.range_constexpr(cute.size(acc_state)):
            acc_state[e] = chunk_decay * acc_state[e]
        self.warp_gemm(tiled_mma, copy_a, copy_bt, lane, vnc, k_cols, acc_state)

    @cute.jit
    def phase_barrier(self):
        """The barrier between the inverse's phases: the CTA's, whose 128 threads all take part (one method, so
        that a warpgroup running these phases inside a larger CTA uses a named barrier of its own)."""
        cute.arch.sync_threads()

    @cute.jit
    def invert_unit_lower(
        self,
        tiled_mma: cute.TiledMma,
        copy_a: cute.TiledCopy,
        copy_bt: cute.TiledCopy,
        lane: cutlass.Int32,
        warp_idx: cutlass.Int32,
        tidx: cutlass.Int32,
        a16_t: cute.Tensor,
        a_diag: cute.Tensor,
        t16: cute.Tensor,
        t16_t: cute.Tensor,
        scratch: cute.Tensor,
        acc_sq: cute.Tensor,
        acc_y: cute.Tensor,
        coords_sq: cute.Tensor,
        coords_rows: cute.Tensor,
    ):
        """P2-P4: T = (I + A)^-1 into t16, from A's fp32 diagonal blocks (a_diag) and fp16 copy
        (a16_t, read transposed): the four diagonal blocks by forward substitution (P2), then
        T_hl = -(T_hh A_hl) T_ll for (h, l) = (1, 0), (3, 2) (P3), then T[32:, :32] = -(T_B A_BA) T_A
        (P4); barriers after each. `scratch` is the calling warp's [16, 32] fp16 intermediate."""
        if tidx < CHUNK:
            self.invert_diagonal_block(a_diag, t16, tidx)
        self.phase_barrier()

        # ---- P3: T_hl = -(T_hh A_hl) T_ll for (h, l) = (1, 0), (3, 2) ----
        if warp_idx < 2:
            hi = 2 * warp_idx + 1
            lo = 2 * warp_idx
            self.off_diagonal_tile(
                tiled_mma, copy_a, copy_bt, lane,
                cute.local_tile(t16, (BLOCK, BLOCK), (hi, hi)),
                cute.local_tile(a16_t, (BLOCK, BLOCK), (lo, hi)),
                acc_sq, coords_sq,
                cute.local_tile(scratch, (BLOCK, BLOCK), (0, 0)),
                cute.local_tile(t16_t, (BLOCK, BLOCK), (lo, lo)),
                scratch, acc_sq, coords_sq, t16, hi * BLOCK, lo * BLOCK,
            )  # fmt: skip
        self.phase_barrier()

        # ---- P4: T[32:, :32] = -(T_B A_BA) T_A; warp w computes the 16x16 tile (w // 2, w % 2) ----
        half = CHUNK // 2
        out_row = warp_idx // 2
        out_col = warp_idx % 2
        self.off_diagonal_tile(
            tiled_mma, copy_a, copy_bt, lane,
            cute.local_tile(t16, (BLOCK, half), (2 + out_row, 1)),
            cute.local_tile(a16_t, (half, half), (0, 1)),
            acc_y, coords_rows,
            scratch,
            cute.local_tile(t16_t, (BLOCK, half), (out_col, 0)),
            scratch, acc_sq, coords_sq, t16, half + out_row * BLOCK, out_col * BLOCK,
        )  # fmt: skip
        self.phase_barrier()

    @cute.jit
    def off_diagonal_tile(
        self,
        tiled_mma: cute.TiledMma,
        copy_a: cute.TiledCopy,
        copy_bt: cute.TiledCopy,
        lane: cutlass.Int32,
        t_high: cute.Tensor,
        a_low_high_t: cute.Tensor,
        acc_first: cute.Tensor,
        coords_first: cute.Tensor,
        scratch_as_a: cute.Tensor,
        t_low_t: cute.Tensor,
        scratch: cute.Tensor,
        acc_sq: cute.Tensor,
        coords_sq: cute.Tensor,
        t16: cute.Tensor,
        row0: cutlass.Int32,
        col0: cutlass.Int32,
    ):
        """One warp's step of the doubling inverse: the 16 x 16 tile of t16 at (row0, col0) is
        -(T_high A_low,high) T_low. The first product goes through the warp's fp16 `scratch` (its
        accumulator `acc_first` and coordinates `coords_first`), read back as `scratch_as_a`."""
        acc_first.fill(0.0)
        self.warp_gemm(tiled_mma, copy_a, copy_bt, lane, t_high, a_low_high_t, acc_first)
        for e in cutlass.range_constexpr(cute.size(acc_first)):
            scratch[coords_first[e][0], coords_first[e][1]] = acc_first[e].to(cutlass.Float16)
        cute.arch.sync_warp()
        acc_sq.fill(0.0)
        self.warp_gemm(tiled_mma, copy_a, copy_bt, lane, scratch_as_a, t_low_t, acc_sq)
        for e in cutlass.range_constexpr(cute.size(acc_sq)):
            t16[row0 + coords_sq[e][0], col0 + coords_sq[e][1]] = (-acc_sq[e]).to(cutlass.Float16)

    @cute.jit
    def warp_gemm(
        self,
        tiled_mma: cute.TiledMma,
        copy_a: cute.TiledCopy,
        copy_b: cute.TiledCopy,
        lane: cutlass.Int32,
        s_a: cute.Tensor,
        s_b: cute.Tensor,
        acc: cute.Tensor,
    ):
        """acc[M, N] += s_a[M, K] s_b[N, K]^T by one warp (shared-memory fp16 operands via ldmatrix)."""
        thr_mma = tiled_mma.get_slice(lane)
        thr_a = copy_a.get_slice(lane)
        thr_b = copy_b.get_slice(lane)
        t_sa = thr_a.partition_S(s_a)
        t_ra = thr_mma.make_fragment_A(thr_mma.partition_A(s_a))
        t_ra_view = thr_a.retile(t_ra)
        t_sb = thr_b.partition_S(s_b)
        t_rb = thr_mma.make_fragment_B(thr_mma.partition_B(s_b))
        t_rb_view = thr_b.retile(t_rb)
        for kk in cutlass.range_constexpr(cute.size(t_sa.shape[2])):
            cute.copy(copy_a, t_sa[None, None, kk], t_ra_view[None, None, kk])
            cute.copy(copy_b, t_sb[None, None, kk], t_rb_view[None, None, kk])
            cute.gemm(tiled_mma, acc, t_ra[None, None, kk], t_rb[None, None, kk], acc)

    @cute.jit
    def load_chunk(
        self,
        g2s: cute.CopyAtom,
        k: cute.Tensor,
        v: cute.Tensor,
        a: cute.Tensor,
        b: cute.Tensor,
        raw_k: cute.Tensor,
        raw_v: cute.Tensor,
        raw_a: cute.Tensor,
        raw_b: cute.Tensor,
        start: cutlass.Int32,
        length: cutlass.Int32,
        chunk: cutlass.Int32,
        stage: cutlass.Int32,
        head: cutlass.Int32,
        v0: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        """Issue the cp.async copies of one chunk but its q rows (k rows of the head's q/k head, the
        slice_rows values of this slice, the 8-head rows of a and b); tokens past the end are skipped."""
        first = chunk * CHUNK
        self.copy_head_rows(g2s, k, raw_k, 0, start, length, chunk, head, tidx)
        v_pieces = self.slice_rows // COPY_ELEMS  # 4 per token at 32 rows
        for i in cutlass.range_constexpr(CHUNK * v_pieces // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            j = linear // v_pieces
            piece = linear % v_pieces
            if first + j < length:
                cute.copy(
                    g2s,
                    cute.local_tile(v[start + first + j, head, None], (COPY_ELEMS,), (v0 // COPY_ELEMS + piece,)),
                    cute.local_tile(raw_v[stage, j, None], (COPY_ELEMS,), (piece,)),
                )
        self.copy_gate_rows(g2s, a, b, raw_a, raw_b, start, length, chunk, stage, tidx)

    @cute.jit
    def copy_gate_rows(
        self,
        g2s: cute.CopyAtom,
        a: cute.Tensor,
        b: cute.Tensor,
        raw_a: cute.Tensor,
        raw_b: cute.Tensor,
        start: cutlass.Int32,
        length: cutlass.Int32,
        chunk: cutlass.Int32,
        stage: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        """cp.async of one chunk's 8-head rows of a (threads 0..63) and b (64..127) into `stage`;
        tokens past the end are skipped."""
        first = chunk * CHUNK
        j = tidx % CHUNK
        if first + j < length:
            if tidx < CHUNK:
                cute.copy(g2s, a[start + first + j, None], raw_a[stage, j, None])
            else:
                cute.copy(g2s, b[start + first + j, None], raw_b[stage, j, None])

    @cute.jit
    def load_q(
        self,
        g2s: cute.CopyAtom,
        q: cute.Tensor,
        kq_raw: cute.Tensor,
        start: cutlass.Int32,
        length: cutlass.Int32,
        chunk: cutlass.Int32,
        head: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        """Issue the cp.async copies of one chunk's q rows (bf16) into the q half of kq; tokens past
        the end are skipped."""
        self.copy_head_rows(g2s, q, kq_raw, CHUNK, start, length, chunk, head, tidx)

    @cute.jit
    def copy_head_rows(
        self,
        g2s: cute.CopyAtom,
        src: cute.Tensor,
        dst: cute.Tensor,
        dst_row0: cutlass.Constexpr,
        start: cutlass.Int32,
        length: cutlass.Int32,
        chunk: cutlass.Int32,
        head: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        """cp.async of one chunk's rows of q or k (the head's q/k head) into rows dst_row0.. of `dst`,
        in 16-B pieces over all threads (8 rounds); tokens past the end are skipped."""
        qk_head = head // V_HEADS_PER_QK_HEAD
        first = chunk * CHUNK
        for i in cutlass.range_constexpr(CHUNK * PIECES_PER_ROW // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            j = linear // PIECES_PER_ROW
            piece = linear % PIECES_PER_ROW
            if first + j < length:
                cute.copy(
                    g2s,
                    cute.local_tile(src[start + first + j, qk_head, None], (COPY_ELEMS,), (piece,)),
                    cute.local_tile(dst[dst_row0 + j, None], (COPY_ELEMS,), (piece,)),
                )

    @cute.jit
    def convert_kq(
        self,
        raw_k: cute.Tensor,
        kq_raw: cute.Tensor,
        kq: cute.Tensor,
        tokens_here: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        """kq = fp16 of (raw_k; the bf16 q rows already in kq), rows of tokens past the end zeroed.
        Each thread reads and rewrites the same 16 B of a q row, so the in-place conversion needs no
        barrier. Exact for |x| >= 2^-14 (bf16 has fewer mantissa bits); below, fp16 subnormals
        round to 2^-24 as the model's fp16 rounding does."""
        for i in cutlass.range_constexpr(KQ_ROWS * PIECES_PER_ROW // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            row = linear // PIECES_PER_ROW
            piece = linear % PIECES_PER_ROW
            # Rounds 0-7 cover the k rows 0..63 (raw_k's rows), rounds 8-15 the q rows 64..127.
            source = raw_k if i < CHUNK * PIECES_PER_ROW // NUM_THREADS else kq_raw
            dst = cute.local_tile(kq[row, None], (COPY_ELEMS,), (piece,))
            if row % CHUNK < tokens_here:
                values = cute.local_tile(source[row, None], (COPY_ELEMS,), (piece,)).load()
                dst.store(values.to(cutlass.Float32).to(cutlass.Float16))
            else:
                dst.fill(0.0)

    @cute.jit
    def chunk_gates(
        self,
        raw_a: cute.Tensor,
        raw_b: cute.Tensor,
        stage: cutlass.Int32,
        head: cutlass.Int32,
        neg_decay_rate: cutlass.Float32,
        bias: cutlass.Float32,
        tokens_here: cutlass.Int32,
        lane: cutlass.Int32,
        cum_log_g: cute.Tensor,
        beta: cute.Tensor,
    ):
        """Warp 0: log g and beta of the chunk's 64 tokens (lane l takes tokens 2l, 2l + 1; zero
        past the end), then G = inclusive cumulative sum of log g by a shuffle scan (both in base 2:
        `neg_decay_rate` carries log2(e))."""
        first = 2 * lane
        log_g0, beta0 = self.token_gates(raw_a, raw_b, stage, head, neg_decay_rate, bias, tokens_here, first)
        log_g1, beta1 = self.token_gates(raw_a, raw_b, stage, head, neg_decay_rate, bias, tokens_here, first + 1)
        inclusive = log_g0 + log_g1
        offset = 1
        while offset < WARP_SIZE:
            from_below = cute.arch.shuffle_sync_up(inclusive, offset)
            inclusive = inclusive + (from_below if lane >= offset else cutlass.Float32(0.0))
            offset *= 2
        exclusive = cute.arch.shuffle_sync_up(inclusive, 1)
        exclusive = exclusive if lane > 0 else cutlass.Float32(0.0)
        g_first = exclusive + log_g0
        cum_log_g[first] = g_first
        cum_log_g[first + 1] = g_first + log_g1
        beta[first] = beta0
        beta[first + 1] = beta1

    @cute.jit
    def token_gates(
        self,
        raw_a: cute.Tensor,
        raw_b: cute.Tensor,
        stage: cutlass.Int32,
        head: cutlass.Int32,
        neg_decay_rate: cutlass.Float32,
        bias: cutlass.Float32,
        tokens_here: cutlass.Int32,
        token: cutlass.Int32,
    ):
        """(log g, beta) of one token in fp32; (0, 0) past the end (its a/b slots hold garbage)."""
        log_g = cutlass.Float32(0.0)
        gate_beta = cutlass.Float32(0.0)
        if token < tokens_here:
            x = raw_a[stage, token, head].to(cutlass.Float32) + bias
            softplus = x if x > SOFTPLUS_THRESHOLD else cute.math.log1p(cute.math.exp(x))
            log_g = neg_decay_rate * softplus
            gate_beta = cutlass.Float32(1.0) / (
                cutlass.Float32(1.0) + cute.math.exp(-raw_b[stage, token, head].to(cutlass.Float32))
            )
        return log_g, gate_beta

    @cute.jit
    def invert_diagonal_block(self, a_diag: cute.Tensor, t: cute.Tensor, tidx: cutlass.Int32):
        """Thread c < 64: column c % 16 of the inverse of I + A_bb, b = c // 16, by forward
        substitution in fp32 (column-oriented: once t_j is final, it updates the rows below), stored
        in `t`'s element type (fp16, or fp32 for the key side's accurate inverse)."""
        base = (tidx // BLOCK) * BLOCK
        col = tidx % BLOCK
        column = cute.make_rmem_tensor((BLOCK,), cutlass.Float32)
        for r in cutlass.range_constexpr(BLOCK):
            column[r] = cutlass.Float32(1.0) if col == r else cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(BLOCK):
            for r in cutlass.range_constexpr(j + 1, BLOCK):
                column[r] = column[r] - a_diag[base + r, j] * column[j]
        for r in cutlass.range_constexpr(BLOCK):
            t[base + r, base + col] = column[r].to(t.element_type)


# ------------------------------------------------------------------------------------------------
# Host side: token_serial.py's launcher and compile cache (keyed on the kernel class).
# ------------------------------------------------------------------------------------------------


def compiled_for(arch: str = GPU_ARCH, kernel: type = _Chunked) -> Callable:
    """The compiled launcher of `kernel` (this file's, or a candidate's subclass of it) for `arch`
    (compiled on first use; needs no GPU)."""
    return token_serial.compiled_for(arch, kernel)


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the kernel for `arch` without touching a GPU (for CI and warm-up)."""
    return (compiled_for(arch, _Chunked),)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """Destination-passing entry, same contract as kernel.run: fills `output` [T,8,128] bf16 and
    `new_state` [N,8,128,128] fp32; `state` None means zeros; `scale` None or 0 means 1/sqrt(128).
    No device reads, no host synchronisation: one kernel launch on the current stream."""
    run_kernel(_Chunked, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)


def run_kernel(kernel: type, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`run` with `kernel` (this file's kernel classes, or a candidate's subclass of one)."""
    token_serial.run_kernel(kernel, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
