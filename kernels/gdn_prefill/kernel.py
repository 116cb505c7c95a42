"""GDN prefill for SM90 in CuTe-DSL: `gdn_prefill_qk4_v8_d128_k_last`.

Three paths of this folder, chosen from the total token count T and the number of sequences N (shapes,
known on the host; no device reads, no host synchronisation):

- T <= TOKEN_SERIAL_MAX_TOKENS: `token_serial.py`, one CTA per (sequence, head, 8-row V slice)
  stepping token by token, each state row over 16 lanes;
- up to WY_PREPASS_MIN_TOKENS: `chunked.py`, 64-token chunks in the WY form on tensor cores, two CTAs
  per SM, the grid rows serving the sequences longest first when the grid takes more than one wave,
  on 16-row V slices for one or two sequences and 32-row slices above;
- from WY_PREPASS_MIN_TOKENS, or from a mean sequence length T / N of WY_PREPASS_MIN_MEAN_LENGTH tokens:
  `chunked.py`'s chunks in two kernels, a parallel prepass of every chunk's state-free half (~66 KB of
  shared memory, three CTAs per SM), then a chain with only the state-dependent half: below
  WGMMA_CHAIN_MIN_SEQS sequences `wy_prepass.py`'s, on 16-row V slices up to 4 sequences and 32 above;
  from WGMMA_CHAIN_MIN_SEQS `wgmma_value_side.py`'s, one CTA per (sequence, head) with the whole state as
  warpgroup-MMA accumulators.

Why these thresholds (NOTES.md has the measurements). The token-serial kernel costs a few us plus
~0.2 us per token of the longest sequence, a chunk step of the chunked kernel ~5.5 us: the token-serial
kernel wins up to ~40 tokens, and with T <= 40 no sequence can be longer than 40 tokens (any threshold
from 36 to 46 gives the same geomean). The WY-prepass path's second launch costs more than a few chunk
steps save, so it loses on short sequences; it wins once the longest sequences have about 2.5 chunks or
more. T and N are shapes and the split of T into sequences is not, so the rule is on the mean length
T / N >= 160, and from 512 tokens on it is taken whatever N is. The WGMMA chain steps a chunk of a whole
head in ~3.8 us where a 16-row slice of `wy_prepass.py` takes ~2.8: it wins where many sequences fill the
GPU (4124 tokens in 15 sequences 1.13x, 8192 in 20-57 1.13-1.54x) and loses where a few long ones bound
the call (5709 in 2: 0.75x).

Same contract as every path: destination passing, definition order, `state` None means zeros, `scale`
None or 0 means 1/sqrt(128), CUDA-graph safe.
"""

from __future__ import annotations

from typing import Callable

from . import chunked, token_serial, wgmma_value_side, wy_prepass
from .token_serial import GPU_ARCH, GdnShapeError, resolve_scale

__all__ = [
    "TOKEN_SERIAL_MAX_TOKENS",
    "WY_PREPASS_MIN_MEAN_LENGTH",
    "WGMMA_CHAIN_MIN_SEQS",
    "WY_PREPASS_MIN_TOKENS",
    "GdnShapeError",
    "compile_only",
    "path_for",
    "resolve_scale",
    "run",
    "wy_chain_config",
]

TOKEN_SERIAL_MAX_TOKENS = 40
WY_PREPASS_MIN_TOKENS = 512
WY_PREPASS_MIN_MEAN_LENGTH = 160
WGMMA_CHAIN_MIN_SEQS = 15


def path_for(num_tokens: int, num_seqs: int):
    """The module whose `run` serves a batch of `num_tokens` tokens in `num_seqs` sequences."""
    if num_tokens <= TOKEN_SERIAL_MAX_TOKENS:
        return token_serial
    if num_tokens >= WY_PREPASS_MIN_TOKENS or num_tokens >= WY_PREPASS_MIN_MEAN_LENGTH * num_seqs:
        return wgmma_value_side if num_seqs >= WGMMA_CHAIN_MIN_SEQS else wy_prepass
    return chunked


def wy_chain_config(num_seqs: int, output) -> wy_prepass.WyPrepassConfig | None:
    """The chain the WY path takes for `num_seqs` sequences: the WGMMA chain (None) from WGMMA_CHAIN_MIN_SEQS when
    `output` starts on a 16-B boundary (as `wgmma_value_side.run` requires), else `wy_prepass.py`'s at its
    width (for candidates that reuse the WY launchers)."""
    if num_seqs >= WGMMA_CHAIN_MIN_SEQS and output.data_ptr() % wgmma_value_side.OUTPUT_ALIGN == 0:
        return None
    return wy_prepass.config_for(num_seqs)


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """Compile every path's kernels for `arch` without touching a GPU (for CI and warm-up: no call
    compiles lazily afterwards)."""
    return (
        token_serial.compile_only(arch), *chunked.compile_only(arch), *wy_prepass.compile_only(arch),
        *wgmma_value_side.compile_only(arch),
    )


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """Destination-passing entry: fills `output` [T,8,128] bf16 and `new_state` [N,8,128,128] fp32."""
    path_for(q.shape[0], new_state.shape[0]).run(
        q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state
    )
