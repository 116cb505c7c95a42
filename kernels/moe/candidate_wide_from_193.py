"""MoE threshold candidate (the other side of LARGE_T's threshold): `kernel.py` with its LARGE_T variant (GEMM1 in 64-token row
tiles, three stages, the epilogue tile in a token stage, two CTAs per SM) from 193 tokens instead of from
MEDIUM_T_MAX_TOKENS + 1.

Why: this GEMM1 measured 0.98x at T = 901 and 1.15-1.17x at 11948 / 14107 tokens, and no official workload
lies between. This entry is the side that `tools/time_axes.py` sweeps against `kernel.py` off the list to
place the threshold where the two cross (0.99-1.07x at 1024, 1.05-1.09x at 1536, so `kernel.py` switches
above 1024); above MEDIUM_T_MAX_TOKENS both are the same kernels.
Outputs: the same products and promotions per token as `kernel.py` (a tile only regroups tokens), bit for
bit (a GPU test).
"""

from __future__ import annotations

from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "compile_only", "run", "variant_for"]


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s choice of variant with LARGE_T in place of MEDIUM_T."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return kernel.LARGE_T if chosen is kernel.MEDIUM_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations for `arch` without a GPU: this entry adds none."""
    return kernel.compile_only(arch)


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
