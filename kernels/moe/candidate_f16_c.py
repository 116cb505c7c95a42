"""MoE candidate v2.11 (NOTES.md): `kernel.py` with C rewritten as f16 times a power of two per packed row below
WGMMA_GEMM1_MIN_TOKENS (TINY_T), so that the `mma.sync` GEMM2 multiplies f16 and converts its e4m3 weights once per
pair instead of four times (e4m3 -> f16 -> f32 -> bf16).

Why: ncu at 1 and 14 tokens (session 16) found TINY_T's GEMM2 issue-limited, 40 % of its instructions those
conversions. The rewrite (`c_to_f16.py`, a sixth kernel after GEMM1) keeps every bit of the bf16 C, so the
output should be `kernel.py`'s bit for bit (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "compile_only", "run", "variant_for"]

TINY_T_F16_C = dataclasses.replace(kernel.TINY_T, f16_c=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, with C as scaled f16 where that is TINY_T."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TINY_T_F16_C if chosen is kernel.TINY_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and TINY_T with f16 C, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(TINY_T_F16_C, arch))


run = kernel.make_run(variant_for)
