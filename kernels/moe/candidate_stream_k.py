"""MoE candidate v2.17 (NOTES.md): `kernel.py` with TINY_T's two `mma.sync` GEMMs walking stream-K ranges: each
persistent CTA streams a contiguous range of U / grid flat (item, K stage) steps instead of whole items round robin,
and an item cut by a range end is finished by its last piece (`streaming_gemm.StreamingGemm.finish_piece`). From 33
tokens it is `kernel.py`.

Why (NOTES.md, v2.17's contract): at 7 tokens the bar's median trial activates 5 local experts, whose 640 GEMM1
items (1120 GEMM2 items) take 3 (5) rounds of 264 CTAs where 2.42 (4.24) would do; at 1 token one trial activates
one expert, for which half of GEMM1's CTAs are idle.
Outputs: the same products and block promotions; a cut item sums its pieces in CTA order, so outputs equal
`kernel.py`'s up to fp32 rounding, deterministically (GPU tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import counters, kernel
from .kernel import MoeShapeError, StreamingVariant
from .streaming_gemm import MAX_SPLIT_CTAS

__all__ = ["MoeShapeError", "TINY_T_STREAM_K", "compile_only", "run", "variant_for"]

TINY_T_STREAM_K = dataclasses.replace(kernel.TINY_T, stream_k=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant for `num_tokens`, with stream-K walks below WGMMA_GEMM1_MIN_TOKENS."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TINY_T_STREAM_K if chosen is kernel.TINY_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """This entry's configurations and zeroing launches for `arch` without a GPU."""
    others = tuple(kernel.compiled_for(variant, arch) for variant in kernel.VARIANTS if variant is not kernel.TINY_T)
    return (
        kernel.compiled_for(TINY_T_STREAM_K, arch),
        *others,
        counters.compiled_zero(arch),
        counters.compiled_zero(arch, MAX_SPLIT_CTAS),
    )


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
