"""GDN prefill for SM90 in CuTe-DSL, the "WY prepass" form: the path `kernel.py` takes from three sequences for a mean
length above WARP_CHAIN_MAX_MEAN_LENGTH (below 15 sequences; the WGMMA chain's from 15). `chunked.py`'s chunked form
split in two kernels, so that the chain of chunks carries only the state-dependent half of each chunk (NOTES.md).

Why: in `chunked.py` the state-free half of a chunk (the Gram tiles A and P, the gates and the three-level
inverse T = (I + A)^-1, phases P1-P4) sits on the sequential chain, and the V-slice CTAs of a (sequence, head)
each recompute it. A parallel prepass over every (chunk, head) takes it off the chain, which then steps a chunk
in ~2.5 us instead of ~5.5 (the same split Kachua's Triton kernels use).

1. `_KeySide`, grid (8 heads, chunk slots): per (chunk, head) the gates (G in base 2, beta), P and T exactly as
   `chunked.py` computes them (its methods), stored to a workspace: T and P in fp16 [slots, 8, TP_PLANES, 64, 64],
   G and beta in fp32 [slots, 8, 2, 64]. Chunk c of sequence s has slot `chunk_slot(start_s, c, s)`. (For the
   WGMMA chain, `_KeySide(paired=True)`: in a chunk that barely decays T in fp32, its lo half in the third plane.)
2. `_ValueSide`, `chunked.py`'s grid on V slices of 16 or 32 rows: per chunk only the K S0^T / Q S0^T
   products, V' = T Xb, the output and the state update; T, G and beta of the next chunk arrive by cp.async
   from the end of this chunk's V' phase, and P (double-buffered, the one array it keeps two of) from its
   start. Three CTA barriers per chunk, not six.

The slice width is chosen from N (a shape): 16 rows (eight CTAs per (sequence, head)) up to NARROW_MAX_SEQS
sequences, where that grid fits in one wave of two CTAs per SM and halving each CTA's work shortens the chain;
32 rows above, where the grid already fills the GPU and twice the CTAs cost more than they save (NOTES.md).

Same values, same roundings, same order of operations as `chunked.py` at either width, so the outputs and
states are `chunked.py`'s bit for bit (a GPU test checks). Two launches in one TVM-FFI call (the second waits
for the first in stream order); the workspaces (~24.5 KB per slot and head) are allocated per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_fake_compact_tensor

from . import token_serial
from .chunked import (
    BLOCK,
    CHUNK,
    COPY_ELEMS,
    CTAS_PER_WAVE,
    DIAG_STRIDE,
    KQ_ROWS,
    KQ_T_VIEW,
    LOG2_E,
    NARROW_SLICE_ROWS,
    NARROW_STRIDE,
    NUM_STAGES,
    NUM_THREADS,
    NUM_WARPS,
    SCRATCH_STRIDE,
    SCRATCH_VIEW,
    SLICE_ROWS,
    SQUARE_T_VIEW,
    SQUARE_VIEW,
    STATE_COLS_PER_WARP,
    WARP_SIZE,
    WIDE_STRIDE,
    _Chunked,
    _layout,
    _make_operand_copies,
    _make_warp_mma,
    sequence_bounds,
)
from .accurate_inverse import T_LO_PLANE, AccurateInverse, chunk_is_slow
from .token_serial import GPU_ARCH, HEAD_SIZE, NUM_V_HEADS, GdnShapeError, resolve_scale

__all__ = [
    "CONFIGS",
    "NARROW_MAX_SEQS",
    "NARROW_SLICE_ROWS",
    "WIDE_SLICE_ROWS",
    "GdnShapeError",
    "WyPrepassConfig",
    "chunk_slot",
    "compile_only",
    "compiled_for",
    "config_for",
    "num_chunk_slots",
    "run",
    "run_with_config",
]

# V rows per chain CTA (see the module docstring): chunked.py's 32, or 16 for few sequences.
WIDE_SLICE_ROWS = SLICE_ROWS
# The narrow grid (64 CTAs per sequence) fits in one wave (CTAS_PER_WAVE) up to 4 sequences.
NARROW_MAX_SEQS = CTAS_PER_WAVE // (NUM_V_HEADS * (HEAD_SIZE // NARROW_SLICE_ROWS))
SQUARE_PIECES = CHUNK // COPY_ELEMS  # 16-B pieces of a 64-wide fp16 row
GATE_PIECES = CHUNK * 4 // 16  # 16-B pieces of 64 fp32


# The workspace's fp16 [64, 64] planes per (slot, head): T, P, and T_lo (written and read only in a chunk that barely
# decays: `accurate_inverse.py`).
TP_PLANES = 3


def chunk_slot(start, chunk, seq):
    """Workspace slot of chunk `chunk` of sequence `seq` starting at token `start`. Unique: within a sequence
    the slots grow by one per chunk, and the next sequence starts at or after this one's last token, so its
    first slot is at least this one's last + 1 (the + seq). Below `num_chunk_slots`. Plain arithmetic: the
    kernels call it with DSL integers, the tests with Python ints."""
    return (start + chunk * CHUNK) // CHUNK + seq


@cute.jit
def last_sequence_from(cu_seqlens: cute.Tensor, slot, total_tokens, first_slot: cutlass.Constexpr):
    """The last sequence s whose first slot, `first_slot(s, start_s)`, is <= `slot`: a binary search over the
    sequences, for a slot numbering whose first slots grow with the sequence index (chunk slots here, segment
    slots in `context_parallel.py`)."""
    lo = cutlass.Int32(0)
    hi = cutlass.Int32(cu_seqlens.shape[0] - 2)
    for _ in cutlass.range(32, unroll=1):
        if lo < hi:
            mid = (lo + hi + 1) // 2
            mid_start, _ = sequence_bounds(cu_seqlens, mid, total_tokens)
            if first_slot(mid, mid_start) <= slot:
                lo = mid
            else:
                hi = mid - 1
    return lo


def num_chunk_slots(num_tokens: int, num_seqs: int) -> int:
    """Slots of the workspace: chunk_slot <= (T - 1) // 64 + N - 1 for every chunk of every sequence."""
    return num_tokens // CHUNK + num_seqs


class _KeySide(AccurateInverse, _Chunked):
    """Kernel 1: the state-free half of every (chunk, head), from `chunked.py`'s methods, into the workspace.

    Lean, for the many-sequence batches where the prepass takes several waves: the k rows are
    staged as bf16 in kq itself and converted in place (as the q rows always are), P goes from the Gram epilogue
    straight to the workspace, and the inverse's scratch has its own size: ~66 KB of shared memory instead of the
    ~94 that `chunked.py`'s buffers would take, three CTAs per SM instead of two."""

    def __init__(self, paired: bool = False):
        """`paired`: a chunk that barely decays gets T in fp32, stored as T_hi (plane 0) and T_lo (T_LO_PLANE), for
        a chain that reads both (the WGMMA chain: `accurate_inverse.py`). Unpaired, plane 0 holds `chunked.py`'s T in
        every chunk, as the mma.sync chain needs: T_hi alone would be less accurate there than that blocked inverse,
        whose roundings partly cancel (CPU model, repeated keys at 4096 tokens: 1.5 of the tolerance against 0.85)."""
        self.paired = paired

    @cute.jit
    def launch(self, q, k, A_log, a, dt_bias, b, cu_seqlens, ws_tp, ws_g, stream):
        tiled_mma = _make_warp_mma()
        f16, bf16, f32 = cutlass.Float16, cutlass.BFloat16, cutlass.Float32

        # No k staging buffer and no P tile: k is staged in kq, P goes to the workspace.
        @cute.struct
        class SharedStorage:
            raw_a: cute.struct.Align[cute.struct.MemRange[bf16, NUM_STAGES * CHUNK * NUM_V_HEADS], 128]
            raw_b: cute.struct.Align[cute.struct.MemRange[bf16, NUM_STAGES * CHUNK * NUM_V_HEADS], 128]
            kq: cute.struct.Align[cute.struct.MemRange[f16, KQ_ROWS * WIDE_STRIDE], 128]
            a16: cute.struct.Align[cute.struct.MemRange[f16, CHUNK * NARROW_STRIDE], 128]
            a_diag: cute.struct.Align[cute.struct.MemRange[f32, CHUNK * DIAG_STRIDE], 128]
            t16: cute.struct.Align[cute.struct.MemRange[f16, CHUNK * NARROW_STRIDE], 128]
            scratch: cute.struct.Align[cute.struct.MemRange[f16, NUM_WARPS * BLOCK * SCRATCH_STRIDE], 128]
            cum_log_g: cute.struct.Align[cute.struct.MemRange[f32, CHUNK], 16]
            beta: cute.struct.Align[cute.struct.MemRange[f32, CHUNK], 16]

        kernel = self.key_kernel(q, k, A_log, a, dt_bias, b, cu_seqlens, ws_tp, ws_g, tiled_mma, SharedStorage)
        self.launch_grid(kernel, [NUM_V_HEADS, ws_tp.shape[0], 1], SharedStorage, stream)

    @cute.jit
    def sequence_of_slot(self, cu_seqlens: cute.Tensor, slot: cutlass.Int32, total_tokens: cutlass.Int32):
        """The last sequence whose first chunk slot is <= `slot`. The slot is that sequence's chunk slot - first
        slot, if that chunk exists."""
        return last_sequence_from(cu_seqlens, slot, total_tokens, lambda seq, start: chunk_slot(start, 0, seq))

    @cute.jit
    def chunk_of_slot(self, cu_seqlens: cute.Tensor, slot: cutlass.Int32, total_tokens: cutlass.Int32):
        """(start, length, chunk, num_chunks) of the sequence whose chunk has workspace slot `slot`; chunk ==
        num_chunks when the slot is no chunk (past a sequence's end, or before the first sequence)."""
        seq = self.sequence_of_slot(cu_seqlens, slot, total_tokens)
        start, length = sequence_bounds(cu_seqlens, seq, total_tokens)
        num_chunks = (length + CHUNK - 1) // CHUNK
        first_slot = chunk_slot(start, 0, seq)
        chunk = cutlass.Int32(cutlass.select_(slot >= first_slot, slot - first_slot, num_chunks))
        return start, length, chunk, num_chunks

    def head_views(self, st, warp_idx):
        """(a16, a_diag, t16, scratch, cum_log_g, beta) over the key side's shared storage `st`; `scratch` is
        warp `warp_idx`'s. Built while a kernel is traced."""
        return (
            st.a16.get_tensor(_layout(SQUARE_VIEW)),
            st.a_diag.get_tensor(cute.make_layout((CHUNK, BLOCK), stride=(DIAG_STRIDE, 1))),
            st.t16.get_tensor(_layout(SQUARE_VIEW)),
            st.scratch.get_tensor(_layout(SCRATCH_VIEW))[warp_idx, None, None],
            st.cum_log_g.get_tensor(cute.make_layout(CHUNK)),
            st.beta.get_tensor(cute.make_layout(CHUNK)),
        )

    @cute.jit
    def clear_upper_blocks(self, t16: cute.Tensor, p16: cute.Tensor, tidx: cutlass.Int32):
        """T and P are lower triangular; their upper blocks are stored too, as zeros (P's in the workspace,
        only the blocks above the diagonal, which the Gram epilogue never writes)."""
        for i in cutlass.range_constexpr(CHUNK * CHUNK // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            t16[linear // CHUNK, linear % CHUNK] = cutlass.Float16(0.0)
            if linear % CHUNK // BLOCK > linear // CHUNK // BLOCK:
                p16[linear // CHUNK, linear % CHUNK] = cutlass.Float16(0.0)

    @cute.kernel
    def key_kernel(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        A_log: cute.Tensor,
        a: cute.Tensor,
        dt_bias: cute.Tensor,
        b: cute.Tensor,
        cu_seqlens: cute.Tensor,
        ws_tp: cute.Tensor,
        ws_g: cute.Tensor,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        head, slot, _ = cute.arch.block_idx()
        warp_idx = tidx // WARP_SIZE
        lane = tidx % WARP_SIZE
        start, length, chunk, num_chunks = self.chunk_of_slot(cu_seqlens, slot, cutlass.Int32(q.shape[0]))
        if chunk < num_chunks:
            smem = cutlass.memory.SmemAllocator()
            st = smem.allocate(SharedStorage)
            raw_k, raw_a, raw_b, kq, kq_raw = self.staging_views(st, k_staged_in_kq=True)
            a16, a_diag, t16, scratch, cum_log_g, beta = self.head_views(st, warp_idx)
            a16_t = cute.make_tensor(a16.iterator, _layout(SQUARE_T_VIEW))
            t16_t = cute.make_tensor(t16.iterator, _layout(SQUARE_T_VIEW))
            p16 = ws_tp[slot, head, 1, None, None]

            copy_a, copy_b, copy_bt = _make_operand_copies(tiled_mma)
            thr_mma = tiled_mma.get_slice(lane)
            coords_sq = thr_mma.partition_C(cute.make_identity_tensor((BLOCK, BLOCK)))
            coords_rows = thr_mma.partition_C(cute.make_identity_tensor((BLOCK, SLICE_ROWS)))
            acc_sq = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK, BLOCK)), cutlass.Float32)
            acc_y = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK, SLICE_ROWS)), cutlass.Float32)

            g2s = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.BFloat16, num_bits_per_copy=128
            )
            self.copy_head_rows(g2s, k, raw_k, 0, start, length, chunk, head, tidx)
            self.copy_gate_rows(g2s, a, b, raw_a, raw_b, start, length, chunk, 0, tidx)
            self.load_q(g2s, q, kq_raw, start, length, chunk, head, tidx)
            cute.arch.cp_async_commit_group()
            self.clear_upper_blocks(t16, p16, tidx)
            neg_decay_rate = -cute.math.exp(A_log[head]) * LOG2_E
            tokens_here = cutlass.min(length - chunk * CHUNK, cutlass.Int32(CHUNK))
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            self.convert_kq(raw_k, kq_raw, kq, tokens_here, tidx)
            if warp_idx == 0:
                self.chunk_gates(
                    raw_a, raw_b, 0, head, neg_decay_rate, dt_bias[head], tokens_here, lane, cum_log_g, beta
                )
            cute.arch.sync_threads()
            slow, a32 = None, None
            if cutlass.const_expr(self.paired):
                slow = chunk_is_slow(cum_log_g, tokens_here)
                a32 = self.a32_view(a16)
            self.gram_tiles(
                tiled_mma, copy_a, copy_b, lane, warp_idx, kq, acc_sq, coords_sq, cum_log_g, beta, a16, a_diag, p16,
                a32, slow,
            )  # fmt: skip
            cute.arch.sync_threads()
            if cutlass.const_expr(self.paired):
                if slow:
                    t32, x32 = self.t32_x32_views(kq)
                    self.accurate_inverse(a_diag, a32, t32, x32, t16, ws_tp[slot, head, T_LO_PLANE, None, None], tidx)
                    cute.arch.sync_threads()
                else:
                    self.invert_unit_lower(
                        tiled_mma, copy_a, copy_bt, lane, warp_idx, tidx, a16_t, a_diag, t16, t16_t, scratch,
                        acc_sq, acc_y, coords_sq, coords_rows,
                    )  # fmt: skip
            else:
                self.invert_unit_lower(
                    tiled_mma, copy_a, copy_bt, lane, warp_idx, tidx, a16_t, a_diag, t16, t16_t, scratch,
                    acc_sq, acc_y, coords_sq, coords_rows,
                )  # fmt: skip
            for i in cutlass.range_constexpr(CHUNK * SQUARE_PIECES // NUM_THREADS):
                linear = i * NUM_THREADS + tidx
                row = linear // SQUARE_PIECES
                piece = linear % SQUARE_PIECES
                cute.autovec_copy(
                    cute.local_tile(t16[row, None], (COPY_ELEMS,), (piece,)),
                    cute.local_tile(ws_tp[slot, head, 0, row, None], (COPY_ELEMS,), (piece,)),
                )
            if tidx < CHUNK:
                ws_g[slot, head, 0, tidx] = cum_log_g[tidx]
                ws_g[slot, head, 1, tidx] = beta[tidx]


class _ValueSide(_Chunked):
    """Kernel 2: `chunked.py`'s chain with the key side read from the workspace, on V slices of `slice_rows` rows
    (32: four CTAs per (sequence, head), as chunked.py; 16: eight)."""

    def __init__(self, slice_rows: int):
        # Whole MMA tiles per slice; one 16-B piece of v per thread and round of load_chunk.
        assert HEAD_SIZE % slice_rows == 0 and slice_rows % BLOCK == 0
        assert CHUNK * (slice_rows // COPY_ELEMS) % NUM_THREADS == 0
        self.slice_rows = slice_rows

    @cute.jit
    def launch(
        self, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state, ws_tp, ws_g,
        stream,
    ):  # fmt: skip
        tiled_mma = _make_warp_mma()
        f16, bf16, f32 = cutlass.Float16, cutlass.BFloat16, cutlass.Float32
        rows = self.slice_rows

        @cute.struct
        class SharedStorage:
            raw_k: cute.struct.Align[cute.struct.MemRange[bf16, CHUNK * HEAD_SIZE], 128]
            raw_v: cute.struct.Align[cute.struct.MemRange[bf16, NUM_STAGES * CHUNK * rows], 128]
            raw_a: cute.struct.Align[cute.struct.MemRange[bf16, NUM_STAGES * CHUNK * NUM_V_HEADS], 128]
            raw_b: cute.struct.Align[cute.struct.MemRange[bf16, NUM_STAGES * CHUNK * NUM_V_HEADS], 128]
            kq: cute.struct.Align[cute.struct.MemRange[f16, KQ_ROWS * WIDE_STRIDE], 128]
            # V'^T and V'c^T (P5-P6).
            a16: cute.struct.Align[cute.struct.MemRange[f16, CHUNK * NARROW_STRIDE], 128]
            t16: cute.struct.Align[cute.struct.MemRange[f16, CHUNK * NARROW_STRIDE], 128]
            p16: cute.struct.Align[cute.struct.MemRange[f16, 2 * CHUNK * NARROW_STRIDE], 128]
            s16: cute.struct.Align[cute.struct.MemRange[f16, rows * WIDE_STRIDE], 128]
            xb_t: cute.struct.Align[cute.struct.MemRange[f16, rows * NARROW_STRIDE], 128]
            cum_log_g: cute.struct.Align[cute.struct.MemRange[f32, CHUNK], 16]
            beta: cute.struct.Align[cute.struct.MemRange[f32, CHUNK], 16]

        kernel = self.value_kernel(
            q, k, v, state, a, b, cu_seqlens, scale, has_state, output, new_state, ws_tp, ws_g,
            tiled_mma, SharedStorage,
        )  # fmt: skip
        self.launch_grid(kernel, [NUM_V_HEADS * self.num_slices, new_state.shape[0], 1], SharedStorage, stream)

    @cute.jit
    def load_squares(self, g2s16: cute.CopyAtom, ws_tp: cute.Tensor, slot, head, which: cutlass.Constexpr, dst, tidx):
        """cp.async of the workspace's T (`which` 0) or P (1) of (slot, head) into `dst` (a padded 64 x 64)."""
        for i in cutlass.range_constexpr(CHUNK * SQUARE_PIECES // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            row = linear // SQUARE_PIECES
            piece = linear % SQUARE_PIECES
            cute.copy(
                g2s16,
                cute.local_tile(ws_tp[slot, head, which, row, None], (COPY_ELEMS,), (piece,)),
                cute.local_tile(dst[row, None], (COPY_ELEMS,), (piece,)),
            )

    @cute.jit
    def load_gates(self, g2s32: cute.CopyAtom, ws_g: cute.Tensor, slot, head, cum_log_g, beta, tidx):
        """cp.async of the workspace's G and beta of (slot, head) (threads 0..31, 16 B each)."""
        if tidx < GATE_PIECES:
            cute.copy(
                g2s32,
                cute.local_tile(ws_g[slot, head, 0, None], (4,), (tidx,)),
                cute.local_tile(cum_log_g, (4,), (tidx,)),
            )
        elif tidx < 2 * GATE_PIECES:
            cute.copy(
                g2s32,
                cute.local_tile(ws_g[slot, head, 1, None], (4,), (tidx - GATE_PIECES,)),
                cute.local_tile(beta, (4,), (tidx - GATE_PIECES,)),
            )

    @cute.kernel
    def value_kernel(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        state: cute.Tensor,
        a: cute.Tensor,
        b: cute.Tensor,
        cu_seqlens: cute.Tensor,
        scale: cutlass.Float32,
        has_state: cutlass.Int32,
        output: cute.Tensor,
        new_state: cute.Tensor,
        ws_tp: cute.Tensor,
        ws_g: cute.Tensor,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, block_y, head, slice_idx, v0, warp_idx, lane = self.slice_coordinates()
        rows = self.slice_rows

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(SharedStorage)
        s16 = st.s16.get_tensor(self.state16_layout())
        # s16 is first written in chunk 0's P0, so the ranking may use it as scratch.
        seq = self.sequence_of_block(cu_seqlens, block_y, new_state.shape[0], tidx, s16)
        total_tokens = cutlass.Int32(q.shape[0])
        start, length = sequence_bounds(cu_seqlens, seq, total_tokens)
        num_chunks = (length + CHUNK - 1) // CHUNK

        raw_k, raw_a, raw_b, kq, kq_raw = self.staging_views(st)
        raw_v = st.raw_v.get_tensor(self.raw_v_layout())
        kq_t = cute.make_tensor(kq.iterator, _layout(KQ_T_VIEW))
        a16 = st.a16.get_tensor(_layout(SQUARE_VIEW))
        t16 = st.t16.get_tensor(_layout(SQUARE_VIEW))
        p16_pair = st.p16.get_tensor(
            cute.make_layout((2, CHUNK, CHUNK), stride=(CHUNK * NARROW_STRIDE, NARROW_STRIDE, 1))
        )
        # Xb^T, V'^T and V'c^T: [rows, 64] (V'^T and V'c^T in a16's storage, which holds 2 x 32 such rows).
        xb_t = st.xb_t.get_tensor(self.slice_by_token_layout())
        vn_t = cute.make_tensor(a16.iterator, self.slice_by_token_layout())
        vnc_t = cute.make_tensor(a16.iterator + rows * NARROW_STRIDE, self.slice_by_token_layout())
        cum_log_g = st.cum_log_g.get_tensor(cute.make_layout(CHUNK))
        beta = st.beta.get_tensor(cute.make_layout(CHUNK))

        copy_a, copy_b, copy_bt = _make_operand_copies(tiled_mma)
        thr_mma = tiled_mma.get_slice(lane)
        coords_rows = thr_mma.partition_C(cute.make_identity_tensor((BLOCK, rows)))
        coords_state = thr_mma.partition_C(cute.make_identity_tensor((rows, STATE_COLS_PER_WARP)))
        acc_state = self.load_state_slice(thr_mma, state, seq, head, slice_idx, warp_idx, has_state, length)

        g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.BFloat16, num_bits_per_copy=128
        )
        g2s16 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Float16, num_bits_per_copy=128
        )
        g2s32 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Float32, num_bits_per_copy=128
        )
        if num_chunks > 0:
            slot0 = chunk_slot(start, 0, seq)
            self.load_chunk(g2s, k, v, a, b, raw_k, raw_v, raw_a, raw_b, start, length, 0, 0, head, v0, tidx)
            self.load_q(g2s, q, kq_raw, start, length, 0, head, tidx)
            self.load_squares(g2s16, ws_tp, slot0, head, 0, t16, tidx)
            self.load_squares(g2s16, ws_tp, slot0, head, 1, p16_pair[0, None, None], tidx)
            self.load_gates(g2s32, ws_g, slot0, head, cum_log_g, beta, tidx)
        cute.arch.cp_async_commit_group()

        acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK, rows)), cutlass.Float32)
        acc_y = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK, rows)), cutlass.Float32)

        for chunk in cutlass.range(num_chunks, unroll=1):
            stage = chunk % NUM_STAGES
            chunk_start = chunk * CHUNK
            tokens_here = cutlass.min(length - chunk_start, cutlass.Int32(CHUNK))
            next_slot = chunk_slot(start, chunk + 1, seq)

            # ---- P0: every load of this chunk landed; k and q rows to fp16; the fp16 state copy ----
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            self.convert_kq(raw_k, kq_raw, kq, tokens_here, tidx)
            for e in cutlass.range_constexpr(cute.size(acc_state)):
                s16[coords_state[e][0], warp_idx * STATE_COLS_PER_WARP + coords_state[e][1]] = acc_state[e].to(
                    cutlass.Float16
                )
            cute.arch.sync_threads()

            # ---- P1: prefetch the next chunk's rows and P; K S0^T -> Xb^T; Q S0^T ----
            if chunk + 1 < num_chunks:
                self.load_chunk(
                    g2s, k, v, a, b, raw_k, raw_v, raw_a, raw_b, start, length,
                    chunk + 1, (chunk + 1) % NUM_STAGES, head, v0, tidx,
                )  # fmt: skip
                self.load_squares(g2s16, ws_tp, next_slot, head, 1, p16_pair[(chunk + 1) % 2, None, None], tidx)
            cute.arch.cp_async_commit_group()
            self.state_products(
                tiled_mma, copy_a, copy_b, lane, warp_idx, kq, s16, acc_y, acc_o, coords_rows, cum_log_g, beta,
                raw_v, stage, tokens_here, xb_t,
            )  # fmt: skip
            cute.arch.sync_threads()

            # ---- the next chunk's q rows (kq's q half is dead after P1) ----
            if chunk + 1 < num_chunks:
                self.load_q(g2s, q, kq_raw, start, length, chunk + 1, head, tidx)
            cute.arch.cp_async_commit_group()

            # ---- P5: V' = T Xb ----
            g_last = cum_log_g[CHUNK - 1]
            self.new_values(
                tiled_mma, copy_a, copy_b, lane, warp_idx, t16, xb_t, acc_y, coords_rows, cum_log_g, g_last, vn_t, vnc_t
            )
            cute.arch.sync_threads()

            # ---- the next chunk's T, G and beta (no reader of t16, cum_log_g or beta is left in this chunk) ----
            if chunk + 1 < num_chunks:
                self.load_squares(g2s16, ws_tp, next_slot, head, 0, t16, tidx)
                self.load_gates(g2s32, ws_g, next_slot, head, cum_log_g, beta, tidx)
            cute.arch.cp_async_commit_group()

            # ---- P6: O = exp(G) Q S0^T + P V'; S = exp(G_last) S + V'c^T K ----
            self.output_and_carry(
                tiled_mma, copy_a, copy_b, copy_bt, lane, warp_idx, p16_pair[chunk % 2, None, None], vn_t, vnc_t, kq_t,
                acc_o, acc_state, coords_rows, g_last, tokens_here, output, start, chunk_start, head, v0, scale,
            )  # fmt: skip

        cute.autovec_copy(acc_state, thr_mma.partition_C(self.state_tile(new_state, seq, head, slice_idx, warp_idx)))


@dataclass(frozen=True)
class WyPrepassConfig:
    """What changes the compiled code of this path (the compile cache's key with the architecture)."""

    slice_rows: int  # V rows per chain CTA: WIDE_SLICE_ROWS or NARROW_SLICE_ROWS


class GdnPrefillWyPrepassSm90:
    """Host entry: the key-side kernel, then the value-side chain (`chain`), in one compiled call (stream
    order)."""

    def __init__(self, config: WyPrepassConfig):
        self.config = config

    def chain(self):
        """The value-side kernel that reads the workspace (`wgmma_value_side.py` gives its own)."""
        return _ValueSide(self.config.slice_rows)

    def key_side(self) -> _KeySide:
        """The key-side kernel that fills it, as `chain` reads it (unpaired for `_ValueSide`)."""
        return _KeySide()

    @cute.jit
    def __call__(
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
        ws_tp: cute.Tensor,
        ws_g: cute.Tensor,
        stream,
    ):
        self.key_side().launch(q, k, A_log, a, dt_bias, b, cu_seqlens, ws_tp, ws_g, stream)
        self.chain().launch(
            q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state, ws_tp, ws_g, stream
        )


def _workspace_stand_ins() -> tuple:
    slots = cute.sym_int()

    def rowmajor(dtype, shape):
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=16)

    return (
        rowmajor(cutlass.Float16, (slots, NUM_V_HEADS, TP_PLANES, CHUNK, CHUNK)),
        rowmajor(cutlass.Float32, (slots, NUM_V_HEADS, 2, CHUNK)),
    )


_COMPILED: dict[tuple[str, WyPrepassConfig], Callable] = {}


def compiled_for(arch: str, config: WyPrepassConfig) -> Callable:
    """The compiled two-kernel launcher for `arch` and `config` (compiled on first use; needs no GPU)."""
    key = (arch, config)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = token_serial.compile_launcher(
            GdnPrefillWyPrepassSm90(config), arch, _workspace_stand_ins()
        )
    return fn


def config_for(num_seqs: int) -> WyPrepassConfig:
    """This path's configuration for a batch of `num_seqs` sequences: the chain's width."""
    return WyPrepassConfig(NARROW_SLICE_ROWS if num_seqs <= NARROW_MAX_SEQS else WIDE_SLICE_ROWS)


CONFIGS = (WyPrepassConfig(NARROW_SLICE_ROWS), WyPrepassConfig(WIDE_SLICE_ROWS))  # every one `config_for` returns


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """Both widths' launchers for `arch`, without a GPU (for CI and warm-up: no call compiles lazily afterwards)."""
    return tuple(compiled_for(arch, config) for config in CONFIGS)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.py`'s contract: fills `output` [T,8,128] bf16 and `new_state` [N,8,128,128] fp32; `state` None
    means zeros; `scale` None or 0 means 1/sqrt(128). The two kernels on the current stream, the chain's width
    from N; no device reads, no host synchronisation. Correct at any T (`kernel.py` takes it for long
    sequences)."""
    run_with_config(
        config_for(new_state.shape[0]), q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state
    )


def run_with_config(config: WyPrepassConfig, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state):
    """`run` with a given configuration (the tests run every one; candidates pass their own)."""
    token_serial.check_inputs(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, output, new_state)
    run_compiled(compiled_for(GPU_ARCH, config), q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)


def run_compiled(launcher: Callable, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """Call a compiled launcher of this path's form (checked inputs) with its per-call workspaces."""
    num_seqs = new_state.shape[0]
    if num_seqs == 0:
        return
    slots = num_chunk_slots(q.shape[0], num_seqs)
    ws_tp = torch.empty((slots, NUM_V_HEADS, TP_PLANES, CHUNK, CHUNK), dtype=torch.float16, device=q.device)
    ws_g = torch.empty((slots, NUM_V_HEADS, 2, CHUNK), dtype=torch.float32, device=q.device)
    has_state = state is not None
    launcher(
        q, k, v, state if has_state else new_state, A_log, a, dt_bias, b, cu_seqlens, resolve_scale(scale),
        int(has_state), output, new_state, ws_tp, ws_g,
    )  # fmt: skip
