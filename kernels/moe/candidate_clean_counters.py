"""MoE candidate v1.5 ("clean counters"): `kernel.py` v1.4 with the per-expert counters kept at zero
between calls (`counters.py`), so that no call starts with the zeroing launch, and the parallel
routing grid at every T (v1.4 routes up to 32 tokens in one CTA to fold the zeroing in).

Why (session 8, `kernel.py` v1.4): above 32 tokens the call starts with a 0.6-us zeroing kernel and
the host is still issuing the routing launch when it ends, so 5.3-8.6 us of its span at 52-62 tokens
has no kernel running (223.4 us span, 215.9 us busy at 52 tokens). Up to 32 tokens the one-CTA
routing removed that gap but costs GPU time: at T = 32 v1.4 is busy 200.8 us against v1.1's
194.8 us with the parallel routing grid. Here the routing grid is the first launch at every T, the
five launches are chained, and a last one-CTA kernel copies the counters out for inspection and
zeroes them for the next call on the stream (`routing.ReleaseCountsKernel`).

Prediction: spans = busy time at every streaming T: 52-80 tokens ~2-3.5 % faster (e.g. 52: 223 ->
~217 us; most of the 52-62-token workloads over 3.0 TB/s), T = 32 ~201 -> ~196 us, T = 1-16 within
~1 us of v1.4 (the parallel routing takes ~6 us at T = 1 against one CTA's, plus the extra ~1 us
launch at the end), T = 901 ~1 % faster. Outputs bitwise v1.4's (same GEMMs and combine, and the
routing lists hold the same tokens in an order that only permutes packed rows... see NOTES.md).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import counters, kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "VARIANTS", "compile_only", "run", "variant_for"]

VARIANTS = tuple(
    dataclasses.replace(variant, self_cleaning=True) for variant in (kernel.FEW_TOKENS, kernel.SMALL_T, kernel.MEDIUM_T)
)


def variant_for(num_tokens: int) -> StreamingVariant | None:
    """`kernel.py`'s streaming variant for `num_tokens` with the parallel routing and kept counters
    (None: the grouped pipeline, unchanged)."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    if chosen is None:
        return None
    return dataclasses.replace(chosen, one_cta_routing=False, self_cleaning=True)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the candidate's variants, the zeroing of a new counter buffer and `kernel.py`'s others
    for `arch` without a GPU."""
    return (
        *(kernel.compiled_for(variant, arch) for variant in VARIANTS),
        counters.compiled_zero(arch),
        *kernel.compile_only(arch),
    )


# `kernel.py`'s contract, with this candidate's variants.
run = kernel.make_run(variant_for)
