"""MoE candidate v2.39 (NOTES.md): `kernel.py` with C rewritten as f16 times a power of two per packed row wherever
GEMM2 is on warpgroup MMA (from WGMMA_GEMM1_MIN_TOKENS: FEW_TOKENS, MEDIUM_T, LARGE_T), so that GEMM2 multiplies f16
and converts its e4m3 weights once per pair instead of four times (e4m3 -> f16 -> f32 -> bf16).

Why: at 901 tokens GEMM2 streams W2 at ~2.3 TB/s after GEMM1 ends, and session 16's ncu found this GEMM2
issue-bound with the conversions 31 M of its 87 M warp instructions. The rewrite (`c_to_f16.py`, a kernel between
the GEMMs) keeps every bit of the bf16 C, so the output should be `kernel.py`'s bit for bit (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["F16_C_VARIANTS", "MoeShapeError", "compile_only", "run", "variant_for"]

# kernel.py's WGMMA-GEMM2 variants and their f16 counterparts
F16_C_VARIANTS: dict[StreamingVariant, StreamingVariant] = {
    variant: dataclasses.replace(variant, f16_c=True) for variant in (kernel.FEW_TOKENS, kernel.MEDIUM_T, kernel.LARGE_T)
}


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, with C as scaled f16 where its GEMM2 is on warpgroup MMA."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return F16_C_VARIANTS.get(chosen, chosen)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and the three with f16 C, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), *(kernel.compiled_for(variant, arch) for variant in F16_C_VARIANTS.values()))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
