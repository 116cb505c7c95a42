"""MoE candidate v2.49 (NOTES.md): `kernel.py` with the expert outputs of its f16-C WGMMA GEMM2 (above FEW_TOKENS_MAX
tokens: MEDIUM_T and LARGE_T) stored as bf16 instead of fp32, the combine widening them before its weighted sum.

Why: those outputs are written by GEMM2 and read back by the combine, whose read sets the ~10 us after GEMM2 at 901
tokens (11-40 MB each way there, ~0.35-0.4 GB at 11948-14107). Outputs: not bit for bit `kernel.py`'s (each expert
output rounded to bf16 once more); within the track's acceptance and relative L2 <= 3.5e-3 (GPU tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["BF16_EXPERT_OUT", "MoeShapeError", "compile_only", "run", "variant_for"]

BF16_EXPERT_OUT = {
    variant: dataclasses.replace(variant, bf16_expert_out=True) for variant in (kernel.MEDIUM_T, kernel.LARGE_T)
}


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, GEMM2's outputs stored as bf16 above FEW_TOKENS_MAX."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return BF16_EXPERT_OUT.get(chosen, chosen)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this candidate's, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), *(kernel.compiled_for(v, arch) for v in BF16_EXPERT_OUT.values()))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
