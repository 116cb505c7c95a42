"""PyTorch model of a context-parallel (CP) GDN prefill, and its cost model (NOTES.md, "Context-parallel
path"). `context_parallel.py` computes it with the WY path's kernels (`kernel.py`'s path for one long sequence).

Per (sequence, v-head) the state S [V, K] (k-last) evolves token by token as

    S <- g S (I - beta k k^T) + beta v k^T        (= S <- g S; S <- S + beta (v - S k) k^T)

which is affine in S: over any run of tokens, S_out = S_in M + B with the K x K transition
M = prod_t g_t (I - beta_t k_t k_t^T) (ordered, right-multiplied) and B the state the run reaches from
zero. A sequence is cut into segments of `segment_chunks` chunks of 64 tokens (the last one shorter):

1. Segment summary (parallel over segments, heads, sequences; every segment but the last of its
   sequence): B and M, by the chunked chain of `chunked_model.chunk_step` over the segment's chunks on
   an augmented 256-row state [B; M] that starts at [0; I], the M rows with zero values (row i of M
   is where the state row e_i^T goes, with nothing written). No outputs.
2. Scan (sequential over the segments of a sequence, parallel over heads, sequences and state rows):
   S_in(0) = initial state (or 0), S_in(j + 1) = S_in(j) M_j + B_j, in fp32 without rounding.
3. Outputs (parallel over segments): the chunked chain over the segment from S_in(j), exactly the
   current path's chain with segments in place of sequences; the last segment's final state is
   `new_state`.

The transition is kept dense (K x K fp32, 64 KB per segment and head): the WY form gives it as
exp(G_end) (I - K^T W) of rank n (the segment's tokens), but applying that to a 128-row state costs
4 V K n FLOP against 2 V K^2 for the dense matrix, and storing W (n x K fp16 plus the keys) beats 64 KB
only below 128 tokens, so the dense form is the cheaper one for every segment length worth splitting
at. The scalar decays commute with the rank-1 factors, so M = exp(G_end) prod_t (I - beta_t k_t k_t^T):
the chain never divides by a cumulative decay, every decay factor is <= 1 and every factor of the
product is a contraction for |k| = 1, beta in (0, 1), so decays near 1 (a state that survives many
thousands of tokens) cost no accuracy beyond the chain's own (the scan is fp32).

`Precision` is `chunked_model`'s: `EXACT` (float64, checks the algebra), `KERNEL` (fp32 with the chain's
fp16 operand rounding; the M rows are rounded to fp16 where the chain rounds the state, the scan is
unrounded fp32).

The work list (`work_list`): with a segment length L (tokens, a multiple of 64, chosen on the host from
T and N: `choose_segment_chunks`), sequence s of n_s tokens has ceil(n_s / L) segments; segment j of
sequence s (starting at token start_s) gets slot segment_bound(s, start_s, L) + j, where
segment_bound(m, t, L) = min(m, t) + (t - min(m, t)) // L (FlashInfer's `chunk_bound`). Slots are
unique and below segment_bound(N, T, L), a grid size known on the host; a CTA finds its (sequence,
segment) by a binary search over s of segment_bound(s, cu_seqlens[s], L), which is non-decreasing in
s. No prefix sum, no host read of `cu_seqlens`.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

try:  # as a module of the kernel folder's package
    from . import chunked_model as cm
except ImportError:  # loaded by path (tests)
    _name = "gdn_chunked_model_for_cp"
    cm = sys.modules.get(_name)
    if cm is None:
        _spec = importlib.util.spec_from_file_location(_name, Path(__file__).with_name("chunked_model.py"))
        cm = importlib.util.module_from_spec(_spec)
        sys.modules[_name] = cm  # dataclasses look their module up here
        _spec.loader.exec_module(cm)

NUM_QK_HEADS = cm.NUM_QK_HEADS
NUM_V_HEADS = cm.NUM_V_HEADS
HEAD_SIZE = cm.HEAD_SIZE
CHUNK = cm.CHUNK
Precision = cm.Precision
EXACT = cm.EXACT
KERNEL = cm.KERNEL


# ------------------------------------------------------------------------------------------------
# Work list
# ------------------------------------------------------------------------------------------------


def segment_bound(num_seqs: int, total_tokens: int, segment_tokens: int) -> int:
    """An upper bound on the segments of `num_seqs` sequences holding `total_tokens` tokens (each
    nonempty sequence: 1 + (n - 1) // L segments, and sum floor(x_i / L) <= floor(sum x_i / L))."""
    m = min(num_seqs, total_tokens)
    return m + (total_tokens - m) // segment_tokens


@dataclass(frozen=True)
class Segment:
    slot: int  # unique, < segment_bound(N, T, L)
    seq: int
    index: int  # segment j of its sequence
    count: int  # segments of its sequence
    start: int  # token range [start, end)
    end: int

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1


def segment_count(length: int, segment_tokens: int, split_tokens: int) -> int:
    """Segments of a sequence: one up to `split_tokens` tokens (no summary, no scan: the current
    path's chain), else ceil(n / L). At most 1 + (n - 1) // L, so `segment_bound` holds."""
    if length <= 0:
        return 0
    return 1 if length <= split_tokens else -(-length // segment_tokens)


def segment_of_slot(
    bounds: list[int], total_tokens: int, segment_tokens: int, slot: int, split_tokens: int | None = None
) -> Segment | None:
    """What one CTA of a grid of segment_bound(N, T, L) does on the device: the last sequence s with
    segment_bound(s, start_s, L) <= slot (binary search), and its segment slot - that, or None.
    `split_tokens` (default 2 L): sequences up to this length stay one segment."""
    split_tokens = 2 * segment_tokens if split_tokens is None else split_tokens
    num_seqs = len(bounds) - 1
    if num_seqs <= 0:
        return None

    def clamp(s: int) -> tuple[int, int]:  # bounds clamped to [0, T], end >= start, as the kernels clamp them
        start = min(max(bounds[s], 0), total_tokens)
        return start, min(max(bounds[s + 1], start), total_tokens)

    lo, hi = 0, num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if segment_bound(mid, clamp(mid)[0], segment_tokens) <= slot:
            lo = mid
        else:
            hi = mid - 1
    start, end = clamp(lo)
    first = segment_bound(lo, start, segment_tokens)
    count = segment_count(end - start, segment_tokens, split_tokens)
    index = slot - first
    if not 0 <= index < count:
        return None
    if count == 1:
        return Segment(slot, lo, 0, 1, start, end)
    seg_start = start + index * segment_tokens
    return Segment(slot, lo, index, count, seg_start, min(seg_start + segment_tokens, end))


def work_list(bounds: list[int], total_tokens: int, segment_tokens: int, split_tokens: int | None = None) -> list[Segment]:
    """Every segment of the batch, as the grid of segment_bound(N, T, L) CTAs finds them."""
    if segment_tokens <= 0 or segment_tokens % CHUNK:
        raise ValueError(f"segment length must be a positive multiple of {CHUNK}, got {segment_tokens}")
    grid = segment_bound(len(bounds) - 1, total_tokens, segment_tokens)
    found = (segment_of_slot(bounds, total_tokens, segment_tokens, slot, split_tokens) for slot in range(grid))
    return [seg for seg in found if seg is not None]


# ------------------------------------------------------------------------------------------------
# The three phases
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Operands:
    """Per-token operands of the whole batch in the compute dtype, heads first: q, k [H, T, K] (q/k head
    h // 2 repeated), v [H, T, V], log g and beta [H, T] (fp32 gates as the kernels compute them)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    log_g: torch.Tensor
    beta: torch.Tensor
    scale: float

    @staticmethod
    def build(q, k, v, A_log, a, dt_bias, b, scale, dtype) -> Operands:
        group = NUM_V_HEADS // NUM_QK_HEADS
        log_g, beta = cm.gates(A_log, a, dt_bias, b)
        return Operands(
            q.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1),
            k.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1),
            v.to(dtype).transpose(0, 1),
            log_g.to(dtype).transpose(0, 1),
            beta.to(dtype).transpose(0, 1),
            cm.resolve_scale(scale),
        )

    def chunk(self, c0: int, c1: int) -> tuple[torch.Tensor, ...]:
        """Tokens [c0, c1) padded to a full chunk with inert tokens (k = q = v = 0, log g = beta = 0)."""
        pad = CHUNK - (c1 - c0)
        return (
            F.pad(self.q[:, c0:c1], (0, 0, 0, pad)),
            F.pad(self.k[:, c0:c1], (0, 0, 0, pad)),
            F.pad(self.v[:, c0:c1], (0, 0, 0, pad)),
            F.pad(self.log_g[:, c0:c1], (0, pad)),
            F.pad(self.beta[:, c0:c1], (0, pad)),
        )


def segment_summary(
    ops: Operands, start: int, end: int, precision: Precision, paired: frozenset[str] = frozenset()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1: (B [H, V, K], M [H, K, K]) of tokens [start, end): S_out = S_in M + B. The chunked
    chain on the augmented state [B; M] from [0; I], the M rows with zero values. `paired`:
    `chunked_model.chunk_step`'s."""
    dtype = precision.compute
    h, d = NUM_V_HEADS, HEAD_SIZE
    eye = torch.eye(d, dtype=dtype, device=ops.q.device).expand(h, d, d)
    S = torch.cat([torch.zeros(h, d, d, dtype=dtype, device=ops.q.device), eye], dim=1)  # [H, V + K, K]
    for c0 in range(start, end, CHUNK):
        q, k, v, log_g, beta = ops.chunk(c0, min(c0 + CHUNK, end))
        v_aug = torch.cat([v, torch.zeros(h, CHUNK, d, dtype=dtype, device=v.device)], dim=-1)
        _, S = cm.chunk_step(S, q, k, v_aug, log_g, beta, ops.scale, precision, paired)
    return S[:, :d], S[:, d:]


def segment_outputs(
    ops: Operands, start: int, end: int, S_in: torch.Tensor, precision: Precision,
    paired: frozenset[str] = frozenset(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 3: the chunked chain over tokens [start, end) from S_in: (O [H, end - start, V], S_out)."""
    S, outs = S_in, []
    for c0 in range(start, end, CHUNK):
        c1 = min(c0 + CHUNK, end)
        out, S = cm.chunk_step(S, *ops.chunk(c0, c1), ops.scale, precision, paired)
        outs.append(out[:, : c1 - c0])
    return torch.cat(outs, dim=1), S


def run_raw(
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
    precision: Precision = KERNEL,
    segment_chunks: int = 8,
    split_tokens: int | None = None,
    paired: frozenset[str] = frozenset(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CP algorithm, unrounded: (output [T, 8, 128], new_state [N, 8, 128, 128]) in the compute dtype.
    Zero-length sequences get a zero state, as in the definition. `paired`: `chunked_model.chunk_step`'s."""
    dtype = precision.compute
    num_tokens, num_seqs = q.shape[0], cu_seqlens.shape[0] - 1
    bounds = [int(x) for x in cu_seqlens.tolist()]
    ops = Operands.build(q, k, v, A_log, a, dt_bias, b, scale, dtype)
    segments = work_list(bounds, num_tokens, segment_chunks * CHUNK, split_tokens)

    # Phase 1 (parallel): summaries of every segment but the last of its sequence.
    summary = {
        seg.slot: segment_summary(ops, seg.start, seg.end, precision, paired) for seg in segments if not seg.is_last
    }

    # Phase 2 (sequential over segments): incoming states.
    by_seq: dict[int, list[Segment]] = {}
    for seg in segments:
        by_seq.setdefault(seg.seq, []).append(seg)
    incoming: dict[int, torch.Tensor] = {}
    zeros = torch.zeros(NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE, dtype=dtype, device=q.device)
    for seq, segs in by_seq.items():
        S = zeros if state is None else state[seq].to(dtype)
        for seg in sorted(segs, key=lambda s: s.index):
            incoming[seg.slot] = S
            if not seg.is_last:
                B, M = summary[seg.slot]
                S = S @ M + B

    # Phase 3 (parallel): outputs, and the final state from each sequence's last segment.
    output = torch.zeros(NUM_V_HEADS, num_tokens, HEAD_SIZE, dtype=dtype, device=q.device)
    new_state = torch.zeros(num_seqs, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE, dtype=dtype, device=q.device)
    for seg in segments:
        out, S = segment_outputs(ops, seg.start, seg.end, incoming[seg.slot], precision, paired)
        output[:, seg.start : seg.end] = out
        if seg.is_last:
            new_state[seg.seq] = S
    return output.transpose(0, 1), new_state


@torch.no_grad()
def run(
    q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, precision: Precision = KERNEL, segment_chunks: int = 8,
    split_tokens=None, paired: frozenset[str] = frozenset(),
):
    """The definition's outputs (output bf16, new_state fp32) by the CP algorithm."""
    out, new_state = run_raw(
        q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, precision, segment_chunks, split_tokens, paired
    )
    return out.to(torch.bfloat16), new_state.float()


@torch.no_grad()
def token_recurrence(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, dtype=torch.float64):
    """The reference's token recurrence (hopperbench/tracks/gdn_prefill/reference.py) in `dtype`,
    unrounded, on the gates `chunked_model.gates` computes (fp32, as every kernel computes them):
    the oracle the EXACT model is compared with."""
    ops = Operands.build(q, k, v, A_log, a, dt_bias, b, scale, dtype)
    num_tokens, num_seqs = q.shape[0], cu_seqlens.shape[0] - 1
    bounds = [int(x) for x in cu_seqlens.tolist()]
    output = torch.zeros(NUM_V_HEADS, num_tokens, HEAD_SIZE, dtype=dtype)
    new_state = torch.zeros(num_seqs, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE, dtype=dtype)
    g = torch.exp(ops.log_g).transpose(0, 1).contiguous()  # [T, H]
    beta = ops.beta.transpose(0, 1).contiguous()
    q_t, k_t, v_t = (x.transpose(0, 1).contiguous() for x in (ops.q, ops.k, ops.v))  # [T, H, D]
    for n in range(num_seqs):
        if bounds[n + 1] <= bounds[n]:
            continue
        S = torch.zeros(NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE, dtype=dtype) if state is None else state[n].to(dtype).clone()
        for t in range(bounds[n], bounds[n + 1]):
            k_col = k_t[t, :, :, None]
            S.mul_(g[t, :, None, None])
            delta = (v_t[t, :, :, None] - torch.matmul(S, k_col)).mul_(beta[t, :, None, None])  # beta (v - S k)
            S.addcmul_(delta, k_col.transpose(1, 2))  # S += delta k^T
            output[:, t] = ops.scale * torch.matmul(S, q_t[t, :, :, None])[..., 0]
        new_state[n] = S
    return output.transpose(0, 1), new_state


# ------------------------------------------------------------------------------------------------
# Cost model (H200). FLOP per 64-token chunk and v-head (C = 64, d = 128, r state rows), counting
# triangular products at half:
#   key side (prepass): K K^T and Q K^T lower triangles C^2 d each, blocked inverse ~C^3 / 3;
#   chain with outputs (current value side, CP phase 3), r = 128: K S^T, Q S^T, S update 2 C d r
#     each, T Xb and P V' C^2 r each;
#   CP phase 1 (no outputs), r = 256 ([B; M]): K S^T and S update 2 C d r each, T Xb C^2 r;
#   CP scan: 2 V K^2 fp32 per segment and head (not tensor cores: the state stays unrounded).
# Bytes: each tensor once per kernel that reads or writes it (re-reads within a kernel hit L2).
# Chains: a kernel whose CTAs walk chunks one after another takes at least
# max(chain steps x step latency, row-chunks / (SMs x row rate)); both rates are measured on the
# current WY value-side chain (NOTES.md) and are parameters, so that a faster chain can be plugged in.
# ------------------------------------------------------------------------------------------------

C, D, H = CHUNK, HEAD_SIZE, NUM_V_HEADS
FLOP_KEY_SIDE = 2 * C * C * D + C**3 / 3
FLOP_CHAIN = 6 * C * D * D + 2 * C * C * D  # r = 128
FLOP_SUMMARY = 4 * C * D * (2 * D) + C * C * (2 * D)  # r = 256, no outputs
FLOP_SCAN = 2 * D * D * D
# Phase 1 as a fraction of a value-side row-chunk's work, per state row.
SUMMARY_ROW_WEIGHT = (4 * C * D + C * C) / (6 * C * D + 2 * C * C)

BYTES_QK = 2 * NUM_QK_HEADS * D  # bf16, per token
BYTES_V = 2 * H * D
BYTES_AB = 2 * 2 * H
BYTES_OUT = 2 * H * D
BYTES_STATE = 4 * H * D * D  # fp32, per sequence (all heads)
# The key-side workspace per chunk and head: T and P fp16 64 x 64, G and beta fp32 64.
BYTES_WS_T = 2 * C * C + 2 * 4 * C
BYTES_WS_P = 2 * C * C


@dataclass(frozen=True)
class Machine:
    hbm_bytes_per_s: float = 4.0e12  # practical copy bandwidth (4.8 TB/s peak)
    sms: int = 132
    tensor_flop_per_s: float = 990e12  # dense fp16 / bf16
    fp32_flop_per_s: float = 60e12
    # Measured on the current WY value-side chain: 2.5 us per chunk step when chain-bound (16-row
    # slices; a single 20000-token sequence: ~0.84 ms = prepass + 313 steps of ~2.4 us), and ~12
    # row-chunks (one 64-token chunk of one state row) per us per SM when busy-bound (8192 tokens in
    # 20-57 sequences: ~90-100 us of value side for ~1.2 M row-chunks).
    step_us: float = 2.5
    row_chunks_per_us_per_sm: float = 12.0
    # Measured: the WY key-side prepass, ~40 us at 8192 tokens in 20-57 sequences. None: at its
    # roofline floor (bytes).
    prepass_tokens_per_us: float | None = 8192 / 40.0
    # Estimate (no kernel yet): one scan step, a 4-row slice x 128 x 128 fp32 product with 64 KB of
    # M streamed from L2, plus the flag hand-off between steps.
    scan_step_us: float = 1.5


# What the bar asks of the kernels, as rates: FlashInfer's SM90 kernel runs one CTA of three
# warpgroups per (sequence, head) at ~4 us per 64-token step for all 128 rows (its CP path, a
# 20000-token sequence: 2 x 24 steps in ~0.2 ms), i.e. ~32 row-chunks per us per SM.
TARGET = Machine(step_us=1.5, row_chunks_per_us_per_sm=32.0, prepass_tokens_per_us=None)


@dataclass(frozen=True)
class Phase:
    name: str
    bytes: float
    tensor_flop: float
    fp32_flop: float
    chain_us: float  # critical path of dependent steps
    busy_us: float  # work / machine throughput at the measured rates

    def floor_us(self, m: Machine) -> float:
        """Roofline: bytes or FLOP, whichever takes longer."""
        return 1e6 * max(self.bytes / m.hbm_bytes_per_s, self.tensor_flop / m.tensor_flop_per_s, self.fp32_flop / m.fp32_flop_per_s)

    def predicted_us(self, m: Machine) -> float:
        return max(self.floor_us(m), self.chain_us, self.busy_us)


def _chunks(n: int) -> int:
    return -(-n // C)


def chained_cost(lengths: list[int], with_state: bool = True, m: Machine = Machine()) -> list[Phase]:
    """The current WY path: key-side prepass over every chunk, then one chain per (sequence, head)."""
    T, N = sum(lengths), len(lengths)
    chunks = sum(_chunks(n) for n in lengths)
    ws = chunks * H * (BYTES_WS_T + BYTES_WS_P)
    prepass = Phase(
        "prepass",
        T * (2 * BYTES_QK + BYTES_AB) + ws,
        chunks * H * FLOP_KEY_SIDE,
        0.0,
        0.0,
        0.0 if m.prepass_tokens_per_us is None else T / m.prepass_tokens_per_us,
    )
    chain = Phase(
        "chain",
        T * (2 * BYTES_QK + BYTES_V + BYTES_OUT) + ws + N * BYTES_STATE * (2 if with_state else 1),
        chunks * H * FLOP_CHAIN,
        0.0,
        max(_chunks(n) for n in lengths) * m.step_us,
        chunks * H * D / (m.sms * m.row_chunks_per_us_per_sm),
    )
    return [prepass, chain]


def cp_cost(
    lengths: list[int], segment_chunks: int, with_state: bool = True, m: Machine = Machine(), fused_key_side: bool = False
) -> list[Phase]:
    """The CP path with segments of `segment_chunks` chunks: prepass, summary, scan, outputs. With
    `fused_key_side` there is no prepass and no workspace: the summary recomputes T from k, a, b and
    the outputs phase T and P from q, k, a, b (the key side's FLOP on both; its rates scaled by the
    extra work, an optimistic assumption: the key side is latency-heavy, chunked.py's step with it
    is ~2x the value side's)."""
    L = segment_chunks * C
    T, N = sum(lengths), len(lengths)
    chunks = sum(_chunks(n) for n in lengths)
    seg_counts = [segment_count(n, L, 2 * L) for n in lengths]
    summarised = [(n - (s - 1) * L, s - 1) for n, s in zip(lengths, seg_counts) if s > 1]  # (last length, others)
    summary_chunks = sum(others * segment_chunks for _, others in summarised)
    summary_tokens = summary_chunks * C
    summaries = sum(others for _, others in summarised)
    head_state = BYTES_STATE // H
    if fused_key_side:
        ws_t, ws, extra = -BYTES_AB * C / H, -BYTES_QK * C / H - BYTES_AB * C / H, FLOP_KEY_SIDE
        prepass = Phase("prepass", 0.0, 0.0, 0.0, 0.0, 0.0)
    else:
        ws_t, ws, extra = BYTES_WS_T, BYTES_WS_P + BYTES_WS_T, 0.0
        prepass = chained_cost(lengths, with_state, m)[0]
    ws = chunks * H * ws
    summary = Phase(
        "summary",
        summary_tokens * (BYTES_QK + BYTES_V) + summary_chunks * H * ws_t + summaries * H * 2 * head_state,
        summary_chunks * H * (FLOP_SUMMARY + extra),
        0.0,
        (segment_chunks if summaries else 0) * m.step_us * (1 + extra / FLOP_SUMMARY),
        summary_chunks * H * 2 * D * SUMMARY_ROW_WEIGHT * (1 + extra / FLOP_SUMMARY) / (m.sms * m.row_chunks_per_us_per_sm),
    )
    scan = Phase(
        "scan",
        summaries * H * 3 * head_state,
        0.0,
        summaries * H * FLOP_SCAN,
        max((others for _, others in summarised), default=0) * m.scan_step_us,
        0.0,
    )
    longest_segment = max(_chunks(n) if s == 1 else segment_chunks for n, s in zip(lengths, seg_counts))
    outputs = Phase(
        "outputs",
        T * (2 * BYTES_QK + BYTES_V + BYTES_OUT) + ws + (N * (2 if with_state else 1) + summaries) * BYTES_STATE,
        chunks * H * (FLOP_CHAIN + extra),
        0.0,
        longest_segment * m.step_us * (1 + extra / FLOP_CHAIN),
        chunks * H * D * (1 + extra / FLOP_CHAIN) / (m.sms * m.row_chunks_per_us_per_sm),
    )
    return [prepass, summary, scan, outputs]


def choose_segment_chunks(total_tokens: int, num_seqs: int, m: Machine = Machine()) -> int:
    """The segment length (in chunks) from the shapes alone: splitting shortens a chain below the time
    the outputs phase needs anyway for its work (busy time W) only at the price of summary work, so the
    two chains of a segment (summary and outputs) are made to take about that long: L = W / (2 step),
    at least 4 chunks, rounded up to a power of two (few compiled variants are needed: none, L is a
    runtime argument, but powers of two keep the slot arithmetic a shift)."""
    chunks = total_tokens / C + num_seqs / 2  # expected chunk count with partial chunks
    busy = chunks * H * D / (m.sms * m.row_chunks_per_us_per_sm)
    L = max(4, math.ceil(busy / (2 * m.step_us)))
    return 1 << (L - 1).bit_length()


def total_us(phases: list[Phase], m: Machine = Machine(), floor: bool = False) -> float:
    return sum(p.floor_us(m) if floor else p.predicted_us(m) for p in phases)


def random_composition(total: int, parts: int, seed: int) -> list[int]:
    """`parts` lengths >= 1 summing to `total` (as the track's synthesizer draws `cu_seqlens`)."""
    if parts == 1:
        return [total]
    generator = torch.Generator().manual_seed(seed)
    cuts = sorted((torch.randperm(total - 1, generator=generator)[: parts - 1] + 1).tolist())
    bounds = [0, *cuts, total]
    return [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]


def cost_table(m: Machine = Machine()) -> list[dict]:
    """Predictions for the official 8192-token shapes and single long sequences (NOTES.md's table)."""
    shapes = [("8192 / 20", random_composition(8192, 20, 20)), ("8192 / 38", random_composition(8192, 38, 38))]
    shapes += [("8192 / 57", random_composition(8192, 57, 57))]
    shapes += [(f"{n} / 1", [n]) for n in (8192, 20000, 32768, 65536)]
    rows = []
    for name, lengths in shapes:
        L = choose_segment_chunks(sum(lengths), len(lengths), m)
        chained, cp = chained_cost(lengths, True, m), cp_cost(lengths, L, True, m)
        fused = cp_cost(lengths, L, True, m, fused_key_side=True)
        best = min(
            (total_us(cp_cost(lengths, s, True, m), m), s) for s in (2, 4, 8, 16, 32, 64, 128, 256) if s * C <= 2 * max(lengths)
        )
        rows.append(
            {
                "shape": name,
                "longest": max(lengths),
                "segment_chunks": L,
                "chained_floor_us": total_us(chained, m, floor=True),
                "chained_us": total_us(chained, m),
                "cp_floor_us": total_us(cp, m, floor=True),
                "cp_us": total_us(cp, m),
                "cp_phases_us": {p.name: round(p.predicted_us(m), 1) for p in cp},
                "cp_fused_floor_us": total_us(fused, m, floor=True),
                "cp_fused_us": total_us(fused, m),
                "best_segment_chunks": best[1],
                "best_cp_us": best[0],
            }
        )
    return rows


if __name__ == "__main__":
    for label, machine in (("measured rates", Machine()), ("target rates", TARGET)):
        print(f"# {label}")
        for row in cost_table(machine):
            print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
