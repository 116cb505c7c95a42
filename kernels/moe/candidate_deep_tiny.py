"""MoE candidate v2.18 (NOTES.md): `kernel.py` with TINY_T's two `mma.sync` GEMMs at one CTA per SM with 8 pipeline
stages (7 of 16 KB of weights in flight) instead of two CTAs per SM with 4. From 33 tokens it is `kernel.py`.

Why (NOTES.md, session 21's CTA stamps): at 7 tokens' median trial (5 experts) GEMM1's CTAs end over 11 us and GEMM2's
over 5 us, the CTAs with one item more than their SM sibling running it alone at two thirds of the SM's rate (their
ring holds half of what the SM can); one CTA per SM keeps the whole depth behind whatever item the SM has left.
Outputs: the same items, products and promotions, bit for bit `kernel.py`'s (GPU tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "TINY_T_DEEP", "compile_only", "run", "variant_for"]

TINY_T_DEEP = dataclasses.replace(kernel.TINY_T, num_stages=8, gemm2_num_stages=8)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant for `num_tokens`, with one deep CTA per SM below WGMMA_GEMM1_MIN_TOKENS."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TINY_T_DEEP if chosen is kernel.TINY_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """This entry's configurations (and the counters' zeroing) for `arch` without a GPU."""
    others = tuple(kernel.compiled_for(variant, arch) for variant in kernel.VARIANTS if variant is not kernel.TINY_T)
    return (kernel.compiled_for(TINY_T_DEEP, arch), *others, kernel.counters.compiled_zero(arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
