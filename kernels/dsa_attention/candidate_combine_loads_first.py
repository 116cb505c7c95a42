"""DSA candidate v1.8 ("combine loads first", session 17): v1.7b (`candidate_staged_indices.py`) with a combine that
loads its 32 partial values into registers before it reduces the splits' statistics (`_CombineKernel.LOADS_FIRST`).

Why (NOTES.md): `kernel.py`'s combine issues 8 of its 32 partial loads before the statistics' shuffles and the rest
in two later waves, so its tail after the split grid ends holds two or three L2 round trips (2.1 us at 1 token, 3.1
us at 8). Loaded first, the partials share one round trip with the statistics. The same sums in the same order, so
the outputs are bit for bit `kernel.py`'s.

Prediction: ~0.5-0.8 us off every call: 1.05-1.08x over v1.7b at 1-2 tokens, 1.03-1.05x at 6-8.
"""

from __future__ import annotations

from typing import Callable

from . import kernel
from .candidate_staged_indices import split_kernel_for
from .kernel import DsaShapeError

__all__ = ["DsaShapeError", "compile_only", "run", "run_with_splits"]


class _LoadsFirstCombineKernel(kernel._CombineKernel):
    """`kernel.py`'s combine with the partial values loaded before the statistics are reduced."""

    LOADS_FIRST = True


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, Callable]:
    """Compile the candidate's two launchers (staged and `kernel.py`'s split kernel) for `arch` without a GPU."""
    return tuple(
        kernel.compiled_for(arch, combine=_LoadsFirstCombineKernel, split=split_kernel_for(splits))
        for splits in (1, kernel.NUM_CHUNKS)
    )


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """`kernel.py`'s contract."""
    run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None)


def run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits) -> None:
    """v1.7b's split kernels and split counts with this candidate's combine."""
    splits = kernel.num_splits_for(q_nope.shape[0]) if num_splits is None else num_splits
    kernel.run_with_splits(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, splits,
        combine=_LoadsFirstCombineKernel, split=split_kernel_for(splits),
    )
