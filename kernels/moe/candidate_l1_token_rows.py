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

__all__ = [
    "GROUPED_ONLY",
    "L1_ONLY",
    "L1_TOKEN_ROWS",
    "MoeShapeError",
    "compile_only",
    "run",
    "run_grouped_only",
    "run_l1_only",
    "variant_for",
]

L1_TOKEN_ROWS = dataclasses.replace(kernel.MEDIUM_T, gemm1_sm_grouped_items=True, gemm1_token_rows_through_l1=True)
# Its two halves, one at a time (session 30's diagnostic of v2.53's loss).
GROUPED_ONLY = dataclasses.replace(kernel.MEDIUM_T, gemm1_sm_grouped_items=True)
L1_ONLY = dataclasses.replace(kernel.MEDIUM_T, gemm1_token_rows_through_l1=True)


def medium_t_as(replacement: StreamingVariant) -> Callable[[int], StreamingVariant]:
    """`kernel.py`'s dispatch with `replacement` for MEDIUM_T."""

    def choose(num_tokens: int) -> StreamingVariant:
        chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
        return replacement if chosen is kernel.MEDIUM_T else chosen

    return choose


variant_for = medium_t_as(L1_TOKEN_ROWS)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this candidate's three, for `arch` without a GPU."""
    mine = (L1_TOKEN_ROWS, GROUPED_ONLY, L1_ONLY)
    return (*kernel.compile_only(arch), *(kernel.compiled_for(variant, arch) for variant in mine))


# `kernel.py`'s contract, with these dispatches.
run = kernel.make_run(variant_for)
run_grouped_only = kernel.make_run(medium_t_as(GROUPED_ONLY))
run_l1_only = kernel.make_run(medium_t_as(L1_ONLY))
