"""MoE candidate v2.58 (`cand_fused_early_w2`): `kernel.py` with the fused GEMMs issuing a CTA's first GEMM2 weights
before its readiness check, from 1 token on: up to 4 tokens with every CTA routing the tokens itself (as the early-W2
variant's GEMM1 does) and the readiness words kept and zeroed by the combine, instead of the early-W2 variant's two
chained GEMMs; from 5 to 32 tokens `kernel.py`'s fused GEMMs with the early weights.

Why (NOTES, session 32): at 1 token GEMM2 ends 10.2 us after GEMM1 for 29.4 MB (2.9 TB/s over that window), with a
programmatic wait for the whole GEMM1 grid and a GEMM2 grid that becomes resident as GEMM1's CTAs retire; in the fused
kernel a CTA goes on to its first GEMM2 item right after its GEMM1 item, its weights already in flight. At 5 tokens'
~1-expert trial the fused kernel's CTAs without a GEMM1 item issued nothing before their expert was done (0.955x).
Outputs: the same items, products and promotions: bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import counters, fused_gemms, kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["FUSED_EARLY_W2", "FUSED_ROUTING_PER_CTA", "MoeShapeError", "compile_only", "run", "variant_for"]

FUSED_EARLY_W2 = dataclasses.replace(kernel.FUSED_T, fused_weights_before_ready=True)
FUSED_ROUTING_PER_CTA = dataclasses.replace(FUSED_EARLY_W2, routing_per_cta=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """The fused GEMMs with early weights below WGMMA_GEMM1_MIN_TOKENS (every CTA routing up to 4 tokens), else
    `kernel.py`'s variant."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    if chosen is kernel.TINY_T_EARLY_W2:
        return FUSED_ROUTING_PER_CTA
    return FUSED_EARLY_W2 if chosen is kernel.FUSED_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations, this entry's two and the zeroing of a new kept readiness buffer, without a GPU."""
    return (
        *kernel.compile_only(arch),
        kernel.compiled_for(FUSED_EARLY_W2, arch),
        kernel.compiled_for(FUSED_ROUTING_PER_CTA, arch),
        counters.compiled_zero(arch, fused_gemms.READY_WORDS),
    )


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
