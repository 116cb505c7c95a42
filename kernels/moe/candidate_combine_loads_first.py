"""MoE candidate v2.25 (NOTES.md): `kernel.py` with v2.24's loads-first combine up to FEW_TOKENS_MAX tokens only.

v2.24 (session 22) gained 1.004-1.024x on every trial at 1-80 tokens (the combine's dependent chain of slot, rank,
row and sum, eight times, shortened to three rounds of loads) and lost 1-3 % at 901-14107 tokens, where its 92
registers per thread (against 28) cut the CTAs per SM from 16 to 5 while a thread has about one row to load anyway.
Up to FEW_TOKENS_MAX the combine is at most 1344 CTAs (192 tokens x 7), about 10 per SM: occupancy does not bind.
Outputs: the same FMAs in the same order: bit for bit `kernel.py`'s (GPU tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["LOADS_FIRST", "MoeShapeError", "compile_only", "run", "variant_for"]

# The loads-first form of each of `kernel.py`'s variants up to FEW_TOKENS_MAX.
LOADS_FIRST = {
    variant: dataclasses.replace(variant, combine_loads_first=True)
    for variant in (kernel.TINY_T_EARLY_W2, kernel.TINY_T, kernel.FEW_TOKENS)
}


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant for `num_tokens`, with the combine's loads first up to FEW_TOKENS_MAX tokens."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return LOADS_FIRST[chosen] if num_tokens <= kernel.FEW_TOKENS_MAX else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """This entry's configurations (and the counters' zeroing) for `arch` without a GPU."""
    variants = (*LOADS_FIRST.values(), kernel.MEDIUM_T, kernel.LARGE_T)
    return (*(kernel.compiled_for(variant, arch) for variant in variants), kernel.counters.compiled_zero(arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
