"""MoE candidate v2.23 (NOTES.md): below WGMMA_GEMM1_MIN_TOKENS, `kernel.py`'s early-W2 variant with the row-tile
hand-over: GEMM1 counts each finished item in its row tile's counter, and GEMM2, which already reads its schedule
once the routed count is complete, waits for the GEMM1 row tile that holds an item's C rows instead of GEMM1's whole
grid. From 33 tokens it is `kernel.py`.

Why (NOTES.md): at 7 tokens' median trial (five experts) GEMM1's CTAs end over ~11 us, the last item of the busier CTA
of each SM running alone; the row tiles of the first experts are complete long before, and GEMM2's CTAs take the freed
SMs. Session 16's hand-over in these GEMMs (v2.9, v2.10) measured 1.04x and 1.07x at 7 tokens.
Outputs: the same arithmetic on the same data: bit for bit `kernel.py`'s (GPU tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "TINY_T_HANDOFF", "compile_only", "run", "variant_for"]

TINY_T_HANDOFF = dataclasses.replace(kernel.TINY_T_EARLY_W2, row_tile_handoff=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant for `num_tokens`, with the hand-over below WGMMA_GEMM1_MIN_TOKENS."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TINY_T_HANDOFF if num_tokens < kernel.WGMMA_GEMM1_MIN_TOKENS else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """This entry's configurations (and the counters' zeroing) for `arch` without a GPU."""
    others = tuple(kernel.compiled_for(variant, arch) for variant in kernel.VARIANTS[2:])
    return (kernel.compiled_for(TINY_T_HANDOFF, arch), *others, kernel.counters.compiled_zero(arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
