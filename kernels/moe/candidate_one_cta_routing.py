"""MoE candidate v1.2 ("one-CTA routing"): `kernel.py` with the counter zeroing and the routing in one
launch for T <= 32.

Why: the session-4 breakdown at T = 1 has the zeroing kernel (0.6 us) and then a 5.6 us host gap
before the routing kernel starts: the host is still launching it. The later launches cost the host
about as much, but they overlap the routing kernel (6.2 us) and the GEMMs, so only the gap after the
tiny first kernel is exposed. Here one CTA of 32 warps zeroes the counters in shared memory, routes
one token per warp and stores the counters (`routing.OneCtaRoutingKernel`): the call starts with the
routing, and the GEMM1 launch overlaps it.

Prediction: ~6 us off every call with T <= 32 (the first kernel and its gap): T = 1 from 60.5 to
~54.5 us, T = 7 from 116 to ~110 us, T = 14-32 2-4 %. Beyond 32 tokens the warps would route several
tokens each, one after the other, so larger T keeps `kernel.py`'s two launches.

Measured against v1.0 (2026-11-30, all 19 workloads): 1.09x at T = 1 (60.0 -> 55.0 us), 1.05x at
T = 7, 1.02-1.04x at T = 14-16, 1.01x at T = 32; as predicted. v1.1 ("deep stream", 1.15x) was
promoted in the same run, so this candidate now sits on v1.1's few-token variant (the routing and
the GEMMs are independent launches, but the composition is to be measured before it is promoted).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant
from .routing import ONE_CTA_WARPS

__all__ = ["MoeShapeError", "ONE_CTA_ROUTING_MAX_TOKENS", "compile_only", "run", "variant_for"]

ONE_CTA_ROUTING_MAX_TOKENS = ONE_CTA_WARPS  # one token per warp
FEW_TOKENS = dataclasses.replace(kernel.FEW_TOKENS, one_cta_routing=True)


def variant_for(num_tokens: int) -> StreamingVariant | None:
    """The candidate's streaming variant for `num_tokens` tokens (None: the grouped pipeline)."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return FEW_TOKENS if num_tokens <= ONE_CTA_ROUTING_MAX_TOKENS else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the candidate's variant and `kernel.py`'s others for `arch` without a GPU."""
    return kernel.compiled_for(FEW_TOKENS, arch), *kernel.compile_only(arch)


# `kernel.py`'s contract, with this candidate's variants.
run = kernel.make_run(variant_for)
