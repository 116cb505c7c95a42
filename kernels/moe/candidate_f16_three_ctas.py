"""MoE candidate v2.40 (NOTES.md): candidate v2.39's f16 GEMM2 above FEW_TOKENS_MAX (MEDIUM_T, LARGE_T) with two stages
and three CTAs per SM instead of three stages and two.

Why: ncu of v2.39's GEMM2 at 901 tokens (session 27) found it neither issue- nor memory-bound: 1.81 instructions per
cycle per SM, DRAM at 37 %, and of its ~2 warps per scheduler only 0.59 eligible a cycle, each warp's stage a chain of
shared-memory loads, conversions and MMAs that waits on its own results (stalls: wait 22 %, short scoreboard 15 %,
long scoreboard 10 %). A third CTA per SM gives each scheduler three such chains; two stages of 32 tokens (~66 KB of
shared memory) make room for it, with as many weight bytes in flight per SM as two CTAs of three stages.
Outputs: the same products and sums per item as v2.39 (only the pipeline depth and the CTAs change), so bit for bit
`kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .candidate_f16_wgmma_c import F16_C_VARIANTS
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["THREE_CTA_VARIANTS", "MoeShapeError", "compile_only", "run", "variant_for"]

# kernel.py's variants above FEW_TOKENS_MAX and their f16, three-CTA GEMM2 counterparts
THREE_CTA_VARIANTS: dict[StreamingVariant, StreamingVariant] = {
    variant: dataclasses.replace(F16_C_VARIANTS[variant], gemm2_num_stages=2, gemm2_ctas_per_sm=3)
    for variant in (kernel.MEDIUM_T, kernel.LARGE_T)
}


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, with the f16 three-CTA GEMM2 above FEW_TOKENS_MAX."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return THREE_CTA_VARIANTS.get(chosen, chosen)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and the two of this candidate, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), *(kernel.compiled_for(variant, arch) for variant in THREE_CTA_VARIANTS.values()))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
