"""GDN candidate v4.1: candidate v4.0 (`candidate_wy_prepass.py`) with the chain on 16-row V slices instead of 32.

Why (NOTES.md, v4.1's contract): with the key side in the prepass, a chain CTA's chunk step is its state
products, V' = T Xb, the output and the state update, all of which scale with its V rows; at one long sequence
v4.0 runs 32 CTAs on 132 SMs. Halving the slice halves each CTA's MMA and epilogue work per chunk on twice the
CTAs. The prepass and every operation per value are v4.0's, so the outputs are bit for bit the same (a GPU test).
"""

from __future__ import annotations

from typing import Callable

from . import candidate_wy_prepass as v4
from .token_serial import GPU_ARCH, GdnShapeError

__all__ = ["GdnShapeError", "compile_only", "run", "run_two_kernels"]


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """This entry's launchers for `arch`, without a GPU."""
    return v4.compile_only(arch, v4.NARROW_SLICE_ROWS)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """v4.0's `run` (kernel.py below V4_MIN_TOKENS tokens) with the narrow chain from there."""
    v4.run_with_slices(v4.NARROW_SLICE_ROWS, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)


def run_two_kernels(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """The two kernels with the narrow chain at any T (the threshold sweep's side)."""
    v4.two_kernels_with_slices(
        v4.NARROW_SLICE_ROWS, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state
    )
