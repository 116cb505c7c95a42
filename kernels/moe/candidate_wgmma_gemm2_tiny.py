"""MoE candidate v2.6 (`cand_wgmma_gemm2_below_33`): below 33 tokens `kernel.py`'s TINY_T with GEMM2 on bf16
warpgroup MMA (`wgmma_gemm2.py`, FEW_TOKENS' 8-token tiles and 4 stages) behind the same `mma.sync` GEMM1, which
now stores C in the permuted column order that GEMM2 reads (`streaming_gemm.c_column`).

Why (session 12's timeline, NOTES.md): at 1 and 16 tokens GEMM2 on `mma.sync` streams W2 at ~2.1-2.6 TB/s
against GEMM1's ~2.5-3.2 (64-KB items of 4 K stages, a CTA barrier per item). The WGMMA GEMM2 won 1.02x at
52-62 tokens and 1.22x at 901 over the `mma.sync` one. v2.4 (both GEMMs on WGMMA below 33) lost at 1-7 tokens
because the WGMMA GEMM1's 64-row items halve the CTAs streaming W13; here GEMM1 keeps its 32-row items. The
WGMMA GEMM2's 64-row items are 112 per expert and row tile, fewer than the 264 CTAs at one or two experts, so
1-7 tokens may lose again. Above 32 tokens this entry is `kernel.py`.
Outputs: GEMM1's C is `kernel.py`'s bit for bit (only where it is stored changes); GEMM2 sums in another
order, so the output is checked against the reference.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "TINY_WGMMA_GEMM2", "compile_only", "run", "variant_for"]

TINY_WGMMA_GEMM2 = dataclasses.replace(kernel.TINY_T, wgmma_gemm2=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s choice of variant with TINY_WGMMA_GEMM2 in place of TINY_T."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TINY_WGMMA_GEMM2 if chosen is kernel.TINY_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this entry's for `arch` without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(TINY_WGMMA_GEMM2, arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
