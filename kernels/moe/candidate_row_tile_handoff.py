"""MoE candidate v2.10 (NOTES.md): `kernel.py` with GEMM2 taking each row tile as soon as GEMM1 has finished it,
in the `mma.sync` variant (TINY_T, below WGMMA_GEMM1_MIN_TOKENS) only. Candidate v2.9 had the hand-over in every
variant: 18 of 18 paired trials faster at 1-32 tokens, 0.95-0.97x at 52-80 (session 16), so it was dropped there.

Why: GEMM2 waits for GEMM1's whole grid (`griddepcontrol.wait`), so the SMs that finish their GEMM1 items
early idle through GEMM1's last, partial wave of items: at 14 tokens (~900 GEMM1 items on 264 CTAs) 60 % of
the CTAs have no fourth item, at 901 tokens GEMM2's first CTAs start ~30 us before GEMM1 ends (session 15's
breakdown) and wait. GEMM1 walks its items in row-tile order, so most row tiles are complete well before
its end.

Here (`StreamingVariant.row_tile_handoff`): the routing zeroes per-call row-tile counters; GEMM1 counts each
finished item in its row tile's counter (release at GPU scope) and lets GEMM2 launch only after its own
wait for the routing; GEMM2 does not wait for GEMM1's grid but, before loading an item's C rows, polls the
counter of the GEMM1 row tile that holds them (acquire at GPU scope). The combine still waits for GEMM2's
grid. Outputs: `kernel.py`'s bit for bit (the same kernels' arithmetic; a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "compile_only", "run", "variant_for"]


TINY_T_HANDOFF = dataclasses.replace(kernel.TINY_T, row_tile_handoff=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, with the row-tile hand-over from GEMM1 to GEMM2 where that is TINY_T."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return TINY_T_HANDOFF if chosen is kernel.TINY_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and TINY_T with the hand-over, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(TINY_T_HANDOFF, arch))


run = kernel.make_run(variant_for)
