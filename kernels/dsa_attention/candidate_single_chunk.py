"""DSA candidate v1.5 ("single chunk"): at T <= 8 tokens (all 23 official workloads) every token gets 32 splits
of one 64-row chunk each, from a split kernel with one chunk stage in shared memory (~100 KB instead of
~175 KB: two CTAs per SM instead of one); larger T as `kernel.py`.

Why (NOTES.md, session 8): the split kernel waits on its chain of memory round trips (index row, gather,
compute, partial store), one CTA of 4 warps per SM. At 6-8 tokens (14 of the 23 workloads) `kernel.py`
gives each token 16 splits of two chunks, so each CTA runs that chain twice in a row (the second gather
overlaps only the first chunk's compute). With one chunk per CTA the double buffer has nothing to do, and
dropping it lets a second CTA share the SM: 32 x T <= 256 CTAs in one wave of two per SM, each running
the chain once, two chains overlapping per SM.

Cost: the combine merges 32 partials per token instead of 16 (twice the 33-KB partial stores and reads).
At 1-2 tokens `kernel.py` already runs 32 splits of one chunk: the same work, only the smaller footprint.

Prediction: T = 6-8 ~13-15 -> ~9.5-11.5 us (1.25-1.45x), T = 1-2 unchanged (0.98-1.03x); geomean over
the 23 ~1.15-1.25x, latency / floor 3.71 -> ~3.0-3.2. Outputs: the same per-chunk arithmetic; the
combine sums 32 partials where it summed 16 at T = 6-8, so the bits differ there (held to the contest
rule and to `kernel.py`'s distance from the reference by the GPU tests).
"""

from __future__ import annotations

from typing import Callable

from . import kernel
from .kernel import NUM_CHUNKS, DsaShapeError

__all__ = ["DsaShapeError", "SINGLE_CHUNK_MAX_TOKENS", "compile_only", "run", "run_with_splits"]

# 32 one-chunk splits per token, two CTAs per SM: T * 32 <= 2 * 132 CTAs in one wave.
SINGLE_CHUNK_MAX_TOKENS = 2 * kernel.MAX_CTAS_PER_WAVE // NUM_CHUNKS  # 8


class _SingleChunkSplitKernel(kernel._SplitKernel):
    """`kernel.py`'s split kernel with one chunk stage: valid only with one chunk per split (32 splits)."""

    num_stages = 1
    smem_carveout = 100  # two ~100 KB CTAs per SM need the whole unified storage as shared memory


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, Callable]:
    """Compile the candidate's kernels and `kernel.py`'s for `arch` without a GPU."""
    return kernel.compiled_for(arch, split=_SingleChunkSplitKernel), kernel.compile_only(arch)


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """`kernel.py`'s contract."""
    run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None)


def run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits) -> None:
    """`kernel.run_with_splits` with this candidate's choice: None picks 32 one-chunk splits up to
    SINGLE_CHUNK_MAX_TOKENS and `kernel.py`'s count above; 32 splits (one chunk each) run the one-stage
    split kernel, any other count `kernel.py`'s."""
    if num_splits is None and q_nope.shape[0] <= SINGLE_CHUNK_MAX_TOKENS:
        num_splits = NUM_CHUNKS
    split = _SingleChunkSplitKernel if num_splits == NUM_CHUNKS else kernel._SplitKernel
    kernel.run_with_splits(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits, split=split
    )
