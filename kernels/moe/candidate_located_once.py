"""MoE candidate v2.7 (NOTES.md): `kernel.py` with each streaming GEMM locating a work item once.

Why: ncu of `kernel.py` v2.3 at T = 901 (session 15) found both WGMMA GEMMs bound by neither DRAM (36 % /
28 % of peak) nor L2 (58 % / 44 %) but by the latency of each K stage's instruction chain (0.4 instructions
per cycle per scheduler at two warps each). Every K stage locates its item's row tile twice (the load it
issues and the stage it computes: a five-step binary search over shared-memory tables each) and reloads
its thread's token id from global memory, although an item's 28 (GEMM1) or 8 (GEMM2) K stages share one.
Here each GEMM locates an item when the load of its first K stage is issued (and its epilogue or, for the
`mma.sync` GEMMs, its first computed stage), and keeps the result in registers.

Entries: `run` (that alone, in every variant) and `run_overlapped` (also the WGMMA GEMM1 issuing both K
blocks of a stage before promoting the first, as the WGMMA GEMM2 does). Both give `kernel.py`'s outputs
bit for bit (the same MMAs and promotions in the same order; a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "compile_only", "run", "run_overlapped", "variant_for", "variant_for_overlapped"]


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant with every GEMM locating each item once."""
    return dataclasses.replace(kernel.variant_for(num_tokens), located_once=True)


def variant_for_overlapped(num_tokens: int) -> StreamingVariant:
    """`variant_for`'s, with the WGMMA GEMM1 (from kernel.WGMMA_GEMM1_MIN_TOKENS) overlapping its promotion."""
    variant = variant_for(num_tokens)
    return dataclasses.replace(variant, gemm1_overlapped=True) if variant.wgmma_gemm1 else variant


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """Both entries' configurations for `arch` without a GPU (one per variant and entry)."""
    tokens_per_variant = (1, kernel.WGMMA_GEMM1_MIN_TOKENS, kernel.MEDIUM_T_MAX_TOKENS, kernel.MAX_TOKENS)
    variants = {choose(num_tokens) for choose in (variant_for, variant_for_overlapped) for num_tokens in tokens_per_variant}
    return tuple(kernel.compiled_for(variant, arch) for variant in sorted(variants, key=repr))


run = kernel.make_run(variant_for)
run_overlapped = kernel.make_run(variant_for_overlapped)
