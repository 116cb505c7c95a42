"""GDN prefill for SM90 in CuTe-DSL, token-serial recurrence: the path `kernel.py` takes for short
batches (up to TOKEN_SERIAL_MAX_TOKENS tokens), where one launch that steps token by token beats a
64-token chunk step.

The value rows of a head's state evolve independently (state S is [V, K], k-last), so one CTA owns a
[8, 128] slice of one (sequence, v-head) state and steps through the sequence token by token:

- Grid (8 v-heads x 16 slices, N sequences): x = head * 16 + slice, y = sequence. N comes from the
  shape of `new_state`; each CTA reads its own bounds from `cu_seqlens` on the device.
- 128 threads. Sixteen consecutive lanes share one state row (V index); lane p of the sixteen holds
  the K columns [8p, 8p + 8) (8 fp32 registers), so a 16-B shared-memory load of k or q by 16 lanes
  covers 256 contiguous bytes (no bank conflicts). Reductions over K are four butterfly shuffles
  inside the 16-lane group; no block-wide reduction per token. This split of the rows is the kernel
  class's `SPLIT` (a `RowSplit`). Against 8 lanes per row (16 rows per CTA, 16 columns per lane,
  three shuffle levels), 16 lanes cut a warp's instructions per token by a third (~115 against ~175
  in SASS), shorten the dependent FMAs of each dot product and give one sequence 128 CTAs instead
  of 64 (NOTES.md; the loop stays bound by its dependency chain, one warp per scheduler).
- Tokens are staged through shared memory in chunks of 32 with `cp.async` (double-buffered: chunk
  c + 1 is in flight while chunk c is computed): the q and k rows of the head's q/k head (h // 2),
  the 8 values of v in this slice, and the whole 8-head rows of a and b (16 B each, so that every
  copy is an aligned 16-B `cp.async`). At the start of each chunk one thread per token computes the
  gates g and beta in fp32 and shares them through shared memory.
- Per token, in fp32, with the old state S (one pass over the registers):
      u  = S k,  w = S q,  kq = k . q        (partial dots, then 4 butterfly levels for all three)
      delta = beta * (v - g u)               (= beta * (v - (g S) k))
      o  = scale * (g w + delta kq)          (= scale * S_new q, S_new = g S + delta k^T)
      S  = g S + delta k^T
  This is the definition's S <- g S; S <- S + beta (v - S k) k^T; o = scale S q, regrouped so that
  both reductions read the same (old) registers and run in parallel.
- The final state slice goes to `new_state` (16-B vector stores). A sequence of length 0 writes
  zeros, as the definition does, even when an initial state is given. Without an initial state the
  kernel gets `new_state` as a placeholder for `state` and a flag that it never reads it.

Everything is compiled once (dynamic T and N) into one TVM-FFI function that takes the torch tensors
and runs on the current torch stream. `run` only validates shapes (host metadata, no device reads)
and calls it. The per-sequence loop (`_Recurrence.process_sequence`) is the part the chunked
tensor-core kernel (chunked.py) replaces; it reuses this module's host launcher and kernel class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

NUM_QK_HEADS = 4
NUM_V_HEADS = 8
HEAD_SIZE = 128  # K = V = 128
V_HEADS_PER_QK_HEAD = NUM_V_HEADS // NUM_QK_HEADS

NUM_THREADS = 128
COPY_ELEMS = 8  # bf16 elements per 16-B cp.async; a lane's K columns come in pieces of this width
DOT_CHAINS = 4  # independent accumulators per per-lane dot product
CHUNK = 32  # tokens staged per cp.async stage
NUM_STAGES = 2
SOFTPLUS_THRESHOLD = 20.0  # torch's softplus returns x above this

GPU_ARCH = "sm_90a"
# Element offsets are 32-bit: v and output have T * 1024 elements.
MAX_TOKENS = (2**31 - 1) // (NUM_V_HEADS * HEAD_SIZE)
# State offsets are 32-bit too (N * 8 * 128 * 128 elements); also below the grid.y limit of 65535.
MAX_SEQS = (2**31 - 1) // (NUM_V_HEADS * HEAD_SIZE * HEAD_SIZE)

assert CHUNK <= NUM_THREADS  # one gate thread per token
assert CHUNK * (HEAD_SIZE // COPY_ELEMS) % NUM_THREADS == 0  # stage_chunk: whole rounds of q/k pieces


@dataclass(frozen=True)
class RowSplit:
    """How a CTA's 128 threads share its V-slice: `lanes_per_row` consecutive lanes hold one state
    row (V index), so the reductions over K stay inside them; lane p holds the 8-wide column pieces
    p, p + lanes_per_row, ... (in units of 8 columns), so that the lanes of a row read 16-B pieces of
    a k or q row side by side."""

    lanes_per_row: int

    def __post_init__(self) -> None:
        assert HEAD_SIZE % (self.lanes_per_row * COPY_ELEMS) == 0 and NUM_THREADS % self.lanes_per_row == 0
        assert self.rows_per_cta % COPY_ELEMS == 0
        # stage_chunk: at most one v, a or b piece per thread.
        assert (self.rows_per_cta // COPY_ELEMS + 2) * CHUNK <= NUM_THREADS

    @property
    def rows_per_cta(self) -> int:  # the V-slice of one CTA
        return NUM_THREADS // self.lanes_per_row

    @property
    def num_slices(self) -> int:  # CTAs per (sequence, head)
        return HEAD_SIZE // self.rows_per_cta

    @property
    def cols_per_lane(self) -> int:  # state registers per thread
        return HEAD_SIZE // self.lanes_per_row

    @property
    def pieces_per_lane(self) -> int:
        return self.cols_per_lane // COPY_ELEMS

    def column_piece(self, piece: int, lane_in_row):
        """Index (in 8-column pieces of a 128-wide row) of piece `piece` of lane `lane_in_row`."""
        return piece * self.lanes_per_row + lane_in_row


# 16 lanes per row, 8 rows per CTA, 16 CTAs per (sequence, head); each lane holds [8p, 8p + 8).
# (With 8 lanes per row a lane would hold [8p, 8p + 8) and [64 + 8p, 64 + 8p + 8).)
NARROW_SPLIT = RowSplit(lanes_per_row=16)


class GdnShapeError(ValueError):
    """An input does not have the shape, dtype or layout of the definition."""


class _Recurrence:
    """The kernel: one CTA = one (sequence, v-head, V-slice of SPLIT.rows_per_cta rows); see the module
    docstring."""

    SPLIT = NARROW_SPLIT  # a candidate's subclass may split the rows otherwise

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
        sqk_layout = cute.make_layout((NUM_STAGES, CHUNK, HEAD_SIZE), stride=(CHUNK * HEAD_SIZE, HEAD_SIZE, 1))
        rows = self.SPLIT.rows_per_cta
        sv_layout = cute.make_layout((NUM_STAGES, CHUNK, rows), stride=(CHUNK * rows, rows, 1))
        sab_layout = cute.make_layout((NUM_STAGES, CHUNK, NUM_V_HEADS), stride=(CHUNK * NUM_V_HEADS, NUM_V_HEADS, 1))
        sgate_layout = cute.make_layout((NUM_STAGES, CHUNK), stride=(CHUNK, 1))

        @cute.struct
        class SharedStorage:
            sq: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, NUM_STAGES * CHUNK * HEAD_SIZE], 128]
            sk: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, NUM_STAGES * CHUNK * HEAD_SIZE], 128]
            sv: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, NUM_STAGES * CHUNK * rows], 128]
            sa: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, NUM_STAGES * CHUNK * NUM_V_HEADS], 128]
            sb: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, NUM_STAGES * CHUNK * NUM_V_HEADS], 128]
            sg: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, NUM_STAGES * CHUNK], 16]
            sbeta: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, NUM_STAGES * CHUNK], 16]

        self.kernel(
            q,
            k,
            v,
            state,
            A_log,
            a,
            dt_bias,
            b,
            cu_seqlens,
            scale,
            has_state,
            output,
            new_state,
            sqk_layout,
            sv_layout,
            sab_layout,
            sgate_layout,
            SharedStorage,
        ).launch(
            grid=[NUM_V_HEADS * self.SPLIT.num_slices, new_state.shape[0], 1],
            block=[NUM_THREADS, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
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
        sqk_layout: cute.Layout,
        sv_layout: cute.Layout,
        sab_layout: cute.Layout,
        sgate_layout: cute.Layout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        head_slice, seq, _ = cute.arch.block_idx()
        split = self.SPLIT
        head = head_slice // split.num_slices
        v_row = (head_slice % split.num_slices) * split.rows_per_cta + tidx // split.lanes_per_row
        lane_in_row = tidx % split.lanes_per_row

        # Sequence bounds, clamped to [0, T] so that malformed cu_seqlens cannot read out of bounds.
        total_tokens = cutlass.Int32(q.shape[0])
        start = cutlass.Int32(cu_seqlens[seq])
        end = cutlass.Int32(cu_seqlens[seq + 1])
        start = cutlass.min(cutlass.max(start, cutlass.Int32(0)), total_tokens)
        end = cutlass.min(cutlass.max(end, start), total_tokens)
        length = end - start

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sq = storage.sq.get_tensor(sqk_layout)
        sk = storage.sk.get_tensor(sqk_layout)
        sv = storage.sv.get_tensor(sv_layout)
        sa = storage.sa.get_tensor(sab_layout)
        sb = storage.sb.get_tensor(sab_layout)
        sg = storage.sg.get_tensor(sgate_layout)
        sbeta = storage.sbeta.get_tensor(sgate_layout)

        # ---- initial state slice: this thread's columns of row v_row ----
        s_reg = cute.make_rmem_tensor((split.cols_per_lane,), cutlass.Float32)
        s_reg.fill(0.0)
        if has_state != 0 and length > 0:
            state_row = state[seq, head, v_row, None]
            for piece in cutlass.range_constexpr(split.pieces_per_lane):
                cute.autovec_copy(
                    self.lane_piece(state_row, lane_in_row, piece),
                    cute.local_tile(s_reg, (COPY_ELEMS,), (piece,)),
                )

        self.process_sequence(
            q, k, v, a, b, A_log, dt_bias, scale, output, sq, sk, sv, sa, sb, sg, sbeta,
            s_reg, start, length, head, v_row, lane_in_row, tidx,
        )  # fmt: skip

        # ---- final state slice ----
        out_row = new_state[seq, head, v_row, None]
        for piece in cutlass.range_constexpr(split.pieces_per_lane):
            cute.autovec_copy(
                cute.local_tile(s_reg, (COPY_ELEMS,), (piece,)),
                self.lane_piece(out_row, lane_in_row, piece),
            )

    @cute.jit
    def process_sequence(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        a: cute.Tensor,
        b: cute.Tensor,
        A_log: cute.Tensor,
        dt_bias: cute.Tensor,
        scale: cutlass.Float32,
        output: cute.Tensor,
        sq: cute.Tensor,
        sk: cute.Tensor,
        sv: cute.Tensor,
        sa: cute.Tensor,
        sb: cute.Tensor,
        sg: cute.Tensor,
        sbeta: cute.Tensor,
        s_reg: cute.Tensor,
        start: cutlass.Int32,
        length: cutlass.Int32,
        head: cutlass.Int32,
        v_row: cutlass.Int32,
        lane_in_row: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        """Advance this thread's state registers over the sequence and write its outputs."""
        g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            cutlass.BFloat16,
            num_bits_per_copy=128,
        )
        neg_decay_rate = -cute.math.exp(A_log[head])
        bias = dt_bias[head]
        row_in_slice = tidx // self.SPLIT.lanes_per_row
        slice_v0 = v_row - row_in_slice
        num_chunks = (length + CHUNK - 1) // CHUNK

        if num_chunks > 0:
            self.stage_chunk(g2s, q, k, v, a, b, sq, sk, sv, sa, sb, start, length, 0, 0, head, slice_v0, tidx)
        cute.arch.cp_async_commit_group()

        for chunk in cutlass.range(num_chunks, unroll=1):
            stage = chunk % NUM_STAGES
            # Prefetch the next chunk into the other stage; its readers finished at the barrier
            # that ended the previous iteration.
            if chunk + 1 < num_chunks:
                self.stage_chunk(
                    g2s, q, k, v, a, b, sq, sk, sv, sa, sb, start, length,
                    chunk + 1, (chunk + 1) % NUM_STAGES, head, slice_v0, tidx,
                )  # fmt: skip
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)  # everything but the prefetch has landed
            cute.arch.sync_threads()

            chunk_start = chunk * CHUNK
            tokens_here = cutlass.min(length - chunk_start, cutlass.Int32(CHUNK))
            # ---- gates of this chunk: one thread per token ----
            if tidx < tokens_here:
                x = sa[stage, tidx, head].to(cutlass.Float32) + bias
                softplus = x if x > SOFTPLUS_THRESHOLD else cute.math.log1p(cute.math.exp(x))
                sg[stage, tidx] = cute.math.exp(neg_decay_rate * softplus)
                sbeta[stage, tidx] = cutlass.Float32(1.0) / (
                    cutlass.Float32(1.0) + cute.math.exp(-sb[stage, tidx, head].to(cutlass.Float32))
                )
            cute.arch.sync_threads()

            self.advance_chunk(
                sq, sk, sv, sg, sbeta, stage, tokens_here, s_reg, scale, output,
                start + chunk_start, head, v_row, row_in_slice, lane_in_row,
            )  # fmt: skip
            # The next iteration prefetches into the stage just read.
            cute.arch.sync_threads()

    @cute.jit
    def advance_chunk(
        self,
        sq: cute.Tensor,
        sk: cute.Tensor,
        sv: cute.Tensor,
        sg: cute.Tensor,
        sbeta: cute.Tensor,
        stage: cutlass.Int32,
        tokens_here: cutlass.Int32,
        s_reg: cute.Tensor,
        scale: cutlass.Float32,
        output: cute.Tensor,
        first_token: cutlass.Int32,
        head: cutlass.Int32,
        v_row: cutlass.Int32,
        row_in_slice: cutlass.Int32,
        lane_in_row: cutlass.Int32,
    ):
        """The recurrence over the `tokens_here` staged tokens of one chunk (gates in sg, sbeta),
        token `first_token` + j of the batch at slot j: this thread's state registers advance and
        lane 0 of each row writes the row's outputs (a candidate may regroup the tokens)."""
        k_reg = cute.make_rmem_tensor((self.SPLIT.cols_per_lane,), cutlass.Float32)
        q_reg = cute.make_rmem_tensor((self.SPLIT.cols_per_lane,), cutlass.Float32)
        for j in cutlass.range(tokens_here, unroll=2):
            self.advance_token(
                sq, sk, sv, sg, sbeta, stage, j, s_reg, k_reg, q_reg, scale, output,
                first_token, head, v_row, row_in_slice, lane_in_row,
            )  # fmt: skip

    @cute.jit
    def advance_token(
        self,
        sq: cute.Tensor,
        sk: cute.Tensor,
        sv: cute.Tensor,
        sg: cute.Tensor,
        sbeta: cute.Tensor,
        stage: cutlass.Int32,
        j: cutlass.Int32,
        s_reg: cute.Tensor,
        k_reg: cute.Tensor,
        q_reg: cute.Tensor,
        scale: cutlass.Float32,
        output: cute.Tensor,
        first_token: cutlass.Int32,
        head: cutlass.Int32,
        v_row: cutlass.Int32,
        row_in_slice: cutlass.Int32,
        lane_in_row: cutlass.Int32,
    ):
        """One token (slot j of the stage) of the recurrence; k_reg and q_reg are scratch."""
        self.load_lane_columns(sk[stage, j, None], k_reg, lane_in_row)
        self.load_lane_columns(sq[stage, j, None], q_reg, lane_in_row)
        dot_sk = self.row_sum(self.lane_dot(s_reg, k_reg))
        dot_sq = self.row_sum(self.lane_dot(s_reg, q_reg))
        dot_kq = self.row_sum(self.lane_dot(k_reg, q_reg))
        g = sg[stage, j]
        delta = sbeta[stage, j] * (sv[stage, j, row_in_slice].to(cutlass.Float32) - g * dot_sk)
        for i in cutlass.range_constexpr(self.SPLIT.cols_per_lane):
            s_reg[i] = g * s_reg[i] + delta * k_reg[i]
        if lane_in_row == 0:
            out = scale * (g * dot_sq + delta * dot_kq)
            output[first_token + j, head, v_row] = out.to(cutlass.BFloat16)

    @cute.jit
    def stage_chunk(
        self,
        g2s: cute.CopyAtom,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        a: cute.Tensor,
        b: cute.Tensor,
        sq: cute.Tensor,
        sk: cute.Tensor,
        sv: cute.Tensor,
        sa: cute.Tensor,
        sb: cute.Tensor,
        start: cutlass.Int32,
        length: cutlass.Int32,
        chunk: cutlass.Int32,
        stage: cutlass.Int32,
        head: cutlass.Int32,
        slice_v0: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        """Issue the cp.async copies of one chunk's tokens into `stage`; tokens past the end of the
        sequence are skipped (their slots are never read)."""
        qk_head = head // V_HEADS_PER_QK_HEAD
        first = chunk * CHUNK
        row_pieces = HEAD_SIZE // COPY_ELEMS  # 16 pieces of 16 B per q or k row
        for i in cutlass.range_constexpr(CHUNK * row_pieces // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            j = linear // row_pieces
            piece = linear % row_pieces
            if first + j < length:
                token = start + first + j
                cute.copy(
                    g2s,
                    cute.local_tile(q[token, qk_head, None], (COPY_ELEMS,), (piece,)),
                    cute.local_tile(sq[stage, j, None], (COPY_ELEMS,), (piece,)),
                )
                cute.copy(
                    g2s,
                    cute.local_tile(k[token, qk_head, None], (COPY_ELEMS,), (piece,)),
                    cute.local_tile(sk[stage, j, None], (COPY_ELEMS,), (piece,)),
                )
        # v (1 or 2 pieces per token), a and b (1 piece each per token): at most 128 copies.
        v_pieces = self.SPLIT.rows_per_cta // COPY_ELEMS
        j = tidx % CHUNK
        role = tidx // CHUNK
        if first + j < length:
            token = start + first + j
            if role < v_pieces:
                cute.copy(
                    g2s,
                    cute.local_tile(v[token, head, None], (COPY_ELEMS,), (slice_v0 // COPY_ELEMS + role,)),
                    cute.local_tile(sv[stage, j, None], (COPY_ELEMS,), (role,)),
                )
            elif role == v_pieces:
                cute.copy(g2s, a[token, None], sa[stage, j, None])
            elif cutlass.const_expr((v_pieces + 2) * CHUNK == NUM_THREADS) or role == v_pieces + 1:
                # The last role copies b; with fewer v pieces (8-row slices) the spare role copies nothing.
                cute.copy(g2s, b[token, None], sb[stage, j, None])

    @cute.jit
    def lane_piece(self, row: cute.Tensor, lane_in_row: cutlass.Int32, piece: cutlass.Constexpr) -> cute.Tensor:
        """The 8 columns of a 128-wide row that piece `piece` of lane `lane_in_row` holds."""
        return cute.local_tile(row, (COPY_ELEMS,), (self.SPLIT.column_piece(piece, lane_in_row),))

    @cute.jit
    def load_lane_columns(self, row: cute.Tensor, dst: cute.Tensor, lane_in_row: cutlass.Int32):
        """This lane's columns of a bf16 shared-memory row, as fp32 (one 16-B load per piece)."""
        for piece in cutlass.range_constexpr(self.SPLIT.pieces_per_lane):
            values = self.lane_piece(row, lane_in_row, piece).load().to(cutlass.Float32)
            cute.local_tile(dst, (COPY_ELEMS,), (piece,)).store(values)

    @cute.jit
    def lane_dot(self, x: cute.Tensor, y: cute.Tensor) -> cutlass.Float32:
        """x . y over this lane's columns, in DOT_CHAINS independent chains (shorter latency)."""
        partial = [cutlass.Float32(0.0)] * DOT_CHAINS
        for i in cutlass.range_constexpr(self.SPLIT.cols_per_lane):
            partial[i % DOT_CHAINS] = partial[i % DOT_CHAINS] + x[i] * y[i]
        total = partial[0]
        for c in cutlass.range_constexpr(1, DOT_CHAINS):
            total = total + partial[c]
        return total

    @cute.jit
    def row_sum(self, value: cutlass.Float32) -> cutlass.Float32:
        """Sum over the consecutive lanes that share a state row (all of them get the result)."""
        offset = self.SPLIT.lanes_per_row // 2
        while offset > 0:
            value = value + cute.arch.shuffle_sync_bfly(value, offset=offset)
            offset //= 2
        return value


class GdnPrefillSm90:
    """Host entry: one compile serves every T and N. `kernel` is the kernel class it launches with
    `run`'s arguments: this file's token recurrence, chunked.py's kernels, or a candidate of this folder."""

    def __init__(self, kernel: type = _Recurrence) -> None:
        self.kernel = kernel

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
        stream,
    ):
        self.kernel().launch(
            q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state, stream
        )


# ------------------------------------------------------------------------------------------------
# Host side: compile once per architecture, then each call is one TVM-FFI launch.
# ------------------------------------------------------------------------------------------------

_COMPILED: dict[tuple[str, type], Callable] = {}


def compile_launcher(launcher: object, arch: str, extra_args: tuple = (), output_align: int = 2) -> Callable:
    """`cute.compile` of a host launcher taking `run`'s tensors in definition order (then `scale`,
    `has_state`, any `extra_args` stand-ins such as a candidate's workspaces, and the stream): one
    compile for every T and N (symbolic shapes), as a TVM-FFI function on the current torch stream.
    Shared by every GDN kernel of this folder. `output_align`: the bytes `output` is assumed aligned to
    (16 for a kernel that stores it in 16-B pieces; its `run` checks first)."""
    num_tokens = cute.sym_int()
    num_seqs = cute.sym_int()
    num_bounds = cute.sym_int()  # N + 1

    def rowmajor(dtype, shape, align=16):
        # 16-B alignment where the kernel makes vector (cp.async / 128-bit) accesses; element
        # alignment for tensors it reads or writes one element at a time.
        return make_fake_compact_tensor(
            dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=align
        )

    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    state_shape = (num_seqs, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE)
    args = (
        rowmajor(bf16, (num_tokens, NUM_QK_HEADS, HEAD_SIZE)),  # q
        rowmajor(bf16, (num_tokens, NUM_QK_HEADS, HEAD_SIZE)),  # k
        rowmajor(bf16, (num_tokens, NUM_V_HEADS, HEAD_SIZE)),  # v
        rowmajor(f32, state_shape),  # state (new_state stands in when there is none)
        rowmajor(f32, (NUM_V_HEADS,), align=4),  # A_log
        rowmajor(bf16, (num_tokens, NUM_V_HEADS)),  # a
        rowmajor(f32, (NUM_V_HEADS,), align=4),  # dt_bias
        rowmajor(bf16, (num_tokens, NUM_V_HEADS)),  # b
        rowmajor(cutlass.Int64, (num_bounds,), align=8),  # cu_seqlens
        1.0,  # scale
        1,  # has_state
        rowmajor(bf16, (num_tokens, NUM_V_HEADS, HEAD_SIZE), align=output_align),  # output
        rowmajor(f32, state_shape),  # new_state
        *extra_args,
        make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    return cute.compile(launcher, *args, options=f"--enable-tvm-ffi --gpu-arch {arch}")


def compiled_for(arch: str = GPU_ARCH, kernel: type = _Recurrence) -> Callable:
    """The compiled launcher of `kernel` for `arch`: this file's kernel class, chunked.py's, or a
    candidate's subclass of either (compiled on first use; needs no GPU). One cache, keyed on what
    changes the code."""
    fn = _COMPILED.get((arch, kernel))
    if fn is None:
        fn = _COMPILED[(arch, kernel)] = compile_launcher(GdnPrefillSm90(kernel), arch)
    return fn


def compile_only(arch: str = GPU_ARCH) -> Callable:
    """Compile the kernel for `arch` without touching a GPU (for CI and warm-up)."""
    return compiled_for(arch)


def resolve_scale(scale: float | None) -> float:
    """The definition's scale: None or 0 mean 1/sqrt(head_size)."""
    if scale is None or float(scale) == 0.0:
        return 1.0 / math.sqrt(HEAD_SIZE)
    return float(scale)


def check_inputs(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, output, new_state) -> None:
    # One cheap combined test on the hot path; the detailed message only when it fails.
    num_tokens = q.shape[0]
    num_seqs = new_state.shape[0]
    state_shape = (num_seqs, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE)
    expected = [
        ("q", q, (num_tokens, NUM_QK_HEADS, HEAD_SIZE), torch.bfloat16),
        ("k", k, (num_tokens, NUM_QK_HEADS, HEAD_SIZE), torch.bfloat16),
        ("v", v, (num_tokens, NUM_V_HEADS, HEAD_SIZE), torch.bfloat16),
        ("A_log", A_log, (NUM_V_HEADS,), torch.float32),
        ("a", a, (num_tokens, NUM_V_HEADS), torch.bfloat16),
        ("dt_bias", dt_bias, (NUM_V_HEADS,), torch.float32),
        ("b", b, (num_tokens, NUM_V_HEADS), torch.bfloat16),
        ("cu_seqlens", cu_seqlens, (num_seqs + 1,), torch.int64),
        ("output", output, (num_tokens, NUM_V_HEADS, HEAD_SIZE), torch.bfloat16),
        ("new_state", new_state, state_shape, torch.float32),
    ]
    if state is not None:
        expected.append(("state", state, state_shape, torch.float32))
    if not all(t.shape == shape and t.dtype == dtype and t.is_contiguous() for _, t, shape, dtype in expected):
        for name, tensor, shape, dtype in expected:
            if tensor.shape != shape or tensor.dtype != dtype or not tensor.is_contiguous():
                raise GdnShapeError(
                    f"{name} must be a contiguous {dtype} tensor of shape {shape}, "
                    f"got {tensor.dtype} {tuple(tensor.shape)} (contiguous={tensor.is_contiguous()})"
                )
    if num_tokens > MAX_TOKENS:
        raise GdnShapeError(f"total_seq_len {num_tokens} exceeds the kernel's 32-bit addressing limit {MAX_TOKENS}")
    if num_seqs > MAX_SEQS:
        raise GdnShapeError(f"num_seqs {num_seqs} exceeds the kernel's 32-bit addressing limit {MAX_SEQS}")


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """Destination-passing entry: fills `output` [T,8,128] bf16 and `new_state` [N,8,128,128] fp32.

    `state` None means a zero initial state; `scale` None or 0 means 1/sqrt(128). No device reads,
    no host synchronisation: one kernel launch on the current stream."""
    run_kernel(_Recurrence, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)


def run_kernel(kernel: type, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`run` with `kernel` (the kernel class of this file or of chunked.py, or a candidate's subclass)."""
    check_inputs(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, output, new_state)
    if new_state.shape[0] == 0:
        return
    has_state = state is not None
    compiled_for(GPU_ARCH, kernel)(
        q,
        k,
        v,
        state if has_state else new_state,  # a placeholder the kernel never reads
        A_log,
        a,
        dt_bias,
        b,
        cu_seqlens,
        resolve_scale(scale),
        int(has_state),
        output,
        new_state,
    )
