"""MoE candidate v2.27 (NOTES.md): `kernel.py` with the combine inside GEMM2 below 33 tokens (two launches a call).

Below 33 tokens (the `mma.sync` GEMM2 of TINY_T_EARLY_W2 and TINY_T) each GEMM2 item, once its O tile is stored, counts
its arrival at its 32-column block of the output; the arrival that completes a block sums that block for every token
in the combine kernel's order and writes the bf16 output, and the last GEMM2 CTA to exit zeroes the kept counters
(`combine.combine_block_if_last`, `combine.release_if_last_exit`). The combine kernel's ~2 us after GEMM2's last item
becomes the last block's sum. Outputs: the same FMAs in the same order: bit for bit `kernel.py`'s (GPU tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["IN_GEMM2", "MoeShapeError", "compile_only", "run", "variant_for"]

# `kernel.py`'s variants with the `mma.sync` GEMM2, combining in it.
IN_GEMM2 = {
    variant: dataclasses.replace(variant, combine_in_gemm2=True) for variant in (kernel.TINY_T_EARLY_W2, kernel.TINY_T)
}


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant for `num_tokens`, combining in GEMM2 below WGMMA_GEMM1_MIN_TOKENS."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return IN_GEMM2.get(chosen, chosen)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """This entry's configurations (and the zeroing of its kept buffers) for `arch` without a GPU."""
    variants = (*IN_GEMM2.values(), *kernel.VARIANTS[2:])
    counters = kernel.counters
    return (
        *(kernel.compiled_for(variant, arch) for variant in variants),
        counters.compiled_zero(arch),
        counters.compiled_zero(arch, counters.COMBINE_WORDS),
    )


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
