"""MoE candidate v2.35 (NOTES.md, session 25; written then, not yet run on a GPU): `kernel.py` with the `mma.sync` GEMM1
of 7-32 tokens prefetching GEMM2's first items into L2.

Why: between GEMM1's last stages and GEMM2's first landed stage DRAM idles for ~3 us (session 21's stamps: the grid's
end, GEMM2's wait and schedule, then its first requests' round trip), and GEMM2's items are known once GEMM1 has routed.
GEMM1's CTA c issues one bulk L2 prefetch of GEMM2's item c (64 KB of W2; GEMM2's CTA c takes item c first, and the
claims of v2.34 go on in item order) right after it has issued its own last loads (`streaming_gemm.gemm2_item_weights`),
so GEMM2's first stages come from L2. Outputs: bit for bit `kernel.py`'s (a prefetch changes no value; a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "TINY_T_W2_PREFETCH", "TINY_T_THREE_CTAS_W2_PREFETCH", "compile_only", "run", "variant_for"]

TINY_T_THREE_CTAS_W2_PREFETCH = dataclasses.replace(kernel.TINY_T_THREE_CTAS, gemm1_prefetches_w2=True)
TINY_T_W2_PREFETCH = dataclasses.replace(kernel.TINY_T, gemm1_prefetches_w2=True)
_REPLACED = {kernel.TINY_T_THREE_CTAS: TINY_T_THREE_CTAS_W2_PREFETCH, kernel.TINY_T: TINY_T_W2_PREFETCH}


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s choice, with GEMM2's first items prefetched wherever it takes one of its two variants of 7-32
    tokens."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return _REPLACED.get(chosen, chosen)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this entry's two for `arch`, without a GPU."""
    return (*kernel.compile_only(arch), *(kernel.compiled_for(variant, arch) for variant in _REPLACED.values()))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
