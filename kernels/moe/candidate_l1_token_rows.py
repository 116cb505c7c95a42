"""MoE candidate v2.53 (NOTES.md): `kernel.py` v2.16 with MEDIUM_T's GEMM1 (193 to MEDIUM_T_MAX_TOKENS tokens) taking,
in every full round of its walk, three consecutive items on an SM's three CTAs (mostly one row tile's, so the same
token rows at the same K stages), its producer warp copying the token rows through L1 (`cp.async.ca`) where the SM's
other CTAs may find them.

Why: v2.16's GEMM1 at 901 tokens runs the L2 at 87.8 % of its throughput, and up to a third of the bytes its SMs read
from L2 are token rows that each of a row tile's 64 items reads again. Outputs: the same items with the same bytes,
MMAs and epilogue, only computed by other CTAs: bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["L1_TOKEN_ROWS", "MoeShapeError", "compile_only", "run", "variant_for"]

L1_TOKEN_ROWS = dataclasses.replace(kernel.MEDIUM_T, gemm1_token_rows_in_l1=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, MEDIUM_T's GEMM1 with its token rows through L1."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return L1_TOKEN_ROWS if chosen is kernel.MEDIUM_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this candidate's, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(L1_TOKEN_ROWS, arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
