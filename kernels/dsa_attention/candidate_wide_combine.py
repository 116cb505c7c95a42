"""DSA sparse attention candidate v1.1 ("wide combine"): `kernel.py` (v1) with a combine kernel that
has four times the CTAs and every split's load in flight at once.

Why: `tools/kernel_breakdown.py` (session 4, H200) puts v1's combine at 6.5 us of the 13.6 us
span at T = 1 and 4.4-4.5 us of 15.9-16.9 us at T = 6-8. At T = 1 it has 16 CTAs (one per head),
each thread reads 4 columns of all 32 splits, in batches of 8 (the split loop is unrolled by 8 over
a dynamic count): four dependent round trips to L2 on 16 SMs. Here a CTA takes one quarter of a
head's 512 columns (grid T x 16 heads x 4, one column per thread), and the loop over the splits is
unrolled over the largest split count (32) with branch-free loads: a split index past the actual
count reads the last split again (an address that is always valid) and weighs 0, since its lane's
weight is exp2(-inf) = 0. Every thread then has its 32 loads in flight together.
The sum runs over the splits in the same order as v1, so the output is v1's bit for bit (the
extra terms add +0). Prediction: combine 6.5 -> ~2 us at T = 1 and 4.5 -> ~2.5 us at T = 6-8,
i.e. 13.6 -> ~9.5 us and 16-17 -> ~14.5 us spans.

The split kernel, the workspace layout and the entry contract are `kernel.py`'s.
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute

from . import kernel
from .kernel import CKV_DIM, NUM_CHUNKS, NUM_HEADS, NUM_THREADS, DsaShapeError

__all__ = ["DsaShapeError", "compile_only", "run", "run_with_splits"]

COLUMN_GROUPS = CKV_DIM // NUM_THREADS  # 4 CTAs per (token, head), one column per thread
MAX_SPLITS = NUM_CHUNKS  # 32: the largest split count kernel.VALID_SPLITS holds
assert MAX_SPLITS == max(kernel.VALID_SPLITS) and MAX_SPLITS <= cute.arch.WARP_SIZE


class _WideCombine(kernel._CombineKernel):
    """Merges the splits of one (token, head, quarter of the columns) by log-sum-exp."""

    @cute.jit
    def launch(self, workspace: cute.Tensor, output: cute.Tensor, lse: cute.Tensor, stream):
        self.kernel(workspace, output, lse).launch(
            grid=[output.shape[0], NUM_HEADS, COLUMN_GROUPS],
            block=[NUM_THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, workspace: cute.Tensor, output: cute.Tensor, lse: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        token, head, group = cute.arch.block_idx()
        num_splits = workspace.shape[1]
        lane = cute.arch.lane_idx()
        col = group * NUM_THREADS + tidx

        global_max, weight, total = self.split_weights(workspace, token, head, num_splits, lane)

        last = num_splits - 1
        acc = cutlass.Float32(0.0)
        for s in cutlass.range_constexpr(MAX_SPLITS):
            acc = acc + cute.arch.shuffle_sync(weight, s) * workspace[token, cutlass.min(s, last), head, col]

        inv_total = cutlass.Float32(0.0) if total == cutlass.Float32(0.0) else cutlass.Float32(1.0) / total
        output[token, head, col] = (acc * inv_total).to(cutlass.BFloat16)
        if group == 0 and tidx == 0:
            lse[token, head] = global_max + cute.math.log2(total)


def compile_only(arch: str = kernel.GPU_ARCH) -> Callable:
    """Compile the candidate for `arch` without touching a GPU (for CI and warm-up)."""
    return kernel.compiled_for(arch, _WideCombine)


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """`kernel.run`'s contract, with this candidate's combine."""
    run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None)


def run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits) -> None:
    """`kernel.run_with_splits` with this candidate's combine."""
    kernel.run_with_splits(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits, _WideCombine
    )
