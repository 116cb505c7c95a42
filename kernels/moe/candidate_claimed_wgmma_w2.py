"""MoE candidate v2.44 (NOTES.md): `kernel.py` with MEDIUM_T's WGMMA GEMM2 (193-1024 tokens) claiming its items after
the first from the kept counter, as the `mma.sync` GEMM2 of 7-32 tokens does since v2.34.

Why: ncu of v2.15's GEMM2 at 901 tokens found its busiest SM 7 % above the mean active cycles. Its 396 CTAs become
resident as GEMM1's and the rewrite's retire, so which of them share an SM is not known and a fixed round robin can
leave some SMs an item behind; claims balance the end whatever the placement. Outputs: the same items, products and
sums on other CTAs, so bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MEDIUM_T_CLAIMED_W2", "MoeShapeError", "compile_only", "run", "variant_for"]

MEDIUM_T_CLAIMED_W2 = dataclasses.replace(kernel.MEDIUM_T, gemm2_dynamic_items=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, with MEDIUM_T's GEMM2 claiming its items."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return MEDIUM_T_CLAIMED_W2 if chosen is kernel.MEDIUM_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this candidate's, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(MEDIUM_T_CLAIMED_W2, arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
