"""MoE candidate v2.48 (NOTES.md): `kernel.py` with MEDIUM_T's GEMM1 (193 to MEDIUM_T_MAX_TOKENS tokens) in six stages one
quantisation block (128) wide instead of three of two blocks (256), in the same shared memory at three CTAs per SM.

Why: v2.47 measured one stage less in flight per CTA at ~3.5 % of the call at 256 tokens; six 12-KB stages leave five in
flight (60 KB) while a CTA computes one, where three 24-KB stages leave two (48 KB). The epilogue's fp32 tile then lies
in the slot's weight stage. Outputs: the same blocks promoted in the same order, so bit for bit `kernel.py`'s (a GPU
test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant
from .shapes import BLOCK

__all__ = ["NARROW_STAGES", "MoeShapeError", "compile_only", "run", "variant_for"]

# GEMM2 keeps MEDIUM_T's own stages (gemm2_num_stages is set there).
NARROW_STAGES = dataclasses.replace(kernel.MEDIUM_T, num_stages=6, gemm1_stage_k=BLOCK)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, MEDIUM_T's GEMM1 in six 128-wide stages."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return NARROW_STAGES if chosen is kernel.MEDIUM_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this candidate's, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(NARROW_STAGES, arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
