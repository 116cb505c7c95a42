"""GDN candidate v4.2: `kernel.py` v2.1 with the WY-prepass path's key side in ~66 KB of shared memory instead of
~94, so that three of its CTAs fit on an SM instead of two (`_KeySide(lean=True)`, `wy_prepass.py`).

Why (NOTES.md, v4.2's contract): at 8192 tokens in 32 sequences the prepass took 41.8 of the call's 137.6 us
(session 12's breakdown), over ~1300 CTAs in about five waves of a latency-bound phase sequence. Its outputs are
v2.1's bit for bit (the same operations; only where k is staged and where P is written change).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from . import kernel, wy_prepass
from .token_serial import GPU_ARCH, GdnShapeError

__all__ = ["GdnShapeError", "compile_only", "run"]


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s launchers and the lean WY-prepass launchers for `arch`, without a GPU."""
    lean = tuple(wy_prepass.compiled_for(arch, replace(c, lean_prepass=True)) for c in wy_prepass.CONFIGS)
    return (*kernel.compile_only(arch), *lean)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.run`, with the lean key side wherever it takes the WY-prepass path."""
    num_seqs = new_state.shape[0]
    if kernel.path_for(q.shape[0], num_seqs) is wy_prepass:
        config = replace(wy_prepass.config_for(num_seqs), lean_prepass=True)
        wy_prepass.run_with_config(config, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
        return
    kernel.run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
