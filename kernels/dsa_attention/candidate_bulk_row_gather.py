"""DSA candidate v1.12 ("bulk row gather", session 18): `kernel.py` v1.11 with each chunk's cache rows gathered by
the bulk copy engine (one `cp.async.bulk` per ckv row part and kpe row part) instead of 16-B `cp.async`.

Why (NOTES.md, session 18's timer stamps): at 1-2 tokens 32-64 split CTAs each gather one 64-row chunk (73 KB)
and their attention ends only ~4.3-4.6 us after they start, ~1.1 us of it the chunk's compute. `kernel.py` issues
that chunk as 4,608 16-B `cp.async` (36 per thread), each a load-store-unit request whose bytes the SM tracks until
they land. A bulk copy of a whole 1,024-B ckv row (and of its 128-B kpe row) is one instruction handed to the
bulk copy engine, which tracks completion in bytes on an mbarrier; 128 copies per chunk instead of 4,608, which
should let one SM keep more of its 73 KB in flight.

Mechanics: thread t takes row t // 2 of the chunk, the ckv part (t even) or the kpe part (t odd). For a valid row
it registers its bytes on the stage's mbarrier (`mbarrier.arrive.expect_tx`) and issues the copy; for a padding
row it zero-fills its part with generic shared stores, fences them to the async proxy (a later bulk copy may write
the same bytes) and arrives without bytes. The barrier expects all 128 threads per phase, so its phase completes
when every thread has arrived and every registered byte has landed; the stage's k-th use waits on parity k % 2.
Q and the staged row ids stay on `cp.async` (their groups and waits are kernel.py's).

Prediction: `attend` ~0.5-1 us shorter at 1-2 tokens (1.05-1.12x), within +-3 % at 6-8 tokens where the gather
is DRAM-bound. Same data in the same shared-memory layout, so bit for bit `kernel.py`'s outputs.
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute

from . import kernel
from .kernel import DsaShapeError

__all__ = ["DsaShapeError", "compile_only", "run", "run_with_splits"]

THREADS_PER_ROW = 2  # one for the ckv part, one for the kpe part
assert kernel.NUM_THREADS == THREADS_PER_ROW * kernel.BLOCK_N


class _BulkGatherSplitKernel(kernel._SplitKernel):
    def extra_shared_fields(self) -> dict:
        return {"stage_full": cute.struct.Align[cute.struct.MemRange[cutlass.Int64, kernel.NUM_STAGES], 8]}

    def bind_extra_shared(self, storage) -> None:
        self.stage_full = storage.stage_full.data_ptr()

    @cute.jit
    def prepare_gather(self, tidx: cutlass.Int32) -> None:
        if tidx == 0:
            for stage in cutlass.range_constexpr(kernel.NUM_STAGES):
                cute.arch.mbarrier_init(self.stage_full + stage, kernel.NUM_THREADS)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

    @cute.jit
    def wait_chunk(self, chunk: cutlass.Int32, stage: cutlass.Int32) -> None:
        cute.arch.mbarrier_wait(self.stage_full + stage, (chunk // kernel.NUM_STAGES) % 2)

    @cute.jit
    def gather_chunk(
        self,
        g2s: cute.CopyAtom,
        ckv_rows: cute.Tensor,
        kpe_rows: cute.Tensor,
        sparse_indices: cute.Tensor,
        srow_ids,
        sk: cute.Tensor,
        token: cutlass.Int32,
        chunk_row: cutlass.Int32,
        split_row: cutlass.Int32,
        stage: cutlass.Int32,
        num_cache_rows: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        """One bulk copy per thread: row tidx // 2 of the chunk, its ckv part (even tidx) or kpe part."""
        row = tidx // THREADS_PER_ROW
        row_id = self.row_id(sparse_indices, srow_ids, token, chunk_row + row, split_row + row)
        valid = row_id >= 0 and row_id < num_cache_rows
        if tidx % THREADS_PER_ROW == 0:
            self.copy_row_part(ckv_rows, row_id, valid, sk, row, 0, kernel.CKV_DIM, stage)
        else:
            self.copy_row_part(kpe_rows, row_id, valid, sk, row, kernel.CKV_DIM, kernel.KPE_DIM, stage)

    @cute.jit
    def copy_row_part(
        self,
        rows: cute.Tensor,
        row_id: cutlass.Int32,
        valid: cutlass.Boolean,
        sk: cute.Tensor,
        row: cutlass.Int32,
        first_col: cutlass.Constexpr,
        num_elems: cutlass.Constexpr,
        stage: cutlass.Int32,
    ):
        """Columns [first_col, first_col + num_elems) of the chunk's row `row`: a bulk copy of cache row
        `row_id` of `rows`, or zeros for a padding row; either way one arrival on the stage's barrier."""
        full = self.stage_full + stage
        destination = sk.iterator + cute.crd2idx((row, first_col, stage), sk.layout)
        if valid:
            source = rows.iterator + cute.crd2idx((row_id, 0), rows.layout)
            cute.arch.mbarrier_arrive_and_expect_tx(full, num_elems * 2)
            cute.arch.inline_ptx(
                f"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{{$r0}}], [{{$r1}}], {num_elems * 2}, [{{$r2}}];",
                read_only_args=[
                    cutlass.Int32(destination.toint()),
                    cutlass.Int64(source.toint()),
                    cutlass.Int32(full.toint()),
                ],
            )
        else:
            cute.make_tensor(destination, cute.make_layout(num_elems)).fill(0.0)
            # A later use of this stage may bulk-copy into the same bytes.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive(full)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, Callable]:
    """Compile both forms of the candidate's launcher for `arch` without a GPU."""
    return tuple(kernel.compiled_for(arch, staged, split=_BulkGatherSplitKernel) for staged in (False, True))


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """`kernel.py`'s contract."""
    run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None)


def run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits) -> None:
    """`kernel.run_with_splits` with the bulk-copy row gather."""
    kernel.run_with_splits(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits,
        split=_BulkGatherSplitKernel,
    )
