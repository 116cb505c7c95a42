"""DSA sparse attention candidate v1.4 ("eight warps"): `kernel.py` with 8 warps per split CTA
instead of 4.

Why: ncu of v1.2's split kernel (session 8) at T = 1 and T = 8 shows one warp per scheduler (the
CTA's ~175 KB of shared memory allows one CTA per SM) with no eligible warp in 82-83 % of cycles;
each warp issues ~1,400 instructions per chunk one dependent step after the other. With 8 warps
the same shared memory holds twice the issuing warps, and each warp takes half of each product: 8
of the 64 keys of S (one n8 atom, 36 MMAs per chunk instead of 72) and 64 of the 512 columns of O
(32 MMAs instead of 64, half the accumulators), half the gather's copies and half a softmax row.
The Q fragments are still loaded by every warp.

Prediction: the split kernel ~6.0 -> ~4.5 us at T = 1 (one chunk per CTA) and ~12 -> ~9.5 us at
T = 8 (two chunks); spans T = 1 ~8.2 -> ~7 us, T = 8 ~15 -> ~12.5 us; ~1.15x, latency / floor
~3.7 -> ~3.2. S and P are bitwise v1.2's (the same MMAs per element); a softmax row's sum adds
16 partial sums of 4 instead of 8 of 8, so the output differs from v1.2's in the last bits.
"""

from __future__ import annotations

from typing import Callable

from . import kernel
from .kernel import DsaShapeError

__all__ = ["DsaShapeError", "compile_only", "run", "run_with_splits"]


class _EightWarpSplit(kernel._SplitKernel):
    NUM_WARPS = 8


def compile_only(arch: str = kernel.GPU_ARCH) -> Callable:
    """Compile the candidate for `arch` without touching a GPU (for CI and warm-up)."""
    return kernel.compiled_for(arch, split=_EightWarpSplit)


def run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits) -> None:
    """`kernel.run_with_splits` with this candidate's split kernel."""
    kernel.run_with_splits(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits, split=_EightWarpSplit
    )


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """`kernel.run`'s contract, with this candidate's split kernel."""
    run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None)
