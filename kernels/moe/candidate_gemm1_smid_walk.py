"""MoE candidate v2.42 (NOTES.md): candidate v2.41's GEMM1 for MEDIUM_T (193-1024 tokens: 32-token row tiles in 3
stages at three CTAs per SM, the epilogue tile in a stage) walking by SM id: its round robin runs over slot x 132 +
`%smid`, each CTA's slot drawn from the kept per-SM counters (v2.32's draw), so SM s takes the items = s mod 132.

Why: v2.41 shortened GEMM1 by ~5 % but lost on 2 of 5 routings at 901 tokens. The H200 places CTAs 0-23 of its
396-CTA cooperative grid three each on 8 front SMs, so whenever the last round of the walk over CTA indices holds 24 or
more items those 8 SMs run a whole round more than most (NOTES session 28). Outputs: the same items, products and
sums on other CTAs, so bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MEDIUM_T_GEMM1_SMID_WALK", "MoeShapeError", "compile_only", "run", "variant_for"]

MEDIUM_T_GEMM1_SMID_WALK = dataclasses.replace(
    kernel.MEDIUM_T, num_stages=3, gemm1_scratch_in_stage=True, gemm1_ctas_per_sm=3, gemm1_smid_walk=True
)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, with MEDIUM_T's GEMM1 at three CTAs per SM walking by SM id."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return MEDIUM_T_GEMM1_SMID_WALK if chosen is kernel.MEDIUM_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this candidate's, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(MEDIUM_T_GEMM1_SMID_WALK, arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
