"""MoE candidate v2.14 (NOTES.md): `kernel.py` with its warpgroup-MMA GEMMs (from WGMMA_GEMM1_MIN_TOKENS: FEW_TOKENS,
MEDIUM_T, LARGE_T) issuing each K stage's weight, token and C copies from per-item bases (`lean_issue` of
`WgmmaGemm1Config` and `WgmmaGemm2Config`), as v2.5 does for the `mma.sync` GEMMs below.

Why: session 16's ncu of the WGMMA GEMM1 at 901 tokens counted a third of its instructions as integer address
arithmetic; its SASS (ptxas 12.8) rebuilds every copy's 64-bit address from expert, row and K at every stage (~190
instructions of a common stage's load part at 32-token tiles), the pattern v2.13 removed from the `mma.sync` GEMMs
for 1.060x. Here: GEMM1's common load part ~193 -> ~138 instructions, GEMM2's ~74 fewer per stage.

Same copies, same arithmetic: the output is `kernel.py`'s bit for bit (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "compile_only", "run", "variant_for"]

LEAN = {variant: dataclasses.replace(variant, lean_issue=True) for variant in kernel.VARIANTS if variant.wgmma_gemm1}


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, with the lean stage issue where its GEMMs are on warpgroup MMA."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return LEAN.get(chosen, chosen)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and its WGMMA variants with the lean stage issue, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), *(kernel.compiled_for(variant, arch) for variant in LEAN.values()))


run = kernel.make_run(variant_for)
