"""MoE candidate v2.5 (`cand_w2_prefetch_early`, `cand_w2_prefetch_late`, `cand_w2_prefetch_loads_first`):
`kernel.py` whose `mma.sync` GEMM1
(TINY_T, below 33 tokens) asks L2 for the first 32 MB of the active experts' W2 while it streams W13, so that
GEMM2 starts on weights already in L2 (`streaming_gemm.W2Prefetch`; contract in NOTES.md).

Why: below 33 tokens the weight bandwidth is short of 3.0 TB/s (1.9-2.9 in session 11) and both GEMMs stream
at ~2.4 TB/s on `mma.sync`, so DRAM has room for a second stream during GEMM1. At 1-2 active experts their W2
(15-29 MB) fits in L2 whole. `early` prefetches from each CTA's start, `late` from the start of its last item
(less of GEMM1's own stream passes through L2 after the prefetch). `loads_first` adds `early` to the routing
that issues a token's loads before its sigmoids (candidate v1.7, session 9: 1-3 % of the span at 1-16 tokens,
too little alone). Above 32 tokens every entry is `kernel.py`. Outputs: the same arithmetic, bit for bit (a
prefetch changes no data, and the routing computes the same values; a GPU test checks).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant
from .streaming_gemm import W2Prefetch

__all__ = ["MoeShapeError", "VARIANTS", "compile_only", "run", "run_late", "run_loads_first", "variant_for"]

W2_PREFETCH_BUDGET_BYTES = 32 * 1024 * 1024  # about half of the H200's 60 MB L2

EARLY = dataclasses.replace(kernel.TINY_T, w2_prefetch=W2Prefetch(W2_PREFETCH_BUDGET_BYTES, early=True))
LATE = dataclasses.replace(kernel.TINY_T, w2_prefetch=W2Prefetch(W2_PREFETCH_BUDGET_BYTES, early=False))
LOADS_FIRST = dataclasses.replace(EARLY, routing_loads_first=True)
VARIANTS = (EARLY, LATE, LOADS_FIRST)


def variant_for(num_tokens: int, tiny: StreamingVariant = EARLY) -> StreamingVariant:
    """`kernel.py`'s choice of variant with `tiny` (one of VARIANTS) in place of TINY_T."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return tiny if chosen is kernel.TINY_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this entry's two for `arch` without a GPU."""
    return (*kernel.compile_only(arch), *(kernel.compiled_for(variant, arch) for variant in VARIANTS))


# `kernel.py`'s contract, with these dispatches.
run = kernel.make_run(variant_for)
run_late = kernel.make_run(lambda num_tokens: variant_for(num_tokens, LATE))
run_loads_first = kernel.make_run(lambda num_tokens: variant_for(num_tokens, LOADS_FIRST))
