"""GDN candidate v2.2: `kernel.py` v2.1 with `chunked.py`'s kernel on 16-row V slices where its grid is small.

Why (NOTES.md, v2.2's contract): on the official rows of 41-511 tokens in 1-4 sequences `kernel.py` runs
`chunked.py` with 32 CTAs per sequence on 132 SMs, and its chunk step (~5.5 us) is a chain of dependent phases.
Half of each CTA's per-chunk work scales with its V rows (K S0^T, Q S0^T, V' = T Xb, P V', the state update and
their epilogues); the key side (Gram tiles, the inverse) does not. Halving the slice, as v4.1 did for the
WY-prepass chain, shortens the step on twice the CTAs. Same operations per value, so bit for bit `chunked.py`.
"""

from __future__ import annotations

from typing import Callable

from . import chunked, kernel, wy_prepass
from .token_serial import GPU_ARCH, GdnShapeError

__all__ = ["GdnShapeError", "compile_only", "run"]


class _NarrowChunked(chunked._Chunked):
    """`chunked.py`'s kernel on 16-row V slices (eight CTAs per (sequence, head))."""

    slice_rows = wy_prepass.NARROW_SLICE_ROWS


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s launchers and the narrow chunked kernel's for `arch`, without a GPU."""
    return (*kernel.compile_only(arch), chunked.compiled_for(arch, _NarrowChunked))


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.run`, except that where it takes `chunked.py` for at most NARROW_MAX_SEQS sequences (the narrow grid
    then fits in one wave of two CTAs per SM, as for the WY-prepass chain) the narrow kernel runs."""
    num_seqs = new_state.shape[0]
    if kernel.path_for(q.shape[0], num_seqs) is chunked and num_seqs <= wy_prepass.NARROW_MAX_SEQS:
        chunked.run_kernel(_NarrowChunked, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
        return
    kernel.run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
