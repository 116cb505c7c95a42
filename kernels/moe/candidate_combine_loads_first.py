"""MoE candidate v2.24 (NOTES.md): `kernel.py` with the combine's loads first: each thread loads the token's eight
slots (expert, rank, weight) beside warp 0's counts, then all eight of its rows of expert outputs, and only then sums
them, in slot order with the same FMAs. `kernel.py`'s combine walks the slots as one dependent chain (slot -> branch ->
rank and weight -> row -> sum, eight times: ~17-25 L2 round trips at one token).
Outputs: the same products summed in the same order: bit for bit `kernel.py`'s (GPU tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["LOADS_FIRST", "MoeShapeError", "compile_only", "run", "variant_for"]

# The loads-first form of each of `kernel.py`'s variants.
LOADS_FIRST = {variant: dataclasses.replace(variant, combine_loads_first=True) for variant in kernel.VARIANTS}


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant for `num_tokens`, with the combine's loads first."""
    return LOADS_FIRST[kernel.variant_for(num_tokens)]


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """This entry's configurations (and the counters' zeroing) for `arch` without a GPU."""
    compiled = tuple(kernel.compiled_for(variant, arch) for variant in LOADS_FIRST.values())
    return (*compiled, kernel.counters.compiled_zero(arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
