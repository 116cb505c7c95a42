"""MoE candidate v1.7 ("routing loads first"): `kernel.py` v1.6 with the routing kernel issuing all of
a token's logit and bias loads before its first sigmoid, and taking the chosen experts' scores from
the lanes that computed them instead of loading them again (`routing.route_token(loads_first=True)`).

Why (session 9, ncu of the routing kernel at T = 1 and 58): 7-9 us for ~1,400 instructions per warp,
no eligible warp in ~88 % of cycles, and the stall samples sit on the first instruction of each
sigmoid (long scoreboard): the division's branchy slow path keeps the next load from issuing, so the
eight cold loads of a token are paid one after the other, and the ninth (the chosen score) after the
top-8 search. The routing is the first kernel of every streaming call and GEMM1 waits for it.

Prediction: routing ~7 -> ~4 us at every streaming T: T = 1 ~47 -> ~44 us (1.07x), T = 7-16 ~1.03x,
52-80 ~1.015x (58 and 80 to ~3.0 TB/s), 901 ~1.005x. Outputs bitwise kernel.py's (the same fp32
operations on the same values; only the order of the loads and where a score comes from change).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "VARIANTS", "compile_only", "run", "variant_for"]

VARIANTS = tuple(dataclasses.replace(variant, routing_loads_first=True) for variant in kernel.VARIANTS)


def variant_for(num_tokens: int) -> StreamingVariant | None:
    """`kernel.py`'s choice, with the routing's loads first (None: the grouped pipeline, unchanged)."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return None if chosen is None else dataclasses.replace(chosen, routing_loads_first=True)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the candidate's variants and `kernel.py`'s configurations for `arch` without a GPU."""
    return (*(kernel.compiled_for(variant, arch) for variant in VARIANTS), *kernel.compile_only(arch))


# `kernel.py`'s contract, with this candidate's routing.
run = kernel.make_run(variant_for)
