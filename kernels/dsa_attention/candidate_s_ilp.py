"""DSA sparse attention candidate v1.3 ("S ILP"): `kernel.py` with the score product S = Q K^T summed
into four partial accumulators instead of one.

Why: the split kernel runs one CTA of 4 warps per SM, so each scheduler has a single warp and
nothing hides a dependency chain. Each warp's S tile (16 heads x 16 keys, two m16n8k16 MMAs per
k-step) sums 36 k-steps of 16 dims one dependent MMA after the other: two chains of 36 MMAs, ~0.5 us
per 64-row chunk by latency count. With the k-steps dealt round-robin over four accumulators the
chains are 9 deep (eight in flight), and three adds per element join them. At T = 1 every CTA
processes one chunk and the S product sits on its critical path between the gather and the softmax.

Prediction: ~0.3-0.4 us off every chunk a CTA processes: T = 1-2 (one chunk per CTA) ~8.3-9.2 ->
~7.9-8.8 us (1.04-1.05x), T = 6-8 (two chunks) ~13-14 -> ~12.3-13.3 us (1.05x). The sums are
reassociated, so outputs differ from v1.2's in the last bits of S (well inside 1e-2).
"""

from __future__ import annotations

from typing import Callable

from . import kernel
from .kernel import DsaShapeError

__all__ = ["DsaShapeError", "compile_only", "run", "run_with_splits"]


class _IlpSplit(kernel._SplitKernel):
    S_PARTIAL_SUMS = 4


def compile_only(arch: str = kernel.GPU_ARCH) -> Callable:
    """Compile the candidate for `arch` without touching a GPU (for CI and warm-up)."""
    return kernel.compiled_for(arch, split=_IlpSplit)


def run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits) -> None:
    """`kernel.run_with_splits` with this candidate's split kernel."""
    kernel.run_with_splits(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits, split=_IlpSplit
    )


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """`kernel.run`'s contract, with this candidate's split kernel."""
    run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None)
