"""MoE candidate v2.26 (NOTES.md): `kernel.py` with every GEMM1 CTA routing the tokens itself up to 4 tokens.

Up to ROUTING_WARPS (4) tokens `kernel.py`'s CTA 0 routes them and the other 263 CTAs of GEMM1's cooperative grid wait
on its add to the kept routed count (a poll and two fences each) before their schedule. Here every CTA routes all of
them (warp w token w, the same choice), ranks each token among the earlier ones that chose the same expert, writes the
same counts, lists and slots as every other CTA and goes on without waiting (`routing.route_in_every_cta`). Only
`TINY_T_EARLY_W2` (up to 6 tokens) carries it; at 5-6 tokens its kernel takes the meeting as `kernel.py`'s does.
Outputs: the same FMAs in the same order per output row: bit for bit `kernel.py`'s (GPU tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["PER_CTA", "MoeShapeError", "compile_only", "run", "variant_for"]

PER_CTA = dataclasses.replace(kernel.TINY_T_EARLY_W2, routing_per_cta=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant for `num_tokens`, with the routing in every CTA where that is TINY_T_EARLY_W2."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return PER_CTA if chosen is kernel.TINY_T_EARLY_W2 else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """This entry's configurations (and the counters' zeroing) for `arch` without a GPU."""
    variants = (PER_CTA, *kernel.VARIANTS[1:])
    return (*(kernel.compiled_for(variant, arch) for variant in variants), kernel.counters.compiled_zero(arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
