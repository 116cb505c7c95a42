"""DSA candidate v1.7b ("staged indices", session 17): `kernel.py`'s split kernel with the split's row ids copied
once into shared memory ahead of the gathers (`_SplitKernel.STAGED_INDICES`), where each split has two or more
chunks (fewer than 32 splits: T >= 5); `kernel.py`'s split kernel at 32 one-chunk splits.

Why (NOTES.md, session 17's ablation): with row ids computed instead of loaded, the split kernel is 1.8 us
shorter at 6 tokens and 3.0 us at 8, although it then gathers every row. Each thread of `kernel.py` reads its
36 row ids of a chunk one by one from global memory inside the branchy copy loop, and 8 more in the softmax, so
the loads are not batched, and at two chunks per CTA the second chunk's loads lie between the first chunk's
compute and the second's. Here one group of 16-B `cp.async` brings the split's 64-2048 row ids into shared
memory; the gathers and the softmax read them there.

v1.7 (staging at every split count) measured 1.06-1.08x at 6-8 tokens and 0.96x at 1 token, where one chunk per
CTA gains nothing from the staging and pays its wait and barrier before the gather (NOTES.md); hence the dispatch.
Prediction for v1.7b: 6-8 tokens as v1.7, 1-2 tokens `kernel.py`'s kernels; ~1.04x over the 23. Outputs bit for
bit `kernel.py`'s (the same arithmetic in the same order).
"""

from __future__ import annotations

from typing import Callable

from . import kernel
from .kernel import DsaShapeError

__all__ = ["DsaShapeError", "compile_only", "run", "run_with_splits", "split_kernel_for"]


class _StagedIndicesSplitKernel(kernel._SplitKernel):
    """`kernel.py`'s split kernel reading the split's row ids from shared memory."""

    STAGED_INDICES = True


def compile_only(arch: str = kernel.GPU_ARCH) -> Callable:
    """Compile the candidate's staged split kernel (with `kernel.py`'s combine) for `arch` without a GPU."""
    return kernel.compiled_for(arch, split=_StagedIndicesSplitKernel)


def split_kernel_for(num_splits: int) -> type:
    """The staged split kernel where a split has two or more chunks, `kernel.py`'s at one chunk per split."""
    return _StagedIndicesSplitKernel if num_splits < kernel.NUM_CHUNKS else kernel._SplitKernel


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """`kernel.py`'s contract."""
    run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None)


def run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits) -> None:
    """`kernel.run_with_splits` with this candidate's split kernel (the same split counts; None: `kernel.py`'s)."""
    splits = kernel.num_splits_for(q_nope.shape[0]) if num_splits is None else num_splits
    kernel.run_with_splits(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, splits, split=split_kernel_for(splits)
    )
