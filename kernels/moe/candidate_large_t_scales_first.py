"""MoE candidate v2.46 (NOTES.md): `kernel.py` with LARGE_T's GEMM1 (above MEDIUM_T_MAX_TOKENS: 64-token tiles at two
CTAs per SM) reading a block's products of weight block scale and token scale from shared memory between its MMAs'
commit and their wait, instead of after it.

Why: v2.45, the same switch on every WGMMA GEMM1, gained nothing at 901 tokens and 1.025x at 11948 (5 of 5 trials),
where fewer warps with twice the accumulator cover less of the wait for those loads. Outputs: the same products,
added in the same order, so bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["LARGE_T_SCALES_FIRST", "MoeShapeError", "compile_only", "run", "variant_for"]

LARGE_T_SCALES_FIRST = dataclasses.replace(kernel.LARGE_T, gemm1_scales_before_wait=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, LARGE_T's GEMM1 reading a block's scales before the wait."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return LARGE_T_SCALES_FIRST if chosen is kernel.LARGE_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this candidate's, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(LARGE_T_SCALES_FIRST, arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
