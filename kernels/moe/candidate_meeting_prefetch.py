"""MoE candidate v2.37 (NOTES.md, session 26): `kernel.py` with the `mma.sync` GEMM1 of 5-32 tokens prefetching some of
its chosen experts' weights into L2 while its grid meets.

Why: at 5-32 tokens every GEMM1 CTA waits for the routing CTAs before it asks for any weight, and DRAM idles from the
choices to the first stages' requests (the meeting, then the schedule). Each routing lane that chose a local expert
prefetches the W13 rows of a few of that expert's GEMM1 items once its CTA has released its tokens
(`streaming_gemm.prefetch_chosen_items`): ~6.3 MB at 7 tokens, which the grid's stream then reads from L2. Outputs: bit
for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "compile_only", "run", "variant_for"]

_REPLACED = {
    variant: dataclasses.replace(variant, gemm1_meeting_prefetch=True)
    for variant in (kernel.TINY_T_EARLY_W2, kernel.TINY_T_THREE_CTAS, kernel.TINY_T)
}


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s choice, with the meeting's prefetch wherever its GEMM1 is the `mma.sync` one (up to 32 tokens; up
    to 4 tokens nothing changes: every CTA routes them all and meets no other)."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return _REPLACED.get(chosen, chosen)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this entry's three for `arch`, without a GPU."""
    return (*kernel.compile_only(arch), *(kernel.compiled_for(variant, arch) for variant in _REPLACED.values()))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
