"""GDN prefill for SM90 in CuTe-DSL: `gdn_prefill_qk4_v8_d128_k_last`.

Four paths of this folder, chosen in this order from the total token count T and the number of sequences N
(shapes, known on the host; no device reads, no host synchronisation):

- one or two sequences of CONTEXT_PARALLEL_MIN_TOKENS (by N) or more: `context_parallel.py`, the WY path's
  kernels on the batch cut into 16-31 segments (each segment's transition and zero-start state, an fp32 scan over
  segments, then the outputs from the scanned states);
- from WARP_CHAIN_MIN_TOKENS tokens (by N): `warp_chain.py`, warps each stepping 16 state rows through 16-token
  chunks with no CTA barrier, key warps computing the chunks' state-free half a group of four chunks ahead; one
  CTA per (sequence, head, 16 V rows) up to two sequences, at any length; from three, a mean sequence length T / N
  of at most WARP_CHAIN_MAX_MEAN_LENGTH (MEDIUM_BATCH_MAX_MEAN_LENGTH from MEDIUM_BATCH_MIN_TOKENS tokens in 3-8
  sequences), one CTA per (sequence, head, 64 V rows) (per (sequence, head) from 9 sequences);
- the other batches of T <= TOKEN_SERIAL_MAX_TOKENS: `token_serial.py`, one CTA per (sequence, head,
  8-row V slice) stepping token by token, each state row over 16 lanes;
- every other batch, the WY path: `chunked.py`'s 64-token chunks in two kernels, a parallel prepass of every
  chunk's state-free half (~66 KB of shared memory, three CTAs per SM), then a chain with only the
  state-dependent half: below WGMMA_CHAIN_MIN_SEQS sequences `wy_prepass.py`'s, on 16-row V slices up to 4
  sequences and 32 above; from WGMMA_CHAIN_MIN_SEQS `wgmma_value_side.py`'s, one CTA per (sequence, head) with
  the whole state as warpgroup-MMA accumulators.

Why these thresholds (NOTES.md has the measurements: H100 graph-replay probes, cold L2, and runner A/Bs). The
warp chain's first 16-token chunk costs ~5 us (the state's round trip, the first key half, one step), each next
one ~0.6: on 16-row CTAs it beats the token-serial kernel (~2.6 us plus ~0.14 us a token of the longest
sequence) from ~22 tokens in one sequence and ~24 in two, and the WY path up to ~3000 tokens in one or two
sequences (1.04-1.21x at 525-3000). With more sequences the 64-row CTAs beat the token-serial kernel above 40
tokens and the other paths up to a mean of 500 tokens (1.4-1.6x at 8192 tokens in 20-32 sequences, 1.5-2.1x at
800-6500 in 4-13); past that mean how T splits decides: in 3-8 sequences it wins from ~1700 tokens (1.10x at
1800 in 3, 1.9x at 3028 in 5, evenly split), not below (0.93x at 1592 in 3). The WGMMA chain steps a chunk of a
whole head in ~3.8 us where a 16-row slice of `wy_prepass.py` takes ~2.8: it wins where many sequences fill the
GPU and loses where a few long ones bound the call (5709 tokens in 2: 0.75x).
A single sequence walks all its chunks on one chain per head; split in 16 segments (16-31) it runs 1.12x
faster than the WY path at 2048 tokens, 1.46x at 3072, 2.1x at 6144 and 3.8x at 64K, and level with the warp
chain at 3000: it takes one sequence from 2048 tokens. Two sequences gain only where one of them is long (0.84-1.48x
over the WY path at 3-8K by how T splits); from 3072 tokens one holds at least 1536, and the probe favoured the
path at 3271 and 5709 tokens in 2. N and T are all the host knows of the split.

Same contract as every path: destination passing, definition order, `state` None means zeros, `scale`
None or 0 means 1/sqrt(128), CUDA-graph safe.
"""

from __future__ import annotations

from typing import Callable

from . import context_parallel, token_serial, warp_chain, wgmma_value_side, wy_prepass
from .token_serial import GPU_ARCH, GdnShapeError, resolve_scale
from .wgmma_value_side import WGMMA_CHAIN_MIN_SEQS

__all__ = [
    "CONTEXT_PARALLEL_MIN_TOKENS",
    "MEDIUM_BATCH_MAX_MEAN_LENGTH",
    "MEDIUM_BATCH_MIN_TOKENS",
    "MEDIUM_BATCH_SEQS",
    "TOKEN_SERIAL_MAX_TOKENS",
    "WARP_CHAIN_MAX_MEAN_LENGTH",
    "WARP_CHAIN_MIN_TOKENS",
    "WGMMA_CHAIN_MIN_SEQS",
    "GdnShapeError",
    "compile_only",
    "path_for",
    "takes_context_parallel",
    "takes_warp_chain",
    "resolve_scale",
    "run",
]

TOKEN_SERIAL_MAX_TOKENS = 40
# The fewest tokens the context-parallel path takes, by sequence count (none from three sequences).
CONTEXT_PARALLEL_MIN_TOKENS = {1: 2048, 2: 3072}
# The fewest tokens the warp chain takes, by sequence count (from three sequences: above the token-serial range).
WARP_CHAIN_MIN_TOKENS = {1: 22, 2: 24}
WARP_CHAIN_MAX_MEAN_LENGTH = 500  # from three sequences
# From MEDIUM_BATCH_MIN_TOKENS tokens in MEDIUM_BATCH_SEQS sequences the warp chain takes a mean of up to
# MEDIUM_BATCH_MAX_MEAN_LENGTH tokens.
MEDIUM_BATCH_SEQS = range(3, 9)
MEDIUM_BATCH_MIN_TOKENS = 1700
MEDIUM_BATCH_MAX_MEAN_LENGTH = 1200


def takes_context_parallel(num_tokens: int, num_seqs: int) -> bool:
    """Whether `context_parallel.py` serves a batch of `num_tokens` tokens in `num_seqs` sequences."""
    return num_seqs in CONTEXT_PARALLEL_MIN_TOKENS and num_tokens >= CONTEXT_PARALLEL_MIN_TOKENS[num_seqs]


def takes_warp_chain(num_tokens: int, num_seqs: int) -> bool:
    """Whether `warp_chain.py` serves a batch of `num_tokens` tokens in `num_seqs` sequences."""
    if takes_context_parallel(num_tokens, num_seqs):
        return False
    if num_seqs > warp_chain.NARROW_MAX_SEQS:
        max_mean_length = WARP_CHAIN_MAX_MEAN_LENGTH
        if num_seqs in MEDIUM_BATCH_SEQS and num_tokens >= MEDIUM_BATCH_MIN_TOKENS:
            max_mean_length = MEDIUM_BATCH_MAX_MEAN_LENGTH
        if num_tokens > max_mean_length * num_seqs:
            return False
    return num_seqs >= 1 and num_tokens >= WARP_CHAIN_MIN_TOKENS.get(num_seqs, TOKEN_SERIAL_MAX_TOKENS + 1)


def path_for(num_tokens: int, num_seqs: int):
    """The module whose `run` serves a batch of `num_tokens` tokens in `num_seqs` sequences."""
    if takes_context_parallel(num_tokens, num_seqs):
        return context_parallel
    if takes_warp_chain(num_tokens, num_seqs):
        return warp_chain
    if num_tokens <= TOKEN_SERIAL_MAX_TOKENS:
        return token_serial
    return wgmma_value_side if num_seqs >= WGMMA_CHAIN_MIN_SEQS else wy_prepass


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """Compile every path's kernels for `arch` without touching a GPU (for CI and warm-up: no call
    compiles lazily afterwards)."""
    return (
        *warp_chain.compile_only(arch), token_serial.compile_only(arch), *wy_prepass.compile_only(arch),
        *wgmma_value_side.compile_only(arch), *context_parallel.compile_only(arch),
    )


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """Destination-passing entry: fills `output` [T,8,128] bf16 and `new_state` [N,8,128,128] fp32."""
    path_for(q.shape[0], new_state.shape[0]).run(
        q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state
    )
