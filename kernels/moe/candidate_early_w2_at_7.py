"""MoE candidate v2.30 (NOTES.md, session 24): `kernel.py` with GEMM2's first weights issued before its programmatic
wait at 7-8 tokens too (v2.21's flag, until now up to EARLY_W2_MAX_TOKENS only), beside GEMM1's three CTAs per SM.

Why: at 7 tokens ~4 us pass between GEMM1's last stage and GEMM2's first landed stage with DRAM mostly idle (session
21's stamps). v2.20 found early weights no faster at 7-16 tokens while GEMM1's CTAs retired over ~11 us; v2.29's paired
rounds end the busiest SMs' GEMM1 CTAs together. Two sides: `run` keeps GEMM2's 4 stages (101 KB, resident on a busy SM
only once two GEMM1 CTAs have left it); `run_shallow` gives it 3 (78.7 KB: one fits beside two GEMM1 CTAs, so it
prefetches during GEMM1's last round, then streams with 2 stages in flight). Outputs: the same copies into the same
places, bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "compile_only", "run", "run_shallow", "variant_for", "variant_for_shallow"]

EARLY_W2_THREE_CTAS = dataclasses.replace(kernel.TINY_T_THREE_CTAS, gemm2_weights_before_wait=True)
EARLY_W2_THREE_CTAS_SHALLOW = dataclasses.replace(EARLY_W2_THREE_CTAS, gemm2_num_stages=3)


def _with(replacement: StreamingVariant) -> Callable[[int], StreamingVariant]:
    def choose(num_tokens: int) -> StreamingVariant:
        chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
        return replacement if chosen is kernel.TINY_T_THREE_CTAS else chosen

    return choose


variant_for = _with(EARLY_W2_THREE_CTAS)
variant_for_shallow = _with(EARLY_W2_THREE_CTAS_SHALLOW)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this entry's two for `arch`, without a GPU."""
    return (
        *kernel.compile_only(arch),
        *(kernel.compiled_for(v, arch) for v in (EARLY_W2_THREE_CTAS, EARLY_W2_THREE_CTAS_SHALLOW)),
    )


# `kernel.py`'s contract, with these dispatches.
run = kernel.make_run(variant_for)
run_shallow = kernel.make_run(variant_for_shallow)
