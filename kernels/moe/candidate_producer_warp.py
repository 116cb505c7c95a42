"""MoE candidate v2.52 (NOTES.md): `kernel.py` with MEDIUM_T's GEMM1 (193 to MEDIUM_T_MAX_TOKENS tokens) fed by a
producer warp: a fifth warp issues every K stage (the weights by TMA, the token rows by coalesced `cp.async`, two rows
per copy) on the slot's full mbarrier, and the MMA warpgroup waits on that alone and releases the slot on its empty
mbarrier, so that no CTA-wide barrier ends a K stage.

Why: session 29's candidates v2.45, v2.47, v2.48 and v2.50 changed what a K stage carries or how it is fetched and
measured 0.956-1.001x at 901 tokens; what they kept is the CTA-wide rendezvous at the end of every stage. v2.51 (one
token row per producer lane) measured 0.849x at 901; v2.52 coalesces those copies. Outputs: the same bytes in the same
layout, the same MMAs and promotions, so bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["PRODUCER_WARP", "MoeShapeError", "compile_only", "run", "variant_for"]

PRODUCER_WARP = dataclasses.replace(kernel.MEDIUM_T, gemm1_producer_warp=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, MEDIUM_T's GEMM1 fed by a producer warp."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return PRODUCER_WARP if chosen is kernel.MEDIUM_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this candidate's, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(PRODUCER_WARP, arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
