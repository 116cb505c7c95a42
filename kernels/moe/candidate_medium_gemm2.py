"""MoE candidate v1.6 ("medium GEMM2 at two CTAs per SM"): `kernel.py` v1.5 with GEMM2 of its
MEDIUM_T variant (193-2048 tokens) in 16-token tiles with 3 stages (SMALL_T's GEMM2: 108 KB of shared
memory, two CTAs per SM) instead of 32-token tiles with 4 stages (192 KB, one CTA per SM).

Why (session 9, NOTES.md): with GEMM1 on WGMMA, T = 901 spends ~490 us in GEMM2, ~1 TB/s of W2. With
one CTA of four warps per SM, each scheduler has one warp, a dependent chain of e4m3 -> bf16
conversions and `mma.sync` (~400 instructions per warp and stage, ~0.14 instructions per cycle per
scheduler by our count). Two CTAs per SM give each scheduler a second warp to issue from. The cost:
the same conversions per item but twice the items (each expert's W2 is converted twice at ~28
tokens per expert), ~1.6x the instructions. (32-token tiles with 2 stages would keep the
instructions, but take 116 KB: still one CTA per SM.)

Prediction: GEMM2 at T = 901 ~490 -> ~390 us, T = 901 ~790 -> ~690 us (~1.15x); other T unchanged
(kernel.py's variants). Outputs bitwise kernel.py's: the per-warp K blocks, their promotion and the
fixed-order reduction do not depend on the token tile.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MEDIUM_T", "MoeShapeError", "compile_only", "run", "variant_for"]

MEDIUM_T = dataclasses.replace(kernel.MEDIUM_T, gemm2_block_tokens=16, gemm2_num_stages=3)


def variant_for(num_tokens: int) -> StreamingVariant | None:
    """`kernel.py`'s choice of variant, with this candidate's MEDIUM_T."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return MEDIUM_T if chosen == kernel.MEDIUM_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the candidate's MEDIUM_T and `kernel.py`'s configurations for `arch` without a GPU."""
    return (kernel.compiled_for(MEDIUM_T, arch), *kernel.compile_only(arch))


# `kernel.py`'s contract, with this candidate's MEDIUM_T.
run = kernel.make_run(variant_for)
