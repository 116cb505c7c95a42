"""PyTorch model of the chunked gated delta rule exactly as `chunked.py` computes it.

Per (sequence, v-head), chunks of C = 64 tokens, state S [V, K] (k-last). In a chunk with incoming
state S0, per-token log-decays l_i = log g_i, inclusive cumulative sums G_i (fp32), gates beta_i:

    A  = strict_tril(beta_i exp(G_i - G_j) k_i . k_j)          (decays only for i >= j)
    P  = tril(exp(G_i - G_j) q_i . k_j)                         (diagonal included)
    T  = (I + A)^-1                                             (blocked, see `invert_unit_lower`)
    Xb = beta_i (v_i - exp(G_i) k_i S0^T)                       (the values the state would predict)
    V' = T Xb                                                   (the corrected values)
    O  = scale (exp(G_i) q_i S0^T + P V')
    S  = exp(G_last) S0 + (V' * exp(G_last - G_i))^T K

This is the token recurrence S <- g S; S <- S + beta (v - S k) k^T; o = scale S q unrolled over a
chunk: S_i = exp(G_i) S0 + sum_{j<=i} exp(G_i - G_j) v'_j k_j^T with v'_i = beta_i (v_i - g_i S_{i-1}
k_i), which is the triangular system (I + A) V' = Xb. No quantity divides by a cumulative decay, so
fast decay underflows to zero instead of overflowing. Tokens past the end of a sequence are padded
with k = q = v = 0, log g = 0 and beta = 0, which makes them inert (T is the identity there, G_last
is the last real token's G).

`Precision` says where the kernel rounds: `EXACT` computes everything in float64 (to check the
algebra), `KERNEL` computes in fp32 and rounds every tensor-core operand to fp16 at the points where
the kernel stores it to shared memory (fp16 rather than bf16: 8x finer, and every operand here is
bounded well inside fp16's range for normalised keys). `chunk_step`'s `paired` keeps chosen rounding
points (ROUNDING_POINTS) as hi / lo fp16 pairs, for a study of where the error comes from and what
fixes it (`probes/rounding_points.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

NUM_QK_HEADS = 4
NUM_V_HEADS = 8
HEAD_SIZE = 128
CHUNK = 64
BLOCK = 16  # diagonal blocks of T inverted directly; the rest by two doubling levels
# Rounding points `chunk_step` can keep as hi / lo pairs: "T" the whole inverse (its operands,
# intermediates and result), "state" S0 as the products' operand, "Xb" the values the state predicts, "Vc"
# V' carried into the state update.
ROUNDING_POINTS = frozenset({"T", "state", "Xb", "Vc"})


def check_rounding_points(points: frozenset[str]) -> None:
    """ValueError naming any of `points` that is not one of ROUNDING_POINTS."""
    if not points <= ROUNDING_POINTS:
        raise ValueError(f"unknown rounding points {sorted(points - ROUNDING_POINTS)}; known: {sorted(ROUNDING_POINTS)}")


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype  # accumulation and element-wise math
    operand: torch.dtype | None  # tensor-core operands are rounded to this; None = no rounding
    # An operand as a hi / lo pair of `operand` values (x ~ hi + lo, two MMAs where one took x): what a
    # kernel computes where one rounding costs too much accuracy.
    pairs: bool = False

    def round(self, x: torch.Tensor) -> torch.Tensor:
        if self.operand is None:
            return x
        hi = x.to(self.operand).to(self.compute)
        if not self.pairs:
            return hi
        return hi + (x - hi).to(self.operand).to(self.compute)


EXACT = Precision(torch.float64, None)
KERNEL = Precision(torch.float32, torch.float16)


def resolve_scale(scale: float | None) -> float:
    if scale is None or float(scale) == 0.0:
        return 1.0 / math.sqrt(HEAD_SIZE)
    return float(scale)


def gates(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log g and beta [T, 8] in fp32, as the kernel computes them (softplus linear above 20)."""
    x = a.float() + dt_bias.float()
    softplus = torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))
    log_g = -torch.exp(A_log.float()) * softplus
    beta = torch.sigmoid(b.float())
    return log_g, beta


def invert_unit_lower(A: torch.Tensor, precision: Precision) -> torch.Tensor:
    """T = (I + A)^-1 for strictly lower-triangular A [..., 64, 64], blocked as in the kernel.

    The four 16x16 diagonal blocks are solved directly (forward substitution, unrounded); then
    [[T00, 0], [T10, T11]] with T10 = -T11 A10 T00 for the pairs (1, 0) and (3, 2), and the same
    formula once more for the 32x32 halves. Each product takes rounded operands and its
    intermediate (T_ii A_ij) is rounded, as the kernel keeps it in shared memory."""
    rnd = precision.round
    n = A.shape[-1]
    eye = torch.eye(BLOCK, dtype=A.dtype, device=A.device)
    T = torch.zeros_like(A)
    for blk in range(n // BLOCK):
        s = slice(blk * BLOCK, (blk + 1) * BLOCK)
        T[..., s, s] = rnd(torch.linalg.solve_triangular(eye + A[..., s, s], eye.expand_as(A[..., s, s]), upper=False))
    A_r = rnd(A)
    for size in (BLOCK, 2 * BLOCK):
        for top in range(0, n, 2 * size):
            lo, hi = slice(top, top + size), slice(top + size, top + 2 * size)
            x = rnd(T[..., hi, hi] @ A_r[..., hi, lo])
            T[..., hi, lo] = rnd(-(x @ T[..., lo, lo]))
    return T


@dataclass(frozen=True)
class KeySide:
    """What a chunk needs that does not depend on the state or the values: the rounded keys and
    queries, the cumulative log-decays G [H, C], P and T [H, C, C]."""

    k_r: torch.Tensor
    q_r: torch.Tensor
    G: torch.Tensor
    P: torch.Tensor
    T: torch.Tensor


def key_side(
    q: torch.Tensor, k: torch.Tensor, log_g: torch.Tensor, beta: torch.Tensor, precision: Precision,
    paired_inverse: bool = False,
) -> KeySide:
    """`paired_inverse`: T computed and kept on hi / lo pairs (the rest as `precision` rounds it)."""
    rnd = precision.round
    c = q.shape[-2]
    G = torch.cumsum(log_g, dim=-1)
    diff = G[..., :, None] - G[..., None, :]
    incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    strict = incl.tril(-1)
    decay = torch.where(incl, torch.exp(torch.where(incl, diff, torch.zeros_like(diff))), torch.zeros_like(diff))
    k_r, q_r = rnd(k), rnd(q)
    kk = k_r @ k_r.transpose(-1, -2)
    qk = q_r @ k_r.transpose(-1, -2)
    A = torch.where(strict, beta[..., :, None] * decay * kk, torch.zeros_like(kk))
    P = rnd(decay * qk)
    inverse = replace(precision, pairs=True) if paired_inverse else precision
    return KeySide(k_r, q_r, G, P, invert_unit_lower(A, inverse))


def chunk_step(
    S0: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    precision: Precision,
    paired: frozenset[str] = frozenset(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk for all heads: S0 [H, V, K], q/k [H, C, K], v [H, C, V], log_g/beta [H, C] (padded
    tokens zero). Returns (O [H, C, V], S_next [H, V, K]) in the compute dtype. `paired`: rounding
    points (ROUNDING_POINTS) kept as hi / lo pairs of the operand dtype."""
    check_rounding_points(paired)
    rnd = precision.round
    pair = replace(precision, pairs=True).round

    def at(point: str, x: torch.Tensor) -> torch.Tensor:
        return pair(x) if point in paired else rnd(x)

    ks = key_side(q, k, log_g, beta, precision, paired_inverse="T" in paired)
    k_r, q_r, G, P, T = ks.k_r, ks.q_r, ks.G, ks.P, ks.T

    S0_r = at("state", S0)
    y_k = k_r @ S0_r.transpose(-1, -2)  # [H, C, V]
    y_q = q_r @ S0_r.transpose(-1, -2)
    decay_in = torch.exp(G)[..., None]
    Xb = at("Xb", beta[..., None] * (v - decay_in * y_k))
    V_new = T @ Xb
    out = scale * (decay_in * y_q + P @ rnd(V_new))
    g_last = G[..., -1:]
    V_carry = at("Vc", V_new * torch.exp(g_last - G)[..., None])
    S_next = torch.exp(g_last)[..., None] * S0 + V_carry.transpose(-1, -2) @ k_r
    return out, S_next


# ------------------------------------------------------------------------------------------------
# The two-level form (a model only; no kernel of this folder computes it, NOTES.md): everything that
# does not depend on the incoming state is computed for all chunks at once by a parallel prepass,
#     U = T diag(beta) V,   W = T diag(beta exp(G)) K      (so that V' = U - W S0^T),
# stored rounded (fp16) with P; the sequential pass per chunk is then only
#     V' = U - W S0^T,   O = scale (exp(G) Q S0^T + P V'),   S = exp(G_last) S0 + (V' exp(G_last - G))^T K.
# Same algebra as `chunk_step` (V' = T Xb with Xb = beta (V - exp(G) K S0^T)); other rounding points.
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrepassOperands:
    """A chunk's state-independent operands, as the prepass would store them."""

    key: KeySide
    U: torch.Tensor  # [H, C, V]
    W: torch.Tensor  # [H, C, K]


def prepass(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor, beta: torch.Tensor, precision: Precision
) -> PrepassOperands:
    rnd = precision.round
    ks = key_side(q, k, log_g, beta, precision)
    U = rnd(ks.T @ rnd(beta[..., None] * v))
    W = rnd(ks.T @ rnd((beta * torch.exp(ks.G))[..., None] * ks.k_r))
    return PrepassOperands(ks, U, W)


def state_pass_step(
    S0: torch.Tensor, ops: PrepassOperands, scale: float, precision: Precision
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequential pass over one chunk: (O [H, C, V], S_next [H, V, K])."""
    rnd = precision.round
    ks = ops.key
    S0_r = rnd(S0)
    V_new = ops.U - ops.W @ S0_r.transpose(-1, -2)
    decay_in = torch.exp(ks.G)[..., None]
    out = scale * (decay_in * (ks.q_r @ S0_r.transpose(-1, -2)) + ks.P @ rnd(V_new))
    g_last = ks.G[..., -1:]
    V_carry = rnd(V_new * torch.exp(g_last - ks.G)[..., None])
    S_next = torch.exp(g_last)[..., None] * S0 + V_carry.transpose(-1, -2) @ ks.k_r
    return out, S_next


def two_level_step(S0, q, k, v, log_g, beta, scale, precision):
    """`chunk_step`'s interface, computed as the prepass and the state pass of the two-level form."""
    return state_pass_step(S0, prepass(q, k, v, log_g, beta, precision), scale, precision)


@dataclass(frozen=True)
class ChunkSlots:
    """The two-level form's map of a varlen batch onto chunk slots (the slot numbering `wy_prepass.py` uses),
    as its kernels are to compute it on the device: `first[s]` is sequence s's first slot, `slots`
    the grid bound ceil(T / C) + N that needs no device read, and `owner(c)` the (sequence, chunk of
    it) of slot c, None past the last chunk."""

    first: tuple[int, ...]  # N + 1 entries; first[N] = the number of chunks
    slots: int

    def owner(self, slot: int) -> tuple[int, int] | None:
        if not 0 <= slot < self.first[-1]:
            return None
        # The last s with first[s] <= slot (a sequence without chunks has first[s] == first[s + 1]).
        lo, hi = 0, len(self.first) - 2
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.first[mid] <= slot:
                lo = mid
            else:
                hi = mid - 1
        return lo, slot - self.first[lo]


def chunk_slots(cu_seqlens: list[int], total_tokens: int) -> ChunkSlots:
    """The chunk slots of a batch, with the bounds clamped as `chunked.py` clamps them (to [0, T],
    end >= start), so that malformed `cu_seqlens` cannot send a slot out of the tokens."""
    first = [0]
    for s in range(len(cu_seqlens) - 1):
        start = min(max(cu_seqlens[s], 0), total_tokens)
        end = min(max(cu_seqlens[s + 1], start), total_tokens)
        first.append(first[-1] + (end - start + CHUNK - 1) // CHUNK)
    num_seqs = len(cu_seqlens) - 1
    return ChunkSlots(first=tuple(first), slots=(total_tokens + CHUNK - 1) // CHUNK + num_seqs)


@torch.no_grad()
def run(
    q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, precision: Precision = KERNEL, step=chunk_step,
    chunk: int = CHUNK,
):
    """The definition's outputs (output [T,8,128] bf16, new_state [N,8,128,128] fp32) by the chunked
    algorithm (`step`: `chunk_step`, or `two_level_step`) on chunks of `chunk` tokens (a multiple of BLOCK:
    64 as `chunked.py`, 16 as `warp_chain.py`), on any device. Sequences of length 0 get a zero state, as in
    the definition."""
    assert chunk % BLOCK == 0
    dtype = precision.compute
    group = NUM_V_HEADS // NUM_QK_HEADS
    scale = resolve_scale(scale)
    log_g, beta = gates(A_log, a, dt_bias, b)
    num_tokens, num_seqs = q.shape[0], cu_seqlens.shape[0] - 1
    output = torch.zeros(num_tokens, NUM_V_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=q.device)
    new_state = torch.zeros(num_seqs, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE, dtype=torch.float32, device=q.device)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    for n in range(num_seqs):
        start, end = bounds[n], bounds[n + 1]
        if end <= start:
            continue
        if state is not None:
            S = state[n].to(dtype)
        else:
            S = torch.zeros(NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE, dtype=dtype, device=q.device)
        for c0 in range(start, end, chunk):
            c1 = min(c0 + chunk, end)
            pad = chunk - (c1 - c0)

            def heads_first(x: torch.Tensor, repeat: int = 1) -> torch.Tensor:
                x = x[c0:c1].to(dtype)
                if repeat > 1:
                    x = x.repeat_interleave(repeat, dim=1)
                x = x.transpose(0, 1)  # [H, L, ...]
                return F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))

            out, S = step(
                S,
                heads_first(q, group),
                heads_first(k, group),
                heads_first(v),
                heads_first(log_g),
                heads_first(beta),
                scale,
                precision,
            )
            output[c0:c1] = out[:, : c1 - c0].transpose(0, 1).to(torch.bfloat16)
        new_state[n] = S.float()
    return output, new_state
