"""MoE candidate v2.36 (NOTES.md, session 25; written then, not yet run on a GPU): `kernel.py` with the meeting of the
`mma.sync` GEMM1 (5-32 tokens) polling the routed count with loads instead of atomic adds of 0.

Why: at 5-32 tokens every GEMM1 CTA waits for the routing CTAs on one kept word before any weight is requested, and its
thread 0 polls it with `atom.add 0`: at 7 tokens 396 read-modify-writes at a time queue on one address in L2, the routing
CTAs' own adds among them. Strong relaxed loads at GPU scope read the word without that queue; the fence after the poll
that sees T keeps the acquire (`routing.wait_until_routed`). Outputs: bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "compile_only", "run", "variant_for"]

_REPLACED = {
    variant: dataclasses.replace(variant, gemm1_meets_by_load=True)
    for variant in (kernel.TINY_T_EARLY_W2, kernel.TINY_T_THREE_CTAS, kernel.TINY_T)
}


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s choice, with the meeting polled by load wherever its GEMM1 is the `mma.sync` one (up to 32
    tokens; up to 4 tokens nothing changes, every CTA routes them all and meets no other)."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return _REPLACED.get(chosen, chosen)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this entry's three for `arch`, without a GPU."""
    return (*kernel.compile_only(arch), *(kernel.compiled_for(variant, arch) for variant in _REPLACED.values()))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
