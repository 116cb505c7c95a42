"""GDN prefill candidate `cand_lookahead`: `token_serial.py`'s recurrence with its row sums one token ahead,
so that each state-dependent reduction spans two tokens of the dependency chain instead of one.

Why (NOTES.md): the token-serial path serves the 21 official workloads of <= 40 tokens at ~0.14 us per token
of the longest sequence, where Kachua's fused recurrence takes ~0.09; under graph replay it is slower than
Kachua on 19 of them. Per token, today's loop waits for the previous token's state update, then reduces
S k over the 16 lanes of a state row (a dot product and four butterfly shuffles, ~130 cycles) before the
token's scalar update can start, and it also reduces k . q, a state-free dot, on every row of every CTA.

With s the state row before token j (s_(j-1)), u_j = s . k_j known, and the state-free dots
kq_j = k_j . q_j and kk_j = k_j . k_(j+1) computed once per chunk by the whole CTA (into the chunk's dead
a rows, `advance_chunk`'s scratch):

    delta_j = beta_j (v_j - g_j u_j)                 (the definition's beta (v - (g S) k))
    o_j     = scale (g_j (s . q_j) + delta_j kq_j)    (= scale S_j q_j)
    u_(j+1) = g_j (s . k_(j+1)) + delta_j kk_j        (= S_j k_(j+1))
    s       = g_j s + delta_j k_j                     (= S_j)

Both row sums of a token (s . q_j, s . k_(j+1)) read the state from before it, so the reduction that feeds
token j + 1 runs while token j's scalars are computed: the loop's dependency chain per token is the short
scalar one plus half a reduction, and each token reduces two dots instead of three. The first token of a
chunk gets u by a direct row sum. The same algebra as the definition's S <- g S; S <- S + beta (v - S k)
k^T; o = scale S q, regrouped; fp32 throughout (`lookahead_step` is the scalar part, shared with its
float64 test).

Everything else (grid, staging, gates, state load and store) is `token_serial._Recurrence`'s.
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute

from . import kernel, token_serial
from .token_serial import CHUNK, GPU_ARCH, HEAD_SIZE, NUM_THREADS, NUM_V_HEADS, GdnShapeError, resolve_scale

__all__ = ["GdnShapeError", "compile_only", "lookahead_step", "resolve_scale", "run", "run_as_kernel"]

# The per-chunk dots: thread t takes token t // DOT_LANES over HEAD_SIZE // DOT_LANES columns.
DOT_LANES = NUM_THREADS // CHUNK
DOT_COLS = HEAD_SIZE // DOT_LANES
assert DOT_LANES * CHUNK == NUM_THREADS and DOT_COLS % token_serial.COPY_ELEMS == 0
assert 2 * CHUNK * 4 <= CHUNK * NUM_V_HEADS * 2  # both dots' fp32 fit a stage of a's bf16 rows


def lookahead_step(scale, g, beta, v, u, s_q, s_k_next, kq, kk):
    """One token's scalars: (output, delta, u of the next token) from its gate, beta and value, u = s . k_j,
    the row sums s . q_j and s . k_(j+1) of the state before it, and kq = k_j . q_j, kk = k_j . k_(j+1).
    Plain arithmetic, so that the kernel (DSL values at trace time) and the tests (float64 tensors) run this
    very code."""
    delta = beta * (v - g * u)
    out = scale * (g * s_q + delta * kq)
    u_next = g * s_k_next + delta * kk
    return out, delta, u_next


class _Lookahead(token_serial._Recurrence):
    """`token_serial._Recurrence` with `advance_chunk` stepping the lookahead recurrence (module docstring)."""

    @cute.jit
    def chunk_dots(self, sq: cute.Tensor, sk: cute.Tensor, sdots: cute.Tensor, stage, tokens_here, tidx):
        """sdots[0, j] = k_j . q_j and sdots[1, j] = k_j . k_(j+1) for the chunk's tokens, over
        the whole CTA (DOT_LANES consecutive lanes per token, then butterfly shuffles among them); kk of the
        chunk's last token is never read and not written."""
        j = tidx // DOT_LANES
        part = tidx % DOT_LANES
        piece = token_serial.COPY_ELEMS
        k_cols = cute.make_rmem_tensor((piece,), cutlass.Float32)
        q_cols = cute.make_rmem_tensor((piece,), cutlass.Float32)
        k_next = cute.make_rmem_tensor((piece,), cutlass.Float32)
        kq = cutlass.Float32(0.0)
        kk = cutlass.Float32(0.0)
        # 16-B pieces of this lane's columns, so that only three pieces are live (not the whole 32 columns).
        for p in cutlass.range_constexpr(DOT_COLS // piece):
            column_piece = part * (DOT_COLS // piece) + p
            k_cols.fill(0.0)
            q_cols.fill(0.0)
            k_next.fill(0.0)
            if j < tokens_here:
                k_cols.store(cute.local_tile(sk[stage, j, None], (piece,), (column_piece,)).load().to(cutlass.Float32))
                q_cols.store(cute.local_tile(sq[stage, j, None], (piece,), (column_piece,)).load().to(cutlass.Float32))
            if j + 1 < tokens_here:
                k_next.store(
                    cute.local_tile(sk[stage, j + 1, None], (piece,), (column_piece,)).load().to(cutlass.Float32)
                )
            kq = kq + self.lane_dot(k_cols, q_cols)
            kk = kk + self.lane_dot(k_cols, k_next)
        offset = DOT_LANES // 2
        while offset > 0:
            kq = kq + cute.arch.shuffle_sync_bfly(kq, offset=offset)
            kk = kk + cute.arch.shuffle_sync_bfly(kk, offset=offset)
            offset //= 2
        if j < tokens_here:
            if part == 0:
                sdots[0, j] = kq
                sdots[1, j] = kk

    @cute.jit
    def advance_chunk(
        self,
        sq: cute.Tensor,
        sk: cute.Tensor,
        sv: cute.Tensor,
        sa: cute.Tensor,
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
        tidx: cutlass.Int32,
    ):
        # The dots go to this stage's a rows (CHUNK x 8 bf16 = 2 x CHUNK fp32), dead once the gates are computed.
        sdots = cute.make_tensor(
            cute.recast_ptr(sa[stage, None, None].iterator, dtype=cutlass.Float32),
            cute.make_layout((2, CHUNK), stride=(CHUNK, 1)),
        )
        self.chunk_dots(sq, sk, sdots, stage, tokens_here, tidx)
        cute.arch.sync_threads()
        cols = self.SPLIT.cols_per_lane
        k_cur = cute.make_rmem_tensor((cols,), cutlass.Float32)
        k_next = cute.make_rmem_tensor((cols,), cutlass.Float32)
        q_reg = cute.make_rmem_tensor((cols,), cutlass.Float32)
        self.load_lane_columns(sk[stage, 0, None], k_cur, lane_in_row)
        u = self.row_sum(self.lane_dot(s_reg, k_cur))
        for j in cutlass.range(tokens_here, unroll=2):
            # The last token's k_(j+1) is a stale row (in bounds); its u is never used: the next chunk
            # starts from a direct row sum.
            self.load_lane_columns(sk[stage, cutlass.min(j + 1, cutlass.Int32(CHUNK - 1)), None], k_next, lane_in_row)
            self.load_lane_columns(sq[stage, j, None], q_reg, lane_in_row)
            s_q = self.row_sum(self.lane_dot(s_reg, q_reg))
            s_k_next = self.row_sum(self.lane_dot(s_reg, k_next))
            g = sg[stage, j]
            out, delta, u = lookahead_step(
                scale, g, sbeta[stage, j], sv[stage, j, row_in_slice].to(cutlass.Float32), u, s_q, s_k_next,
                sdots[0, j], sdots[1, j],
            )  # fmt: skip
            for i in cutlass.range_constexpr(cols):
                s_reg[i] = g * s_reg[i] + delta * k_cur[i]
                k_cur[i] = k_next[i]
            if lane_in_row == 0:
                output[first_token + j, head, v_row] = out.to(cutlass.BFloat16)


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the kernel for `arch` without touching a GPU (for CI and warm-up)."""
    return (token_serial.compiled_for(arch, _Lookahead),)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`token_serial.run`'s contract (correct at any T), with the lookahead recurrence."""
    token_serial.run_kernel(_Lookahead, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)


def run_as_kernel(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.py`'s dispatch with this recurrence as its token-serial path (the candidate side)."""
    path = kernel.path_for(q.shape[0], new_state.shape[0])
    entry = run if path is token_serial else path.run
    entry(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
