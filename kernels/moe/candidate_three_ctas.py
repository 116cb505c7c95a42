"""MoE candidate v2.28 (NOTES.md, session 24): `kernel.py` with GEMM1 at three CTAs per SM up to 8 tokens.

Why: with two CTAs per SM an SM holding an odd number of GEMM1 items runs its last one with one CTA alone, at about
three quarters of the rate two CTAs keep (session 21's stamps; v2.18: a lone CTA is held by its warps' per-stage
chain). At 7 tokens' median trial (5 experts) most SMs hold 5 items; three CTAs per SM run them in rounds of 3 and 2.
Three CTAs fit in shared memory with 8-token row tiles and 3 stages (66.5 KB); up to 8 tokens no expert has more than
8 tokens, so an 8-token tile never reads an expert's weights twice. GEMM2, the routing and the combine stay
`kernel.py`'s. Outputs: the same products and promotions per token (a tile only regroups tokens), bit for bit
`kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MAX_TOKENS_THREE_CTAS", "MoeShapeError", "compile_only", "run", "variant_for"]

# Up to 8 tokens an expert has at most 8 tokens: one 8-token row tile each.
MAX_TOKENS_THREE_CTAS = 8
_THREE_CTAS = {"block_tokens": 8, "num_stages": 3, "gemm1_ctas_per_sm": 3}
TINY_T_EARLY_W2 = dataclasses.replace(kernel.TINY_T_EARLY_W2, **_THREE_CTAS)
TINY_T = dataclasses.replace(kernel.TINY_T, **_THREE_CTAS)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s choice, with GEMM1 at three CTAs per SM up to MAX_TOKENS_THREE_CTAS tokens."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    if num_tokens > MAX_TOKENS_THREE_CTAS:
        return chosen
    return TINY_T_EARLY_W2 if chosen is kernel.TINY_T_EARLY_W2 else TINY_T


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this entry's two for `arch`, without a GPU."""
    return (*kernel.compile_only(arch), *(kernel.compiled_for(v, arch) for v in (TINY_T_EARLY_W2, TINY_T)))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
