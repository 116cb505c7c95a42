"""MoE candidate v2.45 (NOTES.md): `kernel.py` with every WGMMA GEMM1 (33 tokens and up) reading a block's products of
weight block scale and token scale from shared memory between its MMAs' commit and their wait, instead of after it.

Why: ncu of v2.15's GEMM1 at 901 tokens found the short scoreboard its largest stall (17 % of samples), on the
promotion's multiplies waiting for those loads, issued after the wait (which no load crosses). Outputs: the same
products, added in the same order, so bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["SCALES_BEFORE_WAIT", "MoeShapeError", "compile_only", "run", "variant_for"]

# kernel.py's WGMMA-GEMM1 variants, each with its twin that reads the scales before the wait.
SCALES_BEFORE_WAIT = {
    variant: dataclasses.replace(variant, gemm1_scales_before_wait=True)
    for variant in kernel.VARIANTS
    if variant.wgmma_gemm1
}


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, its WGMMA GEMM1 reading a block's scales before the wait."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return SCALES_BEFORE_WAIT.get(chosen, chosen)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this candidate's, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), *(kernel.compiled_for(v, arch) for v in SCALES_BEFORE_WAIT.values()))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
