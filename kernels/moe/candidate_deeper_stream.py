"""MoE candidate v1.3 ("deeper stream"): v1.1 (`candidate_deep_stream.py`) with GEMM1 also on 8-token
tiles for T <= 64, with 5 stages.

Why: v1.1 gives GEMM2 two CTAs per SM (8 weight stages in flight per SM instead of 4), because with
few tokens per expert a weight stream is bound by bytes in flight over latency. GEMM1 keeps 16-token
tiles with 4 stages (105.5 KB: two CTAs, 8 stages in flight). With 8-token tiles its activation
stages shrink, so 5 stages fit in 105.2 KB and two CTAs still fit: 10 weight stages in flight per
SM, 1.25x. GEMM1 carries two thirds of the weight bytes at T <= 192.

Cost: an expert with 9-16 tokens streams its GEMM1 weights twice (as v1.1 does for GEMM2). At
T <= 64 an active local expert gets ~1-4 tokens under the contest's routing.

Prediction: GEMM1 at T = 1 from 22.2 us to ~18 us (session-4 breakdown), so the call ~4 us faster
than v1.1 (~46 us against ~50 predicted for v1.1 and 60.5 measured for kernel.py); at T = 7-64,
where GEMM1 is about half the call, 5-10 % over v1.1.
"""

from __future__ import annotations

from typing import Callable

from . import candidate_deep_stream, kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "compile_only", "run", "variant_for"]

FEW_TOKENS = StreamingVariant(block_tokens=8, num_stages=5, gemm2_block_tokens=8, gemm2_num_stages=4)
VARIANTS = (FEW_TOKENS, candidate_deep_stream.SMALL_T)

variant_for = candidate_deep_stream.choose_with(FEW_TOKENS)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the candidate's two variants and `kernel.py`'s others for `arch` without a GPU."""
    return (*(kernel.compiled_for(variant, arch) for variant in VARIANTS), *kernel.compile_only(arch))


# `kernel.py`'s contract, with this candidate's variants.
run = kernel.make_run(variant_for)
