"""DSA candidate v1.7 ("staged indices"): `kernel.py`'s split kernel with the split's row ids copied once into
shared memory ahead of the gathers (`_SplitKernel.STAGED_INDICES`).

Why (NOTES.md, session 17's ablation): with row ids computed instead of loaded, the split kernel is 1.8 us
shorter at 6 tokens and 3.0 us at 8, although it then gathers every row. Each thread of `kernel.py` reads its
36 row ids of a chunk one by one from global memory inside the branchy copy loop, and 8 more in the softmax, so
the loads are not batched, and at two chunks per CTA the second chunk's loads lie between the first chunk's
compute and the second's. Here one group of 16-B `cp.async` brings the split's 64-2048 row ids into shared
memory; the gathers and the softmax read them there.

Prediction: span at T = 8 ~15.0 -> ~12.3 us, T = 6-7 ~13 -> ~11.3, T = 1-2 ~1.00x; geomean ~1.10-1.14x over the
23, latency / floor 3.81 -> ~3.4. Outputs bit for bit `kernel.py`'s (the same arithmetic in the same order).
"""

from __future__ import annotations

from typing import Callable

from . import kernel
from .kernel import DsaShapeError

__all__ = ["DsaShapeError", "compile_only", "run", "run_with_splits"]


class _StagedIndicesSplitKernel(kernel._SplitKernel):
    """`kernel.py`'s split kernel reading the split's row ids from shared memory."""

    STAGED_INDICES = True


def compile_only(arch: str = kernel.GPU_ARCH) -> Callable:
    """Compile the candidate's kernels for `arch` without a GPU."""
    return kernel.compiled_for(arch, split=_StagedIndicesSplitKernel)


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """`kernel.py`'s contract."""
    run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None)


def run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits) -> None:
    """`kernel.run_with_splits` with this candidate's split kernel (the same split counts)."""
    kernel.run_with_splits(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits,
        split=_StagedIndicesSplitKernel,
    )
