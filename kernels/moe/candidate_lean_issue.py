"""MoE candidate v2.13 (NOTES.md): `kernel.py` with the `mma.sync` GEMMs of TINY_T (below WGMMA_GEMM1_MIN_TOKENS)
issuing each K stage with fewer instructions (`StreamingGemmConfig.lean_issue`).

Why: TINY_T's GEMMs are bound by each warp's per-stage instruction chain (ncu, sessions 9 and 16: two warps per
scheduler, "wait" and "selected" the top stalls, GEMM1 at one token ~450 instructions per warp and K stage). Their
SASS (ptxas 12.8) shows ~120 of those issued every stage for what changes only per item: every copy's global
address rebuilt in 64-bit arithmetic from (expert, row, K), and the computed item's location, a binary search over
shared memory that the compiler predicates instead of branching around, so it issues at every stage. Here each
item's per-thread offsets are computed once when its first stage is loaded, a copy adds only its stage's K offset
and a constant, the computed item takes its valid rows from the load side, and its packed row is located once, in
its epilogue's branch. GEMM1's common stage: ~458 -> ~338 instructions per warp, GEMM2's ~635 -> ~522.

Same copies, same arithmetic: the output is `kernel.py`'s bit for bit (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "compile_only", "run", "variant_for"]

TINY_T_LEAN_ISSUE = dataclasses.replace(kernel.TINY_T, lean_issue=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, with the lean stage issue where that is TINY_T."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TINY_T_LEAN_ISSUE if chosen is kernel.TINY_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and TINY_T with the lean stage issue, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(TINY_T_LEAN_ISSUE, arch))


run = kernel.make_run(variant_for)
