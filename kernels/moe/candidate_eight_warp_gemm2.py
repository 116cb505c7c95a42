"""MoE candidate v2.12 (NOTES.md): `kernel.py` with the `mma.sync` GEMM2 of TINY_T (below WGMMA_GEMM1_MIN_TOKENS) on
8 warps per CTA instead of 4: two warps per 128-wide K block of a stage, each on one 64-wide half.

Why: TINY_T's GEMM2 is bound by each warp's per-stage dependency chain, not by its instructions' issue slots
(session 16: ncu's top stall is "wait"; candidate v2.11 cut its conversions by ~65 % for ~8 %). Twice the warps
per SM (four per scheduler, each with half the chain per stage) hide more of it; shared memory still fits two
CTAs per SM. The partial sums are summed over 8 warps instead of 4, so the output is `kernel.py`'s up to fp32
rounding (a GPU test bounds the difference).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "compile_only", "run", "variant_for"]

TINY_T_EIGHT_WARP_GEMM2 = dataclasses.replace(kernel.TINY_T, gemm2_warps_per_block=2)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, with the 8-warp GEMM2 where that is TINY_T."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TINY_T_EIGHT_WARP_GEMM2 if chosen is kernel.TINY_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and TINY_T with the 8-warp GEMM2, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(TINY_T_EIGHT_WARP_GEMM2, arch))


run = kernel.make_run(variant_for)
