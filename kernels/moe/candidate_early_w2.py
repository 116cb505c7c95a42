"""MoE candidate v2.20 (NOTES.md): `kernel.py` with TINY_T's GEMM2 issuing its first stages' weights before its
programmatic wait: once the kept count of routed tokens is complete (GEMM1's grid meets on it long before GEMM1 ends)
a GEMM2 CTA builds its schedule and starts its W2 copies; only the activations (GEMM1's output C) wait for GEMM1 to
complete. From 33 tokens it is `kernel.py`.

Why (NOTES.md, session 21's CTA stamps): GEMM2's CTAs become resident as GEMM1's retire (at 7 tokens' median trial
over 11 us), then wait, build the schedule (~0.85 us) and wait again ~2 us for their first stage.
Outputs: the same copies into the same places and the same arithmetic: bit for bit `kernel.py`'s (GPU tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "TINY_T_EARLY_W2", "compile_only", "run", "variant_for"]

TINY_T_EARLY_W2 = dataclasses.replace(kernel.TINY_T, gemm2_weights_before_wait=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant for `num_tokens`, GEMM2's weights before its wait below WGMMA_GEMM1_MIN_TOKENS."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TINY_T_EARLY_W2 if chosen is kernel.TINY_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """This entry's configurations (and the counters' zeroing) for `arch` without a GPU."""
    others = tuple(kernel.compiled_for(variant, arch) for variant in kernel.VARIANTS if variant is not kernel.TINY_T)
    return (kernel.compiled_for(TINY_T_EARLY_W2, arch), *others, kernel.counters.compiled_zero(arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
