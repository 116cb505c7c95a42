"""GDN prefill candidate v1.5 ("lean + ILP"): candidate v1.4 (`candidate_lean_epilogues.py`) with
P1's five Gram tiles per warp computed as five independent MMA chains before their epilogues.

Why: in v1.2 (and v1.4) a warp walks its Gram tiles in two dynamic loops (w + 1 A tiles, then
4 - w P tiles), each tile a dependent chain of 8 k-steps of `mma.sync` followed by its epilogue,
so at one warp per scheduler the five chains run one after the other. Every warp has exactly five
tiles, so here the loop is static: slot t < w + 1 is A tile (w, t), slot t > w is P tile
(3 - w, t - w - 1) (the same tiles as v1.2: the schedule, hence the shared-memory race analysis, is
unchanged). Slots go in groups of TILES_IN_FLIGHT: the group's MMAs first, into separate
accumulators, then their epilogues, so two chains overlap. Prediction: a few hundred cycles off P1,
~3-5 % of the chunk step on top of v1.4; compared with v1.4 in the same A/B.

Same math, buffers, barriers and entry contract as `chunked.py`.
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute

from . import candidate_lean_epilogues, chunked
from .chunked import BLOCK, HEAD_SIZE, NUM_BLOCKS, GdnShapeError, resolve_scale

__all__ = ["GdnShapeError", "compile_only", "resolve_scale", "run"]

TILES_PER_WARP = NUM_BLOCKS + 1  # (w + 1) A tiles + (NUM_BLOCKS - w) P tiles
# Tiles whose MMA chains run back to back: all five would need 255 registers (ptxas 12.8, no spills
# yet, but no headroom for two CTAs per SM); two add ~16 to v1.2's ~168.
TILES_IN_FLIGHT = 2


class _LeanIlp(candidate_lean_epilogues._LeanEpilogues):
    @cute.jit
    def gram_tiles(
        self,
        tiled_mma: cute.TiledMma,
        copy_a: cute.TiledCopy,
        copy_b: cute.TiledCopy,
        lane: cutlass.Int32,
        warp_idx: cutlass.Int32,
        kq: cute.Tensor,
        acc_sq: cute.Tensor,
        coords_sq: cute.Tensor,
        cum_log_g: cute.Tensor,
        beta: cute.Tensor,
        a16: cute.Tensor,
        a_diag: cute.Tensor,
        p16: cute.Tensor,
    ):
        q_block = NUM_BLOCKS - 1 - warp_idx
        accs = [cute.make_rmem_tensor(acc_sq.layout, cutlass.Float32) for _ in range(TILES_IN_FLIGHT)]
        for first in cutlass.range_constexpr(0, TILES_PER_WARP, TILES_IN_FLIGHT):
            group = range(first, min(first + TILES_IN_FLIGHT, TILES_PER_WARP))
            for t in group:  # trace-time loop: the group's MMA chains, back to back
                is_a = t <= warp_idx
                row_tile = warp_idx if is_a else NUM_BLOCKS + q_block  # k rows of block w, or q rows of block 3 - w
                col_block = t if is_a else t - warp_idx - 1
                acc = accs[t - first]
                acc.fill(0.0)
                self.warp_gemm(
                    tiled_mma, copy_a, copy_b, lane,
                    cute.local_tile(kq, (BLOCK, HEAD_SIZE), (row_tile, 0)),
                    cute.local_tile(kq, (BLOCK, HEAD_SIZE), (col_block, 0)),
                    acc,
                )  # fmt: skip
            for t in group:  # then their epilogues
                if t <= warp_idx:
                    self.a_tile_epilogue(accs[t - first], coords_sq, warp_idx, t, cum_log_g, beta, a16, a_diag)
                else:
                    self.p_tile_epilogue(accs[t - first], coords_sq, q_block, t - warp_idx - 1, cum_log_g, p16)


def compile_only(arch: str = chunked.GPU_ARCH) -> Callable:
    """Compile the candidate for `arch` without touching a GPU (for CI and warm-up)."""
    return chunked.compiled_for(arch, _LeanIlp)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`chunked.run`'s contract, with this candidate's kernel."""
    chunked.run_kernel(_LeanIlp, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
