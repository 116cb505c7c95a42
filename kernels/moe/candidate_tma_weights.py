"""MoE candidate v2.50 (NOTES.md): `kernel.py` with MEDIUM_T's GEMM1 (193 to MEDIUM_T_MAX_TOKENS tokens) fetching its weight
stages by TMA (two 8-KB boxes per stage on the slot's mbarrier) instead of eight 16-B `cp.async` copies per thread.

Why: v2.47 and v2.48 found this GEMM1 paying most for what each K stage costs, and two thirds of a stage's copy
instructions are the weight tile's. Outputs: the same bytes in the same shared-memory layout, so bit for bit
`kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["TMA_WEIGHTS", "MoeShapeError", "compile_only", "run", "variant_for"]

TMA_WEIGHTS = dataclasses.replace(kernel.MEDIUM_T, gemm1_tma_weights=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, MEDIUM_T's GEMM1 weights by TMA."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TMA_WEIGHTS if chosen is kernel.MEDIUM_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this candidate's, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(TMA_WEIGHTS, arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
