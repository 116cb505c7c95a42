"""MoE candidate v2.31 (NOTES.md, session 24): `kernel.py` with the three-CTA GEMM1's paired walk grouped in the H200's
measured dispatch order (7-8 tokens). A sizing experiment, not promotable as is: it hard-codes the order one GPU was
seen to dispatch a 396-CTA grid in (`tools/cta_placement.py`: CTAs 0-23 three each on 8 SMs, then c, c + 124, c + 248
per SM), where `kernel.py`'s groups {g, g + 132, g + 264} give the 8 front SMs the most items. Correct for any placement
(a bijection of the CTAs onto the walk's groups and slots); outputs bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["FRONT_SMS", "MoeShapeError", "compile_only", "run", "variant_for"]

FRONT_SMS = 8  # the SMs that took CTAs 0-23 on the H200 (results/checks/2026-12-01_cta_placement_session24.txt)
TINY_T_DISPATCH_ORDER = dataclasses.replace(kernel.TINY_T_THREE_CTAS, gemm1_front_sms=FRONT_SMS)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s choice, with the dispatch-order walk where it takes TINY_T_THREE_CTAS."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TINY_T_DISPATCH_ORDER if chosen is kernel.TINY_T_THREE_CTAS else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this entry's for `arch`, without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(TINY_T_DISPATCH_ORDER, arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
