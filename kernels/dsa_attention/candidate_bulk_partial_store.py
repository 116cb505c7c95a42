"""DSA candidate v1.11 ("bulk partial store", session 18): `kernel.py` v1.8 with the split kernel's epilogue
staged through shared memory and written to the workspace by one bulk asynchronous copy.

Why (NOTES.md, session 18's timer stamps of v1.8): at 1 token a split CTA's attention ends at ~4.3-4.6 us and
its last partial store issues at ~5.1-5.5 us: issuing the 33 KB partial takes ~0.9 us. From registers, each
warp's `st.global.v2` touches 8 rows of 32 B (8 lines per instruction, 128 such instructions per CTA). The
workspace rows of one (token, split) are one contiguous 33,024-B block, so the CTA can write its MMA fragments
into the chunk ring (free once `attend` returns) and hand the whole block to the bulk copy engine with a single
`cp.async.bulk`.

Prediction: the store phase ~0.9 -> ~0.4 us, so the split kernel and the call ~0.5 us shorter at every T:
~1.06x at 1-2 tokens, ~1.04x at 6-8. Same arithmetic, so the same outputs bit for bit.
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute

from . import kernel
from .kernel import DsaShapeError

__all__ = ["DsaShapeError", "compile_only", "run", "run_with_splits"]

PARTIAL_BYTES = kernel.NUM_HEADS * kernel.WS_COLS * 4  # one (token, split)'s fp32 rows, contiguous


class _BulkStoreSplitKernel(kernel._SplitKernel):
    @cute.jit
    def store_partial(
        self,
        acc_o: cute.Tensor,
        row_max: cute.Tensor,
        row_sum: cute.Tensor,
        workspace: cute.Tensor,
        tiled_mma: cute.TiledMma,
        sk: cute.Tensor,
        token: cutlass.Int32,
        split: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        """The workspace rows of this split assembled in the chunk ring in their global layout, then
        copied out by one thread's bulk copy."""
        # attend() ended at a barrier after the last P V, so nobody reads the ring any more.
        staged = cute.make_tensor(
            cute.recast_ptr(sk.iterator, dtype=cutlass.Float32),
            cute.make_layout((kernel.NUM_HEADS, kernel.WS_COLS), stride=(kernel.WS_COLS, 1)),
        )
        thr_mma = tiled_mma.get_slice(tidx)
        cute.autovec_copy(acc_o, thr_mma.partition_C(cute.local_tile(staged, (kernel.NUM_HEADS, kernel.CKV_DIM), (0, 0))))
        softmax_row = tidx // kernel.THREADS_PER_SOFTMAX_ROW
        if tidx % kernel.THREADS_PER_SOFTMAX_ROW == 0:
            staged[softmax_row, kernel.WS_MAX_COL] = row_max[0]
            staged[softmax_row, kernel.WS_SUM_COL] = row_sum[0]
            # The two padding columns go out with the block: zero, not stale K bits.
            staged[softmax_row, kernel.WS_SUM_COL + 1] = cutlass.Float32(0.0)
            staged[softmax_row, kernel.WS_SUM_COL + 2] = cutlass.Float32(0.0)
        # Every writer makes its shared-memory stores visible to the async proxy before the barrier.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        if tidx == 0:
            destination = workspace.iterator + cute.crd2idx((token, split, 0, 0), workspace.layout)
            cute.arch.inline_ptx(
                f"cp.async.bulk.global.shared::cta.bulk_group [{{$r0}}], [{{$r1}}], {PARTIAL_BYTES};",
                read_only_args=[cutlass.Int64(destination.toint()), cutlass.Int32(staged.iterator.toint())],
            )
            cute.arch.cp_async_bulk_commit_group()
            # Complete (not only read out of shared memory) before the CTA exits, as the generic stores
            # of kernel.py are: the combine's griddepcontrol.wait then covers them like any other write.
            cute.arch.cp_async_bulk_wait_group(0, read=False)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, Callable]:
    """Compile both forms of the candidate's launcher for `arch` without a GPU."""
    return tuple(kernel.compiled_for(arch, staged, split=_BulkStoreSplitKernel) for staged in (False, True))


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """`kernel.py`'s contract."""
    run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None)


def run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits) -> None:
    """`kernel.run_with_splits` with the bulk-copy epilogue."""
    kernel.run_with_splits(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits,
        split=_BulkStoreSplitKernel,
    )
