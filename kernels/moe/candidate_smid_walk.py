"""MoE candidate v2.32 (NOTES.md, session 24; written then, not yet run on a GPU): `kernel.py` with the three-CTA
GEMM1's paired walk grouped by SM id at 7-8 tokens.

Why: on the H200 the CTAs of `kernel.py`'s walk groups {g, g + 132, g + 264} do not share SMs (`tools/cta_placement.py`),
and the 8 SMs that take CTAs 0-23 get the most items; a walk grouped in the measured dispatch order was 1.016x at 7
tokens (v2.31) but hard-coded that order. Here each CTA reads its SM id and draws its slot on that SM from a kept
per-SM counter (`streaming_gemm.take_walk_slot`, `counters.kept_walk_slots`), which makes the groups the real SMs on
any GPU whose SM ids are dense, and falls back to `kernel.py`'s groups elsewhere. Outputs: bit for bit `kernel.py`'s
(which CTA computes an item changes nothing in it; a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import counters, kernel
from .kernel import MoeShapeError, StreamingVariant
from .streaming_gemm import WALK_SLOT_WORDS

__all__ = ["MoeShapeError", "TINY_T_SMID_WALK", "compile_only", "run", "variant_for"]

TINY_T_SMID_WALK = dataclasses.replace(kernel.TINY_T_THREE_CTAS, gemm1_smid_walk=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s choice, with the walk by SM id where it takes TINY_T_THREE_CTAS."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TINY_T_SMID_WALK if chosen is kernel.TINY_T_THREE_CTAS else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations, this entry's and the zeroing of a new slot buffer for `arch`, without a GPU."""
    return (
        *kernel.compile_only(arch),
        kernel.compiled_for(TINY_T_SMID_WALK, arch),
        counters.compiled_zero(arch, WALK_SLOT_WORDS),
    )


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
