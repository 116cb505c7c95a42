"""MoE candidate v2.33 (NOTES.md, session 25): `kernel.py` with every GEMM1 CTA routing up to 8 tokens itself, two per
warp, with the rank and count loops unrolled over every slot.

Why: up to 4 tokens `kernel.py`'s GEMM1 CTAs route every token themselves and meet no other CTA (v2.26: 1.040x at 1
token); at 5-8 tokens they still meet on CTA 0's and CTA 1's routing, a grid-wide wait of ~1-1.5 us before any weight
is requested. Since v2.29 / v2.32 the three-CTA GEMM1's rounds are paired, so its start moves its end. Two tokens per
warp cost a second selection (~0.5 us), and the rank and count loops, a chain of dependent shared-memory loads of up to
64 rounds at 8 tokens, become 64 independent loads under a predicate. Outputs: bit for bit `kernel.py`'s (the same
choices, ranks and weights; a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "TINY_T_EARLY_W2_ROUTE_EIGHT", "TINY_T_THREE_CTAS_ROUTE_EIGHT", "compile_only", "run"]

TINY_T_EARLY_W2_ROUTE_EIGHT = dataclasses.replace(kernel.TINY_T_EARLY_W2, routing_tokens_per_warp=2)
TINY_T_THREE_CTAS_ROUTE_EIGHT = dataclasses.replace(
    kernel.TINY_T_THREE_CTAS, routing_per_cta=True, routing_tokens_per_warp=2
)
_REPLACED = {kernel.TINY_T_EARLY_W2: TINY_T_EARLY_W2_ROUTE_EIGHT, kernel.TINY_T_THREE_CTAS: TINY_T_THREE_CTAS_ROUTE_EIGHT}


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s choice, with routing in every CTA wherever it takes one of its two variants up to 8 tokens."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return _REPLACED.get(chosen, chosen)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this entry's two for `arch`, without a GPU."""
    return (*kernel.compile_only(arch), *(kernel.compiled_for(variant, arch) for variant in _REPLACED.values()))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
