"""GDN prefill's chunked path (`chunked.py`'s kernel) with a sequence's last tokens, when at most SHORT_CHUNK, run as
one 16-token chunk after the 64-token ones instead of a 64-token step: what `kernel.py` takes for its chunked rows.

Why (NOTES.md, "Ideas tried"): a 64-token chunk step takes ~4-5.5 us whatever its tokens, a 16-token chunk ~2.2 us.
The one-sequence rows of 67-79 tokens spent ~4 us of their ~11.3 on a second chunk of 3-15 tokens. Measured (runner,
the chunked path's 29 rows and 4 no-state twins): 1.079x graph, 1.13-1.22x at 67, 68, 79 and 134 tokens, every row
bit for bit the plain kernel's.

A short chunk is `chunked.py`'s form at C = 16 (`_ShortTail.short_tail_chunk`): one MMA tile edge, so one Gram tile
each for A and P and one diagonal block to invert (no doubling levels), the warps of the CTA splitting the first phase
four ways:
  P0  wait for the loads; the k and q rows to fp16; the gates (warp 0); the fp16 state copy.
  P1  warp 0: Yk = K S0^T -> Xb^T; warp 1: Yq = Q S0^T -> the output accumulator; warp 2: the A tile (and its fp32
      copy); warp 3: the P tile.
  P2  warp 0: T = (I + A)^-1 by forward substitution (16 lanes, fp32), then V' = T Xb -> V'^T and
      (V' exp(G_last - G_i))^T in fp16.
  P6  warp 1: O += P V', scaled and stored; every warp: S = exp(G_last) S + V'c^T K on its 32 columns.
The tail's rows are where the last 64-token chunk's prefetch put them, the rows past the tail zero, the gates past it
inert, G_last read where the 64-token kernel reads it: the same bits as `chunked.run` (GPU test).
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute

from . import chunked
from .chunked import BLOCK, CHUNK, HEAD_SIZE, NUM_BLOCKS, NUM_STAGES, STATE_COLS_PER_WARP, _Chunked, _NarrowChunked
from .token_serial import GPU_ARCH, GdnShapeError, resolve_scale

__all__ = ["SHORT_CHUNK", "GdnShapeError", "compile_only", "kernel_for", "resolve_scale", "run"]

SHORT_CHUNK = BLOCK  # tokens per short chunk: one MMA tile edge


class _ShortTail:
    """`chunked.py`'s kernel (mixed into its classes) with a sequence's last tokens, when at most SHORT_CHUNK, run as
    one short chunk after the 64-token ones instead of a 64-token step (`chunked._Chunked.short_tail`). The kernel's
    buffers are sized for 64-token chunks, of which the short chunk uses the first 16 rows (and the q half's first 16)."""

    short_tail = True

    @cute.jit
    def full_chunks(self, length: cutlass.Int32, num_chunks: cutlass.Int32) -> cutlass.Int32:
        """The 64-token chunks before the tail: all but the last when the last holds at most SHORT_CHUNK tokens."""
        full = num_chunks
        if num_chunks > 0 and length - (num_chunks - 1) * CHUNK <= SHORT_CHUNK:
            full = num_chunks - 1
        return full

    @cute.jit
    def short_tail_chunk(
        self, output, scale, raw_k, raw_v, raw_a, raw_b, kq_raw, kq, kq_t, a16, a_diag, t16, p16, s16, xb_t, vn_t,
        vnc_t, cum_log_g, beta, acc_state, acc_o, acc_y, acc_sq, coords_state, coords_rows, coords_sq, tiled_mma,
        copy_a, copy_b, copy_bt, start, length, head, v0, neg_decay_rate, bias, num_full_chunks, tidx, warp_idx, lane,
    ):  # fmt: skip
        """The tail after `num_full_chunks` 64-token chunks (P0-P6 of the module docstring). The last 64-token chunk
        issued its loads as the next chunk's (`load_chunk`, `load_q`: token j of a chunk in row j of each staging
        buffer, stage num_full_chunks % NUM_STAGES); the 64-row conversion zeroes the rows past the tail. No chunk
        follows, so nothing is prefetched."""
        rows = self.slice_rows
        stage = num_full_chunks % NUM_STAGES
        chunk_start = num_full_chunks * CHUNK
        tokens_here = cutlass.min(length - chunk_start, cutlass.Int32(SHORT_CHUNK))

        # ---- P0 ----
        self.enter_chunk(
            raw_k, kq_raw, kq, raw_a, raw_b, stage, head, neg_decay_rate, bias, tokens_here, cum_log_g, beta,
            acc_state, coords_state, s16, tidx, warp_idx, lane,
        )  # fmt: skip

        # ---- P1: the four products of the chunk, one per warp ----
        k_rows = cute.local_tile(kq, (BLOCK, HEAD_SIZE), (0, 0))
        q_rows = cute.local_tile(kq, (BLOCK, HEAD_SIZE), (NUM_BLOCKS, 0))
        if warp_idx == 0:
            acc_y.fill(0.0)
            self.warp_gemm(tiled_mma, copy_a, copy_b, lane, k_rows, s16, acc_y)
            self.xb_epilogue(acc_y, coords_rows, 0, cum_log_g, beta, raw_v, stage, tokens_here, xb_t)
        elif warp_idx == 1:
            acc_o.fill(0.0)
            self.warp_gemm(tiled_mma, copy_a, copy_b, lane, q_rows, s16, acc_o)
            for e in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[e] = self.decay(cum_log_g[coords_rows[e][0]]) * acc_o[e]
        elif warp_idx == 2:
            acc_sq.fill(0.0)
            self.warp_gemm(tiled_mma, copy_a, copy_b, lane, k_rows, k_rows, acc_sq)
            self.a_tile_epilogue(acc_sq, coords_sq, 0, 0, cum_log_g, beta, a16, a_diag)
        else:
            acc_sq.fill(0.0)
            self.warp_gemm(tiled_mma, copy_a, copy_b, lane, q_rows, k_rows, acc_sq)
            self.p_tile_epilogue(acc_sq, coords_sq, 0, 0, cum_log_g, p16)
        cute.arch.sync_threads()

        # ---- P2: warp 0: T = (I + A)^-1 (lanes 0-15), then V' = T Xb. T and Xb are warp 0's own stores, so a warp
        # barrier orders them. ----
        # G_last read where the 64-token kernel reads it: the scan's entries past the end add log g = 0, but the
        # shuffle scan associates them differently from entry 15, and this sum makes a tail chunked.py's bit for bit.
        g_last = cum_log_g[CHUNK - 1]
        if warp_idx == 0:
            if lane < BLOCK:
                self.invert_diagonal_block(a_diag, t16, lane)
            cute.arch.sync_warp()
            self.new_value_rows(
                tiled_mma, copy_a, copy_b, lane, cute.local_tile(t16, (BLOCK, BLOCK), (0, 0)),
                cute.local_tile(xb_t, (rows, BLOCK), (0, 0)), 0, acc_y, coords_rows, cum_log_g, g_last, vn_t, vnc_t,
            )  # fmt: skip
        cute.arch.sync_threads()

        # ---- P6: O = exp(G) Q S0^T + P V' (warp 1); S = exp(G_last) S + V'c^T K (every warp) ----
        if warp_idx == 1:
            self.output_rows(
                tiled_mma, copy_a, copy_b, lane, cute.local_tile(p16, (BLOCK, BLOCK), (0, 0)),
                cute.local_tile(vn_t, (rows, BLOCK), (0, 0)), 0, acc_o, coords_rows, tokens_here, output, start,
                chunk_start, head, v0, scale,
            )  # fmt: skip
        self.carry_state(
            tiled_mma, copy_a, copy_bt, lane, cute.local_tile(vnc_t, (rows, BLOCK), (0, 0)),
            cute.local_tile(kq_t, (STATE_COLS_PER_WARP, BLOCK), (warp_idx, 0)), acc_state, g_last,
        )  # fmt: skip


class _NarrowShortTail(_ShortTail, _NarrowChunked):
    """`chunked.py`'s kernel with a short tail on 16-row V slices (up to chunked.NARROW_MAX_SEQS sequences)."""


class _WideShortTail(_ShortTail, _Chunked):
    """The same on 32-row V slices."""


def kernel_for(num_seqs: int) -> type:
    """`chunked.kernel_for`'s slice width for `num_seqs` sequences, with a short tail."""
    return _NarrowShortTail if chunked.kernel_for(num_seqs) is _NarrowChunked else _WideShortTail


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """Both slice widths' kernels for `arch`, without a GPU."""
    return tuple(chunked.compiled_for(arch, cls) for cls in (_NarrowShortTail, _WideShortTail))


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`chunked.run` with each sequence's last <= SHORT_CHUNK tokens as one short chunk (any T: the tests)."""
    chunked.run_kernel(
        kernel_for(new_state.shape[0]), q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state
    )
