"""MoE candidate v2.41 (NOTES.md): `kernel.py` with MEDIUM_T's GEMM1 (193-1024 tokens: 32-token row tiles) in 3 stages
at three CTAs per SM instead of 4 stages at two, its epilogue tile in the token stage just consumed (~73 KB a CTA
instead of ~104): 9 stages in flight per SM instead of 8.

Why: after v2.40 GEMM1 is ~220 of the ~360 us at 901 tokens and streams W13 at ~3.1 TB/s, and session 16's ncu of
this GEMM1 found it latency-bound at 8 warps per SM (no eligible warp 58 % of cycles; stalls: wait, barrier, short
scoreboard), as v2.39's ncu found the GEMM2 that v2.40's third CTA made 1.025x faster. Its 78 registers a thread allow
three CTAs; the epilogue tile in a stage (LARGE_T's since v2.2) lets their shared memory fit. Its cooperative grid
(GEMM1 routes the tokens first) grows from 264 to 396 CTAs, all resident. Outputs: the same items, products and sums,
so bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MEDIUM_T_GEMM1_THREE_CTAS", "MoeShapeError", "compile_only", "run", "variant_for"]

MEDIUM_T_GEMM1_THREE_CTAS = dataclasses.replace(
    kernel.MEDIUM_T, num_stages=3, gemm1_scratch_in_stage=True, gemm1_ctas_per_sm=3
)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, with MEDIUM_T's GEMM1 at three CTAs per SM."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return MEDIUM_T_GEMM1_THREE_CTAS if chosen is kernel.MEDIUM_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this candidate's, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(MEDIUM_T_GEMM1_THREE_CTAS, arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
