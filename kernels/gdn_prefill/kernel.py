"""GDN prefill for SM90 in CuTe-DSL: `gdn_prefill_qk4_v8_d128_k_last`.

Five paths of this folder, chosen from the total token count T and the number of sequences N (shapes,
known on the host; no device reads, no host synchronisation):

- a mean sequence length T / N of at most WARP_CHAIN_MAX_MEAN_LENGTH, from WARP_CHAIN_MIN_TOKENS tokens
  (by N) and outside ONE_SEQUENCE_ONE_CHUNK: `warp_chain.py`, one CTA per (sequence, head, 64 V rows),
  four warps each stepping 16 state rows through 16-token chunks with no CTA barrier, four key warps
  computing the chunks' state-free half one group of four chunks ahead;
- the other batches of T <= TOKEN_SERIAL_MAX_TOKENS: `token_serial.py`, one CTA per (sequence, head,
  8-row V slice) stepping token by token, each state row over 16 lanes;
- up to WY_PREPASS_MIN_TOKENS: `chunked.py`, 64-token chunks in the WY form on tensor cores, two CTAs
  per SM, the grid rows serving the sequences longest first when the grid has more CTAs than SMs,
  on 16-row V slices for one or two sequences and 32-row slices above, a sequence's last <= 16 tokens
  as one 16-token chunk (`short_tail.py`);
- from WY_PREPASS_MIN_TOKENS, or from a mean sequence length T / N of WY_PREPASS_MIN_MEAN_LENGTH tokens:
  `chunked.py`'s chunks in two kernels, a parallel prepass of every chunk's state-free half (~66 KB of
  shared memory, three CTAs per SM), then a chain with only the state-dependent half: below
  WGMMA_CHAIN_MIN_SEQS sequences `wy_prepass.py`'s, on 16-row V slices up to 4 sequences and 32 above;
  from WGMMA_CHAIN_MIN_SEQS `wgmma_value_side.py`'s, one CTA per (sequence, head) with the whole state as
  warpgroup-MMA accumulators;
- one sequence of CONTEXT_PARALLEL_MIN_TOKENS or more: `context_parallel.py`, the WY path's kernels on
  the sequence cut into 16 segments (each segment's transition and zero-start state, an fp32 scan over
  segments, then the outputs from the scanned states).

Why these thresholds (NOTES.md has the measurements; the warp chain's are an H100 graph-replay probe). The
warp chain steps a 16-token chunk of every sequence and head at once, from a ~5.5 us floor: it beats the
token-serial kernel from ~30 tokens in one sequence (1.06-1.22x at 30-40) and ~35 in two, loses to the chunked
kernel's single 64-token chunk at 41-64 tokens in one sequence (0.95-0.98x), and elsewhere up to a mean of
480 tokens is 1.0-2.1x faster than the other paths (1.4-1.6x at 8192 tokens in 20-32 sequences, 1.5-2.1x at
800-6500 in 4-13). Above that mean one chain through a sequence's chunks loses to the WY path's V slices
(0.87-0.91x at 1377-2107 tokens in 1-2). For the other paths: the token-serial kernel costs a few us plus
~0.2 us per token of the longest sequence, a chunk step of the chunked kernel ~5.5 us: the token-serial
kernel wins up to ~40 tokens, and with T <= 40 no sequence can be longer than 40 tokens (any threshold
from 36 to 46 gives the same geomean). The WY-prepass path's second launch costs more than a few chunk
steps save, so it loses on short sequences; it wins once the longest sequences have about 2.5 chunks or
more. T and N are shapes and the split of T into sequences is not, so the rule is on the mean length
T / N >= 160, and from 512 tokens on it is taken whatever N is. The WGMMA chain steps a chunk of a whole
head in ~3.8 us where a 16-row slice of `wy_prepass.py` takes ~2.8: it wins where many sequences fill the
GPU (4124 tokens in 15 sequences 1.13x, 8192 in 20-57 1.13-1.54x) and loses where a few long ones bound
the call (5709 in 2: 0.75x). A single sequence walks all its chunks on one chain per head; split in 16
segments (16-31) it runs 1.12x faster at 2048 tokens, 1.46x at 3072, 2.1x at 6144 and 3.8x at 64K (graph
replay, cold L2), but 0.65-0.68x at 1377-1536 tokens: it takes one sequence from 2048 tokens. N is
the only shape that says no sequence is short, so the rule is N = 1.

Same contract as every path: destination passing, definition order, `state` None means zeros, `scale`
None or 0 means 1/sqrt(128), CUDA-graph safe.
"""

from __future__ import annotations

from typing import Callable

from . import context_parallel, short_tail, token_serial, warp_chain, wgmma_value_side, wy_prepass
from .token_serial import GPU_ARCH, GdnShapeError, resolve_scale
from .wgmma_value_side import WGMMA_CHAIN_MIN_SEQS

__all__ = [
    "CONTEXT_PARALLEL_MAX_SEQS",
    "CONTEXT_PARALLEL_MIN_TOKENS",
    "ONE_SEQUENCE_ONE_CHUNK",
    "TOKEN_SERIAL_MAX_TOKENS",
    "WARP_CHAIN_MAX_MEAN_LENGTH",
    "WARP_CHAIN_MIN_TOKENS",
    "WY_PREPASS_MIN_MEAN_LENGTH",
    "WGMMA_CHAIN_MIN_SEQS",
    "WY_PREPASS_MIN_TOKENS",
    "GdnShapeError",
    "compile_only",
    "path_for",
    "takes_warp_chain",
    "resolve_scale",
    "run",
]

TOKEN_SERIAL_MAX_TOKENS = 40
WY_PREPASS_MIN_TOKENS = 512
WY_PREPASS_MIN_MEAN_LENGTH = 160
CONTEXT_PARALLEL_MAX_SEQS = 1
CONTEXT_PARALLEL_MIN_TOKENS = 2048
WARP_CHAIN_MAX_MEAN_LENGTH = 480
# The fewest tokens the warp chain takes, by sequence count (from three sequences: above the token-serial range).
WARP_CHAIN_MIN_TOKENS = {1: 30, 2: 35}
ONE_SEQUENCE_ONE_CHUNK = range(TOKEN_SERIAL_MAX_TOKENS + 1, 65)  # one sequence the chunked kernel serves in one chunk


def takes_warp_chain(num_tokens: int, num_seqs: int) -> bool:
    """Whether `warp_chain.py` serves a batch of `num_tokens` tokens in `num_seqs` sequences."""
    if num_tokens > WARP_CHAIN_MAX_MEAN_LENGTH * num_seqs:
        return False
    if num_seqs == 1 and num_tokens in ONE_SEQUENCE_ONE_CHUNK:
        return False
    return num_tokens >= WARP_CHAIN_MIN_TOKENS.get(num_seqs, TOKEN_SERIAL_MAX_TOKENS + 1)


def path_for(num_tokens: int, num_seqs: int):
    """The module whose `run` serves a batch of `num_tokens` tokens in `num_seqs` sequences."""
    if takes_warp_chain(num_tokens, num_seqs):
        return warp_chain
    if num_tokens <= TOKEN_SERIAL_MAX_TOKENS:
        return token_serial
    if num_seqs <= CONTEXT_PARALLEL_MAX_SEQS and num_tokens >= CONTEXT_PARALLEL_MIN_TOKENS:
        return context_parallel
    if num_tokens >= WY_PREPASS_MIN_TOKENS or num_tokens >= WY_PREPASS_MIN_MEAN_LENGTH * num_seqs:
        return wgmma_value_side if num_seqs >= WGMMA_CHAIN_MIN_SEQS else wy_prepass
    return short_tail


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """Compile every path's kernels for `arch` without touching a GPU (for CI and warm-up: no call
    compiles lazily afterwards)."""
    return (
        *warp_chain.compile_only(arch), token_serial.compile_only(arch), *short_tail.compile_only(arch),
        *wy_prepass.compile_only(arch), *wgmma_value_side.compile_only(arch), *context_parallel.compile_only(arch),
    )


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """Destination-passing entry: fills `output` [T,8,128] bf16 and `new_state` [N,8,128,128] fp32."""
    path_for(q.shape[0], new_state.shape[0]).run(
        q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state
    )
