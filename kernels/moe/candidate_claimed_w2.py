"""MoE candidate v2.34 (NOTES.md, session 25): `kernel.py` with the `mma.sync` GEMM2 of 7-32 tokens claiming its items
after the first from a kept counter instead of walking a fixed round robin.

Why: GEMM2 is not cooperative; its CTAs become resident as GEMM1's retire, so which of them share an SM is not known,
and the fixed walk gives 64 of its 264 CTAs one item more at 5 experts: SMs end over several microseconds (session 21's
stamps: median 72.6 us, last 77.3 us at 7 tokens). With claims, the CTAs that finish first take the tail, whatever the
placement (`streaming_gemm.claim_item`). Outputs: bit for bit `kernel.py`'s (which CTA computes an item changes nothing
in it; a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "TINY_T_CLAIMED_W2", "TINY_T_THREE_CTAS_CLAIMED_W2", "compile_only", "run", "variant_for"]

TINY_T_THREE_CTAS_CLAIMED_W2 = dataclasses.replace(kernel.TINY_T_THREE_CTAS, gemm2_dynamic_items=True)
TINY_T_CLAIMED_W2 = dataclasses.replace(kernel.TINY_T, gemm2_dynamic_items=True)
_REPLACED = {kernel.TINY_T_THREE_CTAS: TINY_T_THREE_CTAS_CLAIMED_W2, kernel.TINY_T: TINY_T_CLAIMED_W2}


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s choice, with claimed GEMM2 items wherever it takes one of its two variants of 7-32 tokens."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return _REPLACED.get(chosen, chosen)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this entry's two for `arch`, without a GPU."""
    return (*kernel.compile_only(arch), *(kernel.compiled_for(variant, arch) for variant in _REPLACED.values()))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
