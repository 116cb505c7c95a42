"""MoE candidate v2.21 (NOTES.md): v2.20's early W2 (`kernel.TINY_T` with `gemm2_weights_before_wait`) only up to
EARLY_W2_MAX_TOKENS tokens. TINY_T's GEMM2 there reads its schedule once the kept count of routed tokens is complete
(GEMM1's grid meets on it long before GEMM1 ends) and issues its first stages' weights before its programmatic wait;
only the activations (GEMM1's output C) wait for GEMM1 to complete. Above it, `kernel.py`.

Why the threshold (NOTES.md, v2.20's run): 1 token gained 1.039x (5 of 5 trials) where GEMM1's CTAs retire within
~1.5 us; at 7-32 tokens, where they retire over ~11 us, the early copies compete with GEMM1's last CTAs for DRAM and
gained nothing (32 tokens 0.983x). The threshold is the largest token count below the next official row (7) whose
off-list sweep did not lose (`tools/time_axes.py`).
Outputs: the same copies into the same places and the same arithmetic: bit for bit `kernel.py`'s (GPU tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["EARLY_W2_MAX_TOKENS", "MoeShapeError", "TINY_T_EARLY_W2", "compile_only", "run", "variant_for"]

TINY_T_EARLY_W2 = dataclasses.replace(kernel.TINY_T, gemm2_weights_before_wait=True)
EARLY_W2_MAX_TOKENS = 6
assert EARLY_W2_MAX_TOKENS < kernel.WGMMA_GEMM1_MIN_TOKENS  # the early variant is TINY_T with one switch


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant for `num_tokens`, with GEMM2's weights before its wait up to EARLY_W2_MAX_TOKENS."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TINY_T_EARLY_W2 if num_tokens <= EARLY_W2_MAX_TOKENS else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """This entry's configurations (and the counters' zeroing) for `arch` without a GPU."""
    variants = (TINY_T_EARLY_W2, *kernel.VARIANTS)
    return (*(kernel.compiled_for(variant, arch) for variant in variants), kernel.counters.compiled_zero(arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
