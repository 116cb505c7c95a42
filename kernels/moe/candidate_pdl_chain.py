"""MoE candidate v1.4 ("PDL chain"): v1.2 (`candidate_one_cta_routing.py`: zeroing and routing in
one launch up to 32 tokens) with every launch of the streaming path after the first a programmatic
dependent of the one before (`chain.py`).

Why: the runner's `busy_ms` (session 7) shows every call of the streaming path with 8.5-11 us in
its span when no kernel of it runs, at every T from 1 to 901. v1.2 takes ~5 us of that away at
T <= 32 (the host gap after the tiny zeroing kernel); the ~3.5 us it leaves (3.2-3.8 us in v1.2's
rows) sit at the three kernel boundaries routing -> GEMM1 -> GEMM2 -> combine, each a drain, a
launch and a ramp. DSA v1.2 removed exactly such a boundary with PDL: its span became its busy
time (2.4 us at T = 1). Above 32 tokens the zeroing kernel stays a separate first launch, so the
chain has four boundaries there; the host gap after the zeroing kernel is host time and stays.

Prediction: ~3-4 us off every call on the streaming path: T = 1 from v1.1's 55.2 us to ~47 us with
v1.2 (~1.17x over v1.1; ~1.08x over v1.2), 1-3 % at 52-80 tokens, nothing measurable at 901. The
grouped path (T > 2048) is `kernel.py`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import candidate_one_cta_routing, kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "compile_only", "run", "variant_for"]


def variant_for(num_tokens: int) -> StreamingVariant | None:
    """v1.2's streaming variant for `num_tokens` tokens, chained (None: the grouped pipeline)."""
    chosen = candidate_one_cta_routing.variant_for(num_tokens)
    return None if chosen is None else dataclasses.replace(chosen, chained=True)


VARIANTS = tuple(dataclasses.replace(v, chained=True) for v in (candidate_one_cta_routing.FEW_TOKENS, *kernel.VARIANTS))


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the candidate's chained variants and `kernel.py`'s others for `arch` without a GPU."""
    return (*(kernel.compiled_for(variant, arch) for variant in VARIANTS), *kernel.compile_only(arch))


# `kernel.py`'s contract, with this candidate's variants.
run = kernel.make_run(variant_for)
