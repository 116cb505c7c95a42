"""MoE candidate v2.29 (NOTES.md, session 24): `kernel.py` with GEMM1 at three CTAs per SM in paired rounds at 7-8
tokens.

Why: with two CTAs per SM an SM holding an odd number of GEMM1 items runs its last one with one CTA alone, at about
three quarters of the rate two CTAs keep (session 21's stamps; v2.18). At 7 tokens most SMs hold 5 (5 experts) or 7
(7 experts) items; three CTAs per SM take them as (2, 2, 1) or (3, 3, 1) (`streaming_gemm.paired_round_walk`), so the
last rounds always have two CTAs (v2.28, the same CTAs in round robin: 4-5 % faster where its rounds were paired, 2-5 %
slower where they were not). Three CTAs fit in shared memory with 8-token row tiles and 3 stages (66.5 KB); up to 8
tokens no expert has more than 8 tokens, so an 8-token tile never reads an expert's weights twice. Below 7 tokens
`kernel.py`'s early-W2 variant stays (at 1 token a lone item per SM is the 1-expert case, where 2 stages in flight
lose: v2.28, 0.945). GEMM2, the routing and the combine stay `kernel.py`'s. Outputs: the same products and promotions
per token (a tile only regroups tokens, a walk only moves items between CTAs), bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MAX_TOKENS_THREE_CTAS", "TINY_T_THREE_CTAS", "MoeShapeError", "compile_only", "run", "variant_for"]

# Up to 8 tokens an expert has at most 8 tokens: one 8-token row tile each.
MAX_TOKENS_THREE_CTAS = 8
TINY_T_THREE_CTAS = dataclasses.replace(kernel.TINY_T, block_tokens=8, num_stages=3, gemm1_ctas_per_sm=3)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s choice, with GEMM1 at three CTAs per SM where `kernel.py` takes TINY_T up to 8 tokens."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TINY_T_THREE_CTAS if chosen is kernel.TINY_T and num_tokens <= MAX_TOKENS_THREE_CTAS else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this entry's for `arch`, without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(TINY_T_THREE_CTAS, arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
