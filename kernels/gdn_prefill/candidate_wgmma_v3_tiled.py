"""GDN candidate v3.2 ("tiled inverse"): candidate v3.1 (`candidate_wgmma_v3.py`) with the doubling products of the
SIMT inverse computed in register tiles: at the level of 16 each thread computes 1 x 2 outputs per step, at 32
2 x 2, so that each shared-memory load of T, A or X serves two products instead of one.

Why (NOTES.md, session 11): the doubling levels read ~160 K fp32 words of shared memory per chunk (two loads
per multiply-add), ~2.5-3 us of the chunk step at 32 words per cycle. Tiles halve the loads at 32 and cut them
by a quarter at 16. Every output's sum still runs over m in the same order, so the outputs are v3.1's bit for
bit (a GPU test). Prediction and bar in NOTES.md.
"""

from __future__ import annotations

from typing import Callable

from . import token_serial
from .token_serial import GPU_ARCH, GdnShapeError
from .wgmma_chunked import WgmmaChunked

__all__ = ["GdnShapeError", "TiledInverse", "compile_only", "run"]


class TiledInverse(WgmmaChunked):
    """v3.1's kernel with 1 x 2 (level 16) and 2 x 2 (level 32) output tiles per thread in the inverse."""

    doubling_tiles = ((1, 2), (2, 2))


def compile_only(arch: str = GPU_ARCH) -> Callable:
    """Compile the kernel for `arch` without touching a GPU (for CI and warm-up)."""
    return token_serial.compiled_for(arch, TiledInverse)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.py`'s contract (see `candidate_wgmma_v3.run`)."""
    token_serial.run_kernel(TiledInverse, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
