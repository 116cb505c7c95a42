"""MoE candidate v2.38 (NOTES.md, session 26): `kernel.py` with the early-weights GEMM2 of 1-6 tokens claiming its items
after the first, as the `mma.sync` GEMM2 of 7-32 tokens does since v2.34.

Why: that GEMM2 walks a fixed round robin; at 1 token with 2 experts its 448 items over 264 CTAs leave 52 SMs with four
items and 80 with three. CTA c's first item stays c (its weights issued before the programmatic wait, as now); its
first claim is taken right after the schedule, which in this GEMM2 comes before the wait. Outputs: bit for bit
`kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "compile_only", "run", "variant_for"]

TINY_T_EARLY_W2_CLAIMED = dataclasses.replace(kernel.TINY_T_EARLY_W2, gemm2_dynamic_items=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s choice, with the early-weights GEMM2's items claimed (up to EARLY_W2_MAX_TOKENS tokens)."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TINY_T_EARLY_W2_CLAIMED if chosen == kernel.TINY_T_EARLY_W2 else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this entry's one for `arch`, without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(TINY_T_EARLY_W2_CLAIMED, arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
