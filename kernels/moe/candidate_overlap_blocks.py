"""MoE candidate v2.43 (NOTES.md): `kernel.py` with every WGMMA GEMM1 (33 tokens and up) issuing both quantisation
blocks of a K stage before promoting the first, into two accumulators, so that block 0's promotion (the scale loads
and 16-32 FMAs a thread) overlaps block 1's MMAs instead of following a wait for them.

Why: the WGMMA GEMMs were found bound by each warp's dependent chain (session 16's ncu of GEMM1: no eligible warp 58 %
of cycles; session 27's of GEMM2), and a third CTA per SM paid in both (v2.40, v2.41). Within a CTA the chain per K
stage is MMA -> wait -> promote -> MMA -> wait -> promote; this takes one wait out of it. Outputs: the same block sums,
promoted in the same order, so bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["OVERLAPPED", "MoeShapeError", "compile_only", "run", "variant_for"]

# kernel.py's WGMMA-GEMM1 variants, each with its overlapped twin.
OVERLAPPED = {
    variant: dataclasses.replace(variant, gemm1_overlap_blocks=True) for variant in kernel.VARIANTS if variant.wgmma_gemm1
}


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, its WGMMA GEMM1 overlapping a stage's two blocks."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return OVERLAPPED.get(chosen, chosen)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this candidate's, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), *(kernel.compiled_for(v, arch) for v in OVERLAPPED.values()))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
