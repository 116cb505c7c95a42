"""MoE candidate v2.15 (NOTES.md): `kernel.py` with the routing's warp walking a token's 256 experts as 8 per
lane (`routing.route_token_by_lanes`) instead of one expert of each group per lane (`routing.route_token`).

Why: the call's timeline (NOTES.md, session 12) puts the routing kernel's end at 6.7-8.4 us after the call's
first GPU start at every T, and GEMM1 waits for it before it streams a byte. One warp routes a token through a
dependent chain of ~200 shuffles and their selects; here each of the eight picks is two `redux.sync`.
Outputs: the same experts, slots and weights as `kernel.py`, so the same output bit for bit (GPU tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "VARIANTS", "compile_only", "run", "variant_for"]

VARIANTS = tuple(dataclasses.replace(variant, routing_by_lanes=True) for variant in kernel.VARIANTS)
_BY_LANES = dict(zip(kernel.VARIANTS, VARIANTS))


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant for `num_tokens`, with the routing by lanes."""
    return _BY_LANES[kernel.variant_for(num_tokens)]  # kernel.variant_for rejects an empty batch


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """This entry's four configurations for `arch`, without a GPU."""
    return tuple(kernel.compiled_for(variant, arch) for variant in VARIANTS)


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
