"""MoE candidate v2.47 (NOTES.md): `kernel.py` with MEDIUM_T's GEMM1 (193 to MEDIUM_T_MAX_TOKENS tokens) in 64-token row
tiles of two stages at three CTAs per SM (walked by SM id, as `kernel.py`'s 32-token tiles), an item whose row tile
holds at most 32 tokens running the 32-wide MMA on the first half of its token stage.

Why: at 901 tokens GEMM1 runs the L2 at 80 % of its throughput, three quarters of its bytes being the weights that each
32-token row tile of an expert reads again; 64-token tiles read them ~23 % less often, but as LARGE_T has them (three
stages, two CTAs per SM, every item 64 wide) they lost at 901 (0.924x). Outputs: a token's products and promotions do
not depend on the tile or the MMA width that carries it, so bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["HALF_TILES", "MoeShapeError", "compile_only", "run", "variant_for"]

# GEMM2 keeps MEDIUM_T's own tiles and stages (gemm2_block_tokens and gemm2_num_stages are set there).
HALF_TILES = dataclasses.replace(kernel.MEDIUM_T, block_tokens=64, num_stages=2, gemm1_half_tile_items=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, MEDIUM_T's GEMM1 in 64-token tiles with half-width items."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return HALF_TILES if chosen is kernel.MEDIUM_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this candidate's, for `arch` without a GPU."""
    return (*kernel.compile_only(arch), kernel.compiled_for(HALF_TILES, arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
