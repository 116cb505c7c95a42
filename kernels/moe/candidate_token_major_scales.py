"""MoE candidate v2.55 (NOTES.md, session 31): `kernel.py` v2.16 with MEDIUM_T's GEMM1 (193 to MEDIUM_T_MAX_TOKENS
tokens) reading each stage's two token scales as one 8-B copy from a token-major copy of x_scale, which its producer
warps write while the other warps route.

Why: v2.16's GEMM1 at 901 tokens runs the L2 at 87.8 % of its throughput. x_scale is [56, T], so a token's two scales
of a K stage lie T x 4 bytes apart: each stage's producer issues 64 4-B copies to 64 different lines (a quarter of the
stage's ~260 L2 requests, ~8 % of its sectors). Token-major, they are 32 copies of 8 B. The same values reach the same
promotions, so the outputs are bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["TOKEN_MAJOR_SCALES", "MoeShapeError", "compile_only", "run", "variant_for"]

TOKEN_MAJOR_SCALES = dataclasses.replace(kernel.MEDIUM_T, gemm1_token_major_scales=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, MEDIUM_T's GEMM1 with token-major scales."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TOKEN_MAJOR_SCALES if chosen is kernel.MEDIUM_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this candidate's, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(TOKEN_MAJOR_SCALES, arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
