"""GDN prefill candidate v1.6 ("paired tokens"): `kernel.py` with its token-serial path stepping two
tokens per round of reductions, and taken up to 64 tokens instead of 40.

Why: the token-serial kernel costs ~2.6 us plus ~0.19 us (~370 cycles) per token of the longest
sequence, and Kachua's fast path beats it on the short inputs with a state (12-35 tokens: 5.7-6.2 us
against our 6.8-8.8, session 5). Each token waits for the previous one's state update before its
row sums S k and S q can start: a chain of shared-memory loads, 16-term dot products, three
butterfly shuffles and the scalar update, once per token.

Two tokens share one round. With S the state before token 0 of the pair, every reduction the pair
needs reads S or only the keys and queries:

    delta0 = beta0 (v0 - g0 S k0)
    S k1 after token 0   = g0 S k1 + delta0 (k0 . k1)
    delta1 = beta1 (v1 - g1 (g0 S k1 + delta0 (k0 . k1)))
    o0 = scale (g0 S q0 + delta0 (k0 . q0))
    o1 = scale (g1 (g0 S q1 + delta0 (k0 . q1)) + delta1 (k1 . q1))
    S <- g1 g0 S + g1 delta0 k0^T + delta1 k1^T

so the eight row sums (S k0, S q0, S k1, S q1, k0.q0, k0.k1, k0.q1, k1.q1) run together, the
scalar chain is five multiply-adds, and the state registers are updated once per pair. The same
algebra as the definition's S <- g S; S <- S + beta (v - S k) k^T; o = scale S q, regrouped; fp32
throughout. An odd last token of a chunk takes v0's single step.

Prediction: ~0.11 us per token instead of ~0.19 (the chain per pair is about one token's chain
plus the scalar steps), so 30 tokens in ~5.5 us instead of 7.8.
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute

from . import chunked, token_serial
from .token_serial import COLS_PER_LANE, GdnShapeError, resolve_scale

__all__ = ["GdnShapeError", "TOKEN_SERIAL_MAX_TOKENS", "compile_only", "pair_step", "resolve_scale", "run"]

# kernel.py switches to the chunked kernel above 40 tokens. The candidate keeps its token-serial path
# up to 64, so that the A/B rows of 41-64 tokens (paired token steps against one or two chunks of
# v1.4) say where the threshold should go if it is promoted.
TOKEN_SERIAL_MAX_TOKENS = 64


def pair_step(scale, g0, g1, beta0, beta1, v0, v1, s_k0, s_q0, s_k1, s_q1, k0_q0, k0_k1, k0_q1, k1_q1):
    """The scalar part of one pair: (o0, o1, state decay g1 g0, weight of k0, weight of k1), from
    the gates, the two values and the eight row sums, all taken before the pair. Plain arithmetic,
    so that the kernel (DSL values at trace time) and the tests (float64 tensors) run this very code."""
    delta0 = beta0 * (v0 - g0 * s_k0)
    delta1 = beta1 * (v1 - g1 * (g0 * s_k1 + delta0 * k0_k1))
    out0 = scale * (g0 * s_q0 + delta0 * k0_q0)
    out1 = scale * (g1 * (g0 * s_q1 + delta0 * k0_q1) + delta1 * k1_q1)
    return out0, out1, g1 * g0, g1 * delta0, delta1


class _PairedTokens(token_serial._Recurrence):
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
        k0 = cute.make_rmem_tensor((COLS_PER_LANE,), cutlass.Float32)
        q0 = cute.make_rmem_tensor((COLS_PER_LANE,), cutlass.Float32)
        k1 = cute.make_rmem_tensor((COLS_PER_LANE,), cutlass.Float32)
        q1 = cute.make_rmem_tensor((COLS_PER_LANE,), cutlass.Float32)
        for pair in cutlass.range(tokens_here // 2, unroll=1):
            j = 2 * pair
            self.load_lane_columns(sk[stage, j, None], k0, lane_in_row)
            self.load_lane_columns(sq[stage, j, None], q0, lane_in_row)
            self.load_lane_columns(sk[stage, j + 1, None], k1, lane_in_row)
            self.load_lane_columns(sq[stage, j + 1, None], q1, lane_in_row)
            out0, out1, decay, weight0, weight1 = pair_step(
                scale,
                sg[stage, j],
                sg[stage, j + 1],
                sbeta[stage, j],
                sbeta[stage, j + 1],
                sv[stage, j, row_in_slice].to(cutlass.Float32),
                sv[stage, j + 1, row_in_slice].to(cutlass.Float32),
                self.row_sum(self.lane_dot(s_reg, k0)),
                self.row_sum(self.lane_dot(s_reg, q0)),
                self.row_sum(self.lane_dot(s_reg, k1)),
                self.row_sum(self.lane_dot(s_reg, q1)),
                self.row_sum(self.lane_dot(k0, q0)),
                self.row_sum(self.lane_dot(k0, k1)),
                self.row_sum(self.lane_dot(k0, q1)),
                self.row_sum(self.lane_dot(k1, q1)),
            )
            for i in cutlass.range_constexpr(COLS_PER_LANE):
                s_reg[i] = decay * s_reg[i] + weight0 * k0[i] + weight1 * k1[i]
            if lane_in_row == 0:
                output[first_token + j, head, v_row] = out0.to(cutlass.BFloat16)
                output[first_token + j + 1, head, v_row] = out1.to(cutlass.BFloat16)
        if tokens_here % 2 == 1:
            self.advance_token(
                sq, sk, sv, sg, sbeta, stage, tokens_here - 1, s_reg, k0, q0, scale, output,
                first_token, head, v_row, row_in_slice, lane_in_row,
            )  # fmt: skip


def compile_only(arch: str = token_serial.GPU_ARCH) -> tuple[Callable, Callable]:
    """Compile the candidate's token-serial kernel and the chunked one for `arch` without a GPU."""
    return token_serial.compiled_for(arch, _PairedTokens), chunked.compile_only(arch)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.run`'s contract, with this candidate's token-serial kernel up to TOKEN_SERIAL_MAX_TOKENS."""
    if q.shape[0] <= TOKEN_SERIAL_MAX_TOKENS:
        token_serial.run_kernel(_PairedTokens, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
    else:
        chunked.run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
