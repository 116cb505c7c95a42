"""MoE candidate v2.19 (NOTES.md): `kernel.py` with TINY_T's two `mma.sync` GEMMs in warp pipelines: warp w copies
the weights, activations and scales of K block w of every stage itself (the block it already computes), so a stage
waits at a warp barrier instead of a CTA barrier and the four warps run their pipelines apart. From 33 tokens it is
`kernel.py`.

Why (NOTES.md, session 21): TINY_T's lone CTAs (a CTA with one item more than its SM sibling) run at ~0.8 us per
16-KB stage, held by their four warps' per-stage chain, which the CTA barrier of every stage ties together.
Outputs: the same data in the same shared-memory places and the same arithmetic: bit for bit `kernel.py`'s (GPU tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "TINY_T_WARP_PIPELINES", "compile_only", "run", "variant_for"]

TINY_T_WARP_PIPELINES = dataclasses.replace(kernel.TINY_T, warp_pipelines=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant for `num_tokens`, with warp pipelines below WGMMA_GEMM1_MIN_TOKENS."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TINY_T_WARP_PIPELINES if chosen is kernel.TINY_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """This entry's configurations (and the counters' zeroing) for `arch` without a GPU."""
    others = tuple(kernel.compiled_for(variant, arch) for variant in kernel.VARIANTS if variant is not kernel.TINY_T)
    return (kernel.compiled_for(TINY_T_WARP_PIPELINES, arch), *others, kernel.counters.compiled_zero(arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
