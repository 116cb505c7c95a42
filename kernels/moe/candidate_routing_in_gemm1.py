"""MoE candidate v2.16 (NOTES.md): `kernel.py` with no routing kernel up to MEDIUM_T_MAX_TOKENS tokens: GEMM1's
grid, launched cooperatively as the call's first kernel, routes the tokens itself (one warp per token, 8 experts
per lane: `routing.route_token_by_lanes`), meets on a kept count of routed tokens (`routing.route_then_meet`)
and then streams as before. Above 1024 tokens (LARGE_T) it is `kernel.py`.

Why (NOTES.md, session 20): GEMM1 starts ~6 us after the routing starts, whatever the routing's length, because
the host's launch of GEMM1 reaches the GPU only then; as the first kernel, GEMM1 starts where the span starts.
Outputs: the same choices, slots and weights as `kernel.py`'s routing, so the same output bit for bit (GPU tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "VARIANTS", "compile_only", "run", "variant_for"]

ROUTED_IN_GEMM1 = (kernel.TINY_T, kernel.FEW_TOKENS, kernel.MEDIUM_T)
_CANDIDATE = {variant: dataclasses.replace(variant, routing_in_gemm1=True) for variant in ROUTED_IN_GEMM1}
VARIANTS = tuple(_CANDIDATE.values())


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant for `num_tokens`, routed inside GEMM1 up to MEDIUM_T_MAX_TOKENS."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return _CANDIDATE.get(chosen, chosen)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """This entry's configurations for `arch` without a GPU (LARGE_T is `kernel.py`'s)."""
    return (*(kernel.compiled_for(variant, arch) for variant in VARIANTS), kernel.compiled_for(kernel.LARGE_T, arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
