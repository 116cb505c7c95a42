"""MoE threshold candidate v2.8 (NOTES.md): `kernel.py` with its FEW_TOKENS variant (both GEMMs on warpgroup
MMA, 16-token row tiles, 8-token GEMM2 tiles) from 14 tokens instead of from WGMMA_GEMM1_MIN_TOKENS (33).

Why: v2.4 (session 11) measured this dispatch at 14-32 tokens with trials on both sides of 1 (0.88-1.04),
when both variants still located their items per K stage. Locating once (v2.4 of `kernel.py`, session 15)
gained 1.10-1.13x on the WGMMA variant's rows (52-80 tokens) and 1.04-1.07x on the `mma.sync` one's (14-32),
so the crossing may have moved below 33; 1 and 7 tokens (one to a few experts, where the 64-row WGMMA items
halve the streaming CTAs: 0.85x / 0.89x then) stay on `kernel.py`'s variant. Session 15 measured it at
1.000-1.109 per trial at 14-32 tokens with one trial at 0.973 (15 tokens) and dropped it by its bar; session 16
runs it once more under the same bar (NOTES.md, "v2.8 again").
"""

from __future__ import annotations

from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MIN_TOKENS", "MoeShapeError", "compile_only", "run", "variant_for"]

MIN_TOKENS = 14


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s choice of variant with FEW_TOKENS from MIN_TOKENS tokens."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return kernel.FEW_TOKENS if chosen is kernel.TINY_T and num_tokens >= MIN_TOKENS else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations for `arch` without a GPU: this entry adds none."""
    return kernel.compile_only(arch)


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
