"""GDN prefill for SM90 in CuTe-DSL: `gdn_prefill_qk4_v8_d128_k_last`.

v2.2 (v1.9 with design v4, candidates v4.0 and v4.1, promoted in session 13; v2.2 and v4.2 in session 14,
NOTES.md): three paths of this folder, chosen from the total token count T and the number of sequences N
(shapes, known on the host; no device reads, no host synchronisation):

- T <= TOKEN_SERIAL_MAX_TOKENS: `token_serial.py`, one CTA per (sequence, head, 8-row V slice)
  stepping token by token (v1.8's rows over 16 lanes: 1.12x over v1.4 at <= 40 tokens);
- up to WY_PREPASS_MIN_TOKENS: `chunked.py`, 64-token chunks in the WY form on tensor cores, two CTAs
  per SM, the grid rows serving the sequences longest first (v1.7: 1.23x over v1.4 on the 18 workloads
  of >= 9 sequences, 1.00x on the others), on 16-row V slices for one or two sequences (v2.2: 1.09-1.21x
  on those official rows);
- from WY_PREPASS_MIN_TOKENS, or from a mean sequence length of WY_PREPASS_MIN_MEAN_LENGTH tokens (v2.1):
  `wy_prepass.py`, `chunked.py`'s chunks in two kernels, a parallel prepass of every chunk's state-free
  half, then a chain with only the state-dependent half, on 16-row V slices up to 4 sequences and 32 above
  (the A/B of session 13 over the 40 workloads of >= 512 tokens: 1.07-1.95x over v1.9 per row with the
  width the rule picks); its prepass in ~66 KB of shared memory, three CTAs per SM (v4.2: 1.035x at 8192
  tokens).

Where the WY-prepass path starts (session 13, NOTES.md): its second launch costs more than a few chunks
save, so it loses on short sequences (0.59-0.93x on the official rows of 41-132 tokens). It won on every
measured row of >= 512 tokens, and below that wherever the sequences were long enough: at one sequence
from ~134 tokens, at two from ~185-256 (official rows 248 / 341 / 461 tokens: 1.16-1.37x), at three from
~320 in the off-list sweep, while 294 tokens in three and 401 in four still lost (0.95x, 0.90x). T and N are
shapes, the split is not, so the rule is on the mean length T / N >= 160 (about 2.5 chunks). It moves the
official rows of 341 and 461 tokens in two sequences.

Why the split (measured with v1, whose chunk step took ~8 us; v1.4's takes ~5.5 us at 2107 tokens in
one sequence): in the runner run of 2026-11-29 (100 workloads, kernels/gdn_prefill/NOTES.md) the
token-serial kernel took about 3 us + 0.19 us per token of the longest sequence, and the chunked one
about 9 us for its first chunk and 8 us per further chunk; the token-serial kernel was faster on
every workload of up to 42 tokens, the chunked one on all above 42 but ten of 67-132 tokens whose
longest sequence needs a second chunk (by 4-16 %; T alone cannot tell them apart). Any threshold
from 36 to 46 gives the same geomean; with T <= 40 no sequence can be longer than 40 tokens. v1.8's
token-serial kernel moves no threshold: in the A/B it lost to the chunked one at every T of 41-64
(0.76-0.91x).

Same contract as both: destination passing, definition order, `state` None means zeros, `scale`
None or 0 means 1/sqrt(128), CUDA-graph safe.
"""

from __future__ import annotations

from typing import Callable

from . import chunked, token_serial, wy_prepass
from .token_serial import GPU_ARCH, GdnShapeError, resolve_scale

__all__ = [
    "TOKEN_SERIAL_MAX_TOKENS",
    "WY_PREPASS_MIN_MEAN_LENGTH",
    "WY_PREPASS_MIN_TOKENS",
    "GdnShapeError",
    "compile_only",
    "path_for",
    "resolve_scale",
    "run",
]

TOKEN_SERIAL_MAX_TOKENS = 40
WY_PREPASS_MIN_TOKENS = 512
WY_PREPASS_MIN_MEAN_LENGTH = 160


def path_for(num_tokens: int, num_seqs: int):
    """The module whose `run` serves a batch of `num_tokens` tokens in `num_seqs` sequences."""
    if num_tokens <= TOKEN_SERIAL_MAX_TOKENS:
        return token_serial
    if num_tokens >= WY_PREPASS_MIN_TOKENS or num_tokens >= WY_PREPASS_MIN_MEAN_LENGTH * num_seqs:
        return wy_prepass
    return chunked


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """Compile every path's kernels for `arch` without touching a GPU (for CI and warm-up: no call
    compiles lazily afterwards)."""
    return token_serial.compile_only(arch), *chunked.compile_only(arch), *wy_prepass.compile_only(arch)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """Destination-passing entry: fills `output` [T,8,128] bf16 and `new_state` [N,8,128,128] fp32."""
    path_for(q.shape[0], new_state.shape[0]).run(
        q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state
    )
