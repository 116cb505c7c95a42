"""DSA candidate v1.10 ("shared carveout", session 17): `kernel.py` v1.8 with both kernels launched with the same
preferred shared-memory carveout (all of the unified L1 / shared storage as shared memory).

Why (NOTES.md, session 17's ncu of v1.8): the driver configures the split kernel's SMs with 200.7 KB of shared
memory (its 183 KB) and the combine's with 32.8 KB (it uses none). The combine is a programmatic dependent launch
that should be resident beside the split CTAs and waiting, yet its CUPTI start is at the split grid's end at every
T. Inference: an SM in one configuration does not take CTAs that asked for another, so the combine's CTAs start
only as split CTAs retire. With one carveout for both, they can share SMs.

Prediction: the combine's tail after the split kernel ~0.3-0.8 us shorter at 6-8 tokens, ~0-0.3 us at 1-2 (idle
SMs there); ~1.02-1.05x. Same kernels, same outputs bit for bit.
"""

from __future__ import annotations

from typing import Callable

from . import kernel
from .kernel import DsaShapeError

__all__ = ["DsaShapeError", "compile_only", "run", "run_with_splits"]

ALL_SHARED = 100  # percent of the unified storage as shared memory


class _CarveoutSplitKernel(kernel._SplitKernel):
    smem_carveout = ALL_SHARED


class _CarveoutCombineKernel(kernel._CombineKernel):
    smem_carveout = ALL_SHARED


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, Callable]:
    """Compile both forms of the candidate's launcher for `arch` without a GPU."""
    return tuple(
        kernel.compiled_for(arch, staged, combine=_CarveoutCombineKernel, split=_CarveoutSplitKernel)
        for staged in (False, True)
    )


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """`kernel.py`'s contract."""
    run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None)


def run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits) -> None:
    """`kernel.run_with_splits` with both kernels asking for all-shared storage."""
    kernel.run_with_splits(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits,
        combine=_CarveoutCombineKernel, split=_CarveoutSplitKernel,
    )
