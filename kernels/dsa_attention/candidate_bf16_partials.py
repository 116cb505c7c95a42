"""DSA candidate v1.9 ("bf16 partials", session 17): `kernel.py` v1.8 with each split's unnormalised O stored in
bf16 instead of fp32 (its max and sum stay fp32), in the first 1024 bytes of the same workspace rows.

Why (NOTES.md, session 17's ablation of v1.8): skipping the 33-KB partial store makes the split kernel 1.0 us
shorter at 1 token and 1.1 us at 8. At 8 tokens the 128 CTAs write 4.2 MB at once at their end, and the combine
reads it back on the call's tail; at 1 token each CTA's 33 KB (32 8-byte stores per thread) waits to drain before
the CTA retires. bf16 halves both.

Numerics: each partial is rounded to bf16 (relative 2^-9) before the weighted sum; the output is bf16 anyway, so
the error grows by about one output rounding (held to the contest rule by the GPU tests; not bit for bit v1.8).

Prediction: ~0.3-0.4 us off the call at 1-2 tokens and ~0.6 us at 6-8: ~1.04-1.05x, latency / floor 3.46 -> ~3.3.
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute

from . import kernel
from .kernel import CKV_DIM, NUM_HEADS, WS_COLS, DsaShapeError

__all__ = ["DsaShapeError", "compile_only", "run", "run_with_splits"]

F32_PER_BF16 = 2


@cute.jit
def partial_o_bf16(workspace: cute.Tensor) -> cute.Tensor:
    """bf16 view [T, splits, 16, 512] of the first 1024 bytes of each fp32 workspace row."""
    return cute.make_tensor(
        cute.recast_ptr(workspace.iterator, dtype=cutlass.BFloat16),
        cute.make_layout(
            (workspace.shape[0], workspace.shape[1], NUM_HEADS, CKV_DIM),
            stride=(
                workspace.stride[0] * F32_PER_BF16,
                workspace.stride[1] * F32_PER_BF16,
                WS_COLS * F32_PER_BF16,
                1,
            ),
        ),
    )


class _Bf16PartialSplitKernel(kernel._SplitKernel):
    """`kernel.py`'s split kernel storing its O in bf16."""

    @cute.jit
    def store_partial(
        self, thr_mma, acc_o: cute.Tensor, workspace: cute.Tensor, token: cutlass.Int32, split: cutlass.Int32
    ):
        partial = partial_o_bf16(workspace)
        tOgO = thr_mma.partition_C(cute.local_tile(partial[token, split, None, None], (NUM_HEADS, CKV_DIM), (0, 0)))
        acc_bf16 = cute.make_rmem_tensor_like(acc_o, cutlass.BFloat16)
        acc_bf16.store(acc_o.load().to(cutlass.BFloat16))
        cute.autovec_copy(acc_bf16, tOgO)


class _Bf16PartialCombineKernel(kernel._CombineKernel):
    """`kernel.py`'s combine reading the bf16 partials."""

    @cute.jit
    def load_partial(
        self, workspace: cute.Tensor, token: cutlass.Int32, split: cutlass.Int32, head: cutlass.Int32, col: cutlass.Int32
    ) -> cutlass.Float32:
        return partial_o_bf16(workspace)[token, split, head, col].to(cutlass.Float32)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, Callable]:
    """Compile both forms of the candidate's launcher for `arch` without a GPU."""
    return tuple(
        kernel.compiled_for(arch, staged, combine=_Bf16PartialCombineKernel, split=_Bf16PartialSplitKernel)
        for staged in (False, True)
    )


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """`kernel.py`'s contract."""
    run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None)


def run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits) -> None:
    """`kernel.run_with_splits` with the bf16-partial kernels (the same split counts and forms)."""
    kernel.run_with_splits(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits,
        combine=_Bf16PartialCombineKernel, split=_Bf16PartialSplitKernel,
    )
