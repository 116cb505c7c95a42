"""DSA sparse attention for SM90 in CuTe-DSL: `dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64`.

Flash-decoding over the 2048 selected cache rows of each token, in two kernels:

1. `_SplitKernel`, grid (T, num_splits). One CTA of 4 warps takes all 16 heads of one token and
   2048 / num_splits of its rows, in chunks of 64 rows:
   - where the split has two or more chunks, first copies its row ids into shared memory (with
     one chunk it reads them from global memory as it copies, which starts the gather sooner);
   - gathers each chunk (ckv 1024 B + kpe 128 B per row) into shared memory with 16-B `cp.async`,
     double-buffered (chunk c+1 is in flight while chunk c is computed); a padding row (-1, or
     outside the cache) is zero-filled in shared memory and masked to -inf in the softmax;
   - S[16, 64] = Q[16, 576] K[64, 576]^T with `mma.sync` m16n8k16 (M = the 16 heads; the 4 warps
     split the 64 keys), staged through shared memory in fp32;
   - online softmax in the log2 domain (log2(e) folded into sm_scale), one row per 8 threads;
   - O[16, 512] += P[16, 64] V[64, 512] with `mma.sync` (the 4 warps split the 512 columns; V is
     the ckv part of the same shared-memory rows, read transposed by `ldmatrix.trans`);
   - writes its unnormalised O (fp32) and its running max m and sum l per head to a workspace
     [T, num_splits, 16, 516] (O in columns 0..511, m in 512, l in 513): assembled in shared memory
     and copied out as one 33-KB block by a bulk asynchronous copy.
2. `_CombineKernel`, grid (T, 16 heads, 4 column groups): loads its partials, merges the splits by
   log-sum-exp and writes the bf16 output and the base-2 lse. A token with no valid row gets output 0 and lse -inf; a split with
   no valid row has m = -inf, l = 0, O = 0 and weighs nothing.

The combine is launched as a programmatic dependent of the split kernel (Hopper's PDL; NOTES.md):
each split CTA triggers its dependents as it starts,
so the combine grid launches while the split kernel runs and its CTAs wait in `griddepcontrol.wait`,
which returns once every split CTA has finished and its workspace writes are visible. Correctness
does not depend on where the trigger is, and the combine can only launch once every split CTA has
started, so its waiting CTAs never keep a split CTA off an SM. This hides the launch gap between the
two kernels (~1 us) and the combine's ramp.

Both kernels are compiled once per form of the split kernel (row ids staged or not; dynamic T, P and
num_splits) into one TVM-FFI function that takes the torch tensors directly and runs on the current
torch stream; `run` only picks the split count from T (and with it the form), allocates the
workspace and calls it. Design, measurements and the ideas tried: NOTES.md.
"""

from __future__ import annotations

from typing import Callable

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

NUM_HEADS = 16
CKV_DIM = 512
KPE_DIM = 64
QK_DIM = CKV_DIM + KPE_DIM  # 576: the score contracts over [ckv | kpe]
PAGE_SIZE = 64
TOPK = 2048

BLOCK_N = 64  # cache rows per chunk
NUM_CHUNKS = TOPK // BLOCK_N  # 32
NUM_THREADS = 128  # 4 warps
NUM_STAGES = 2  # chunks resident in shared memory (double buffering)
# Rows of Q and K in shared memory are padded by 16 B so that the 8 row addresses of one
# ldmatrix fall on distinct bank groups (a 1152-B row would put them all on the same banks).
QK_ROW_STRIDE = QK_DIM + 8
P_ROW_STRIDE = BLOCK_N + 8
S_ROW_STRIDE = BLOCK_N + 4
COPY_ELEMS = 8  # bf16 elements per 16-B cp.async
THREADS_PER_SOFTMAX_ROW = NUM_THREADS // NUM_HEADS  # 8
COLS_PER_SOFTMAX_THREAD = BLOCK_N // THREADS_PER_SOFTMAX_ROW  # 8
COMBINE_COLUMN_GROUPS = CKV_DIM // NUM_THREADS  # 4 combine CTAs per (token, head), one column per thread
# Split counts the split kernel accepts (each split takes a whole number of chunks).
VALID_SPLITS = tuple(1 << i for i in range(NUM_CHUNKS.bit_length()) if NUM_CHUNKS % (1 << i) == 0)
MAX_SPLITS = max(VALID_SPLITS)  # 32: the combine's unrolled loop; its split statistics fit one warp
# The split kernel's CTAs use ~175 KB of shared memory, so one fits per SM: one wave is the H200's
# 132 SMs. The split count keeps T * splits within it: a second wave (e.g. 160-224 CTAs at
# T = 5-7) would take longer than T = 8's single wave of 128.
MAX_CTAS_PER_WAVE = 132
# Workspace row per (token, split, head), fp32: O[0:512] unnormalised, then m (log2 domain) and l;
# padded to 516 so that every row starts 16-B aligned.
WS_MAX_COL = CKV_DIM
WS_SUM_COL = CKV_DIM + 1
WS_COLS = CKV_DIM + 4
PARTIAL_BYTES = NUM_HEADS * WS_COLS * 4  # one (token, split)'s workspace rows: one contiguous block
LOG2_E = 1.4426950408889634
# The flattened cache is addressed with 32-bit element offsets.
MAX_CACHE_ELEMENTS = 2**31

GPU_ARCH = "sm_90a"

assert TOPK % BLOCK_N == 0 and NUM_THREADS % NUM_HEADS == 0 and CKV_DIM % NUM_THREADS == 0
# The epilogue's bulk copy moves a multiple of 16 B, assembled in the chunk ring.
assert PARTIAL_BYTES % 16 == 0 and PARTIAL_BYTES <= NUM_STAGES * BLOCK_N * QK_ROW_STRIDE * 2
assert MAX_SPLITS == NUM_CHUNKS <= cute.arch.WARP_SIZE


class DsaShapeError(ValueError):
    """An input does not have the shape, dtype or layout of the definition."""


def _make_tiled_mma() -> cute.TiledMma:
    # 4 warps side by side along N; a 64-wide N tile gives each warp two n8 atoms, i.e. 16 columns,
    # which is what a 4-matrix ldmatrix of the B operand fills.
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (16, 8, 16)),
        (1, NUM_THREADS // 32, 1),
        permutation_mnk=(NUM_HEADS, 64, 16),
    )


class _SplitKernel:
    """Partial attention of one token over 2048 / num_splits of its rows (see module docstring)."""

    def __init__(self, staged_indices: bool = False) -> None:
        # Staged: the split's row ids copied once into shared memory ahead of the gathers, instead of
        # read one by one from global memory inside the copy loop and the softmax: 5-8 % off the calls
        # with two chunks per split; with one chunk, staging delays the gather by its wait and barrier,
        # a 4 % loss at 1 token (NOTES.md).
        self.staged_indices = staged_indices

    def shared_layouts(self):
        """(tiled MMA, layouts of sq, sk, ss, sp, the shared-memory struct): the split kernel's operands,
        for this class's launch and a candidate's (traced inside the caller's jit)."""
        tiled_mma = _make_tiled_mma()
        sq_layout = cute.make_layout((NUM_HEADS, QK_DIM), stride=(QK_ROW_STRIDE, 1))
        sk_layout = cute.make_layout(
            (BLOCK_N, QK_DIM, NUM_STAGES), stride=(QK_ROW_STRIDE, 1, BLOCK_N * QK_ROW_STRIDE)
        )
        ss_layout = cute.make_layout((NUM_HEADS, BLOCK_N), stride=(S_ROW_STRIDE, 1))
        sp_layout = cute.make_layout((NUM_HEADS, BLOCK_N), stride=(P_ROW_STRIDE, 1))

        fields = {
            "sq": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, NUM_HEADS * QK_ROW_STRIDE], 128],
            "sk": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, NUM_STAGES * BLOCK_N * QK_ROW_STRIDE], 128],
            "ss": cute.struct.Align[cute.struct.MemRange[cutlass.Float32, NUM_HEADS * S_ROW_STRIDE], 128],
            "sp": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, NUM_HEADS * P_ROW_STRIDE], 128],
            "salpha": cute.struct.Align[cute.struct.MemRange[cutlass.Float32, NUM_HEADS], 16],
        }
        if cutlass.const_expr(self.staged_indices):
            fields["srow_ids"] = cute.struct.Align[cute.struct.MemRange[cutlass.Int32, TOPK], 16]
        SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        return tiled_mma, sq_layout, sk_layout, ss_layout, sp_layout, SharedStorage

    def shared_tensors(self, SharedStorage, sq_layout, sk_layout, ss_layout, sp_layout):
        """The CTA's shared-memory tensors (sq, sk, ss, sp, salpha, srow_ids; srow_ids is None unless
        staged_indices)."""
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        srow_ids = None
        if cutlass.const_expr(self.staged_indices):
            srow_ids = storage.srow_ids.get_tensor(cute.make_layout(TOPK))
        return (
            storage.sq.get_tensor(sq_layout),
            storage.sk.get_tensor(sk_layout),
            storage.ss.get_tensor(ss_layout),
            storage.sp.get_tensor(sp_layout),
            storage.salpha.get_tensor(cute.make_layout(NUM_HEADS)),
            srow_ids,
        )

    @cute.jit
    def launch(
        self,
        q_nope: cute.Tensor,
        q_pe: cute.Tensor,
        ckv_rows: cute.Tensor,
        kpe_rows: cute.Tensor,
        sparse_indices: cute.Tensor,
        scale_log2: cutlass.Float32,
        workspace: cute.Tensor,
        stream,
    ):
        tiled_mma, sq_layout, sk_layout, ss_layout, sp_layout, SharedStorage = self.shared_layouts()
        num_splits = workspace.shape[1]
        self.kernel(
            q_nope,
            q_pe,
            ckv_rows,
            kpe_rows,
            sparse_indices,
            scale_log2,
            workspace,
            tiled_mma,
            sq_layout,
            sk_layout,
            ss_layout,
            sp_layout,
            SharedStorage,
        ).launch(
            grid=[q_nope.shape[0], num_splits, 1],
            block=[NUM_THREADS, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        q_nope: cute.Tensor,
        q_pe: cute.Tensor,
        ckv_rows: cute.Tensor,
        kpe_rows: cute.Tensor,
        sparse_indices: cute.Tensor,
        scale_log2: cutlass.Float32,
        workspace: cute.Tensor,
        tiled_mma: cute.TiledMma,
        sq_layout: cute.Layout,
        sk_layout: cute.Layout,
        ss_layout: cute.Layout,
        sp_layout: cute.Layout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        token, split, _ = cute.arch.block_idx()
        # Programmatic dependent launch: once every split CTA has started, the combine grid may
        # launch; its CTAs wait in griddepcontrol.wait until this grid is complete and visible.
        cute.arch.griddepcontrol_launch_dependents()

        sq, sk, ss, sp, salpha, srow_ids = self.shared_tensors(
            SharedStorage, sq_layout, sk_layout, ss_layout, sp_layout
        )

        acc_o, row_max, row_sum = self.attend(
            q_nope,
            q_pe,
            ckv_rows,
            kpe_rows,
            sparse_indices,
            scale_log2,
            workspace.shape[1],
            tiled_mma,
            sq,
            sk,
            ss,
            sp,
            salpha,
            srow_ids,
            token,
            split,
            tidx,
        )
        self.store_partial(acc_o, row_max, row_sum, workspace, tiled_mma, sk, token, split, tidx)

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
        """The epilogue: this split's workspace rows (unnormalised O, m, l) assembled in the chunk ring in
        their global layout, then written by one thread's bulk copy of the contiguous block. The bulk
        copy writes whole 128-B lines, which the combine reloads faster than the 32-B pieces of 8 rows
        that per-warp `st.global.v2` stores from registers would leave (NOTES.md)."""
        # attend() ended at a barrier after the last P V, so nobody reads the ring any more.
        block = cute.make_tensor(
            cute.recast_ptr(sk.iterator, dtype=cutlass.Float32),
            cute.make_layout((NUM_HEADS, WS_COLS), stride=(WS_COLS, 1)),
        )
        thr_mma = tiled_mma.get_slice(tidx)
        cute.autovec_copy(acc_o, thr_mma.partition_C(cute.local_tile(block, (NUM_HEADS, CKV_DIM), (0, 0))))
        softmax_row = tidx // THREADS_PER_SOFTMAX_ROW
        if tidx % THREADS_PER_SOFTMAX_ROW == 0:
            block[softmax_row, WS_MAX_COL] = row_max[0]
            block[softmax_row, WS_SUM_COL] = row_sum[0]
            # The two padding columns go out with the block: zero, not stale K bits.
            block[softmax_row, WS_SUM_COL + 1] = cutlass.Float32(0.0)
            block[softmax_row, WS_SUM_COL + 2] = cutlass.Float32(0.0)
        # Every writer makes its shared-memory stores visible to the async proxy before the barrier.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        if tidx == 0:
            destination = workspace.iterator + cute.crd2idx((token, split, 0, 0), workspace.layout)
            cute.arch.inline_ptx(
                f"cp.async.bulk.global.shared::cta.bulk_group [{{$r0}}], [{{$r1}}], {PARTIAL_BYTES};",
                read_only_args=[cutlass.Int64(destination.toint()), cutlass.Int32(block.iterator.toint())],
            )
            cute.arch.cp_async_bulk_commit_group()
            # Complete (not only read out of shared memory) before the CTA exits, so the combine's
            # griddepcontrol.wait covers these writes as it covers any other write of the grid.
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def attend(
        self,
        q_nope: cute.Tensor,
        q_pe: cute.Tensor,
        ckv_rows: cute.Tensor,
        kpe_rows: cute.Tensor,
        sparse_indices: cute.Tensor,
        scale_log2: cutlass.Float32,
        num_splits: cutlass.Int32,
        tiled_mma: cute.TiledMma,
        sq: cute.Tensor,
        sk: cute.Tensor,
        ss: cute.Tensor,
        sp: cute.Tensor,
        salpha: cute.Tensor,
        srow_ids,
        token: cutlass.Int32,
        split: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        """The split's attention over its chunks (Q and chunk gathers, S = Q K^T, online softmax,
        O += P V); returns the unnormalised O (MMA C layout) and this thread's softmax row's
        running max and sum. The epilogue that stores them is the caller's."""
        chunks_per_split = NUM_CHUNKS // num_splits
        first_row = split * chunks_per_split * BLOCK_N
        num_cache_rows = ckv_rows.shape[0]
        g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            cutlass.BFloat16,
            num_bits_per_copy=128,
        )

        if cutlass.const_expr(self.staged_indices):
            # The split's row ids, in a cp.async group of their own ahead of Q's.
            g2s_ids = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Int32, num_bits_per_copy=128
            )
            ids_per_copy = 4
            for piece in cutlass.range(tidx, chunks_per_split * BLOCK_N // ids_per_copy, NUM_THREADS, unroll=1):
                cute.copy(
                    g2s_ids,
                    cute.local_tile(sparse_indices[token, None], (ids_per_copy,), (first_row // ids_per_copy + piece,)),
                    cute.local_tile(srow_ids, (ids_per_copy,), (piece,)),
                )
            cute.arch.cp_async_commit_group()

        # ---- Q: [q_nope | q_pe] of this token into sq (in the first chunk's cp.async group, or in a group
        # of its own after the row ids' when they are staged) ----
        for i in cutlass.range_constexpr(NUM_HEADS * CKV_DIM // COPY_ELEMS // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            head = linear // (CKV_DIM // COPY_ELEMS)
            seg = linear % (CKV_DIM // COPY_ELEMS)
            cute.copy(
                g2s,
                cute.local_tile(q_nope[token, head, None], (COPY_ELEMS,), (seg,)),
                cute.local_tile(sq[head, None], (COPY_ELEMS,), (seg,)),
            )
        if tidx < NUM_HEADS * KPE_DIM // COPY_ELEMS:
            head = tidx // (KPE_DIM // COPY_ELEMS)
            seg = tidx % (KPE_DIM // COPY_ELEMS)
            cute.copy(
                g2s,
                cute.local_tile(q_pe[token, head, None], (COPY_ELEMS,), (seg,)),
                cute.local_tile(sq[head, None], (COPY_ELEMS,), (CKV_DIM // COPY_ELEMS + seg,)),
            )

        if cutlass.const_expr(self.staged_indices):
            cute.arch.cp_async_commit_group()  # Q's group
            cute.arch.cp_async_wait_group(1)  # the row ids have landed (Q may still be in flight)
            cute.arch.sync_threads()
        self.gather_chunk(
            g2s, ckv_rows, kpe_rows, sparse_indices, srow_ids, sk, token, first_row, 0, 0, num_cache_rows, tidx
        )
        cute.arch.cp_async_commit_group()

        # ---- MMA partitions that do not depend on the chunk ----
        thr_mma = tiled_mma.get_slice(tidx)
        ldsm_a = cute.make_tiled_copy_A(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), cutlass.BFloat16),
            tiled_mma,
        )
        ldsm_b = cute.make_tiled_copy_B(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), cutlass.BFloat16),
            tiled_mma,
        )
        ldsm_bt = cute.make_tiled_copy_B(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), cutlass.BFloat16),
            tiled_mma,
        )
        thr_ldsm_a = ldsm_a.get_slice(tidx)
        thr_ldsm_b = ldsm_b.get_slice(tidx)
        thr_ldsm_bt = ldsm_bt.get_slice(tidx)

        tSsQ = thr_ldsm_a.partition_S(sq)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sq))
        tSrQ_view = thr_ldsm_a.retile(tSrQ)
        tSsS = thr_mma.partition_C(ss)

        tOsP = thr_ldsm_a.partition_S(sp)
        tOrP = thr_mma.make_fragment_A(thr_mma.partition_A(sp))
        tOrP_view = thr_ldsm_a.retile(tOrP)

        acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((NUM_HEADS, CKV_DIM)), cutlass.Float32)
        acc_o.fill(0.0)
        # Row (head) of every accumulator element, for the per-row rescale.
        tOcO = thr_mma.partition_C(cute.make_identity_tensor((NUM_HEADS, CKV_DIM)))

        # Softmax ownership: 8 consecutive lanes share one head row, 8 key columns each.
        softmax_row = tidx // THREADS_PER_SOFTMAX_ROW
        softmax_col0 = (tidx % THREADS_PER_SOFTMAX_ROW) * COLS_PER_SOFTMAX_THREAD
        row_max = cute.make_rmem_tensor((1,), cutlass.Float32)
        row_sum = cute.make_rmem_tensor((1,), cutlass.Float32)
        row_max[0] = -cutlass.Float32.inf
        row_sum[0] = cutlass.Float32(0.0)
        scaled = cute.make_rmem_tensor((COLS_PER_SOFTMAX_THREAD,), cutlass.Float32)

        for chunk in cutlass.range(chunks_per_split, unroll=1):
            stage = chunk % NUM_STAGES
            chunk_row = first_row + chunk * BLOCK_N
            # Prefetch the next chunk into the other stage; its readers finished at the barrier
            # that ended the previous iteration.
            if chunk + 1 < chunks_per_split:
                self.gather_chunk(
                    g2s,
                    ckv_rows,
                    kpe_rows,
                    sparse_indices,
                    srow_ids,
                    sk,
                    token,
                    chunk_row + BLOCK_N,
                    (chunk + 1) * BLOCK_N,
                    (chunk + 1) % NUM_STAGES,
                    num_cache_rows,
                    tidx,
                )
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)  # everything but the prefetch has landed
            cute.arch.sync_threads()

            # ---- S = Q K^T over the 576 dims ----
            sk_stage = sk[None, None, stage]
            tSsK = thr_ldsm_b.partition_S(sk_stage)
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sk_stage))
            tSrK_view = thr_ldsm_b.retile(tSrK)
            acc_s = cute.make_rmem_tensor(thr_mma.partition_shape_C((NUM_HEADS, BLOCK_N)), cutlass.Float32)
            acc_s.fill(0.0)
            for k in cutlass.range_constexpr(cute.size(tSsQ.shape[2])):
                cute.copy(ldsm_a, tSsQ[None, None, k], tSrQ_view[None, None, k])
                cute.copy(ldsm_b, tSsK[None, None, k], tSrK_view[None, None, k])
                cute.gemm(tiled_mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)
            cute.autovec_copy(acc_s, tSsS)
            cute.arch.sync_threads()

            # ---- online softmax (log2 domain) on row `softmax_row`, columns col0..col0+7 ----
            local_max = -cutlass.Float32.inf
            for j in cutlass.range_constexpr(COLS_PER_SOFTMAX_THREAD):
                col = softmax_col0 + j
                row_id = self.row_id(sparse_indices, srow_ids, token, chunk_row + col, chunk * BLOCK_N + col)
                valid = row_id >= 0 and row_id < num_cache_rows
                x = ss[softmax_row, col] * scale_log2
                scaled[j] = x if valid else -cutlass.Float32.inf
                local_max = cute.arch.fmax(local_max, scaled[j])
            local_max = self.row_reduce(local_max, cute.arch.fmax)
            new_max = cute.arch.fmax(row_max[0], local_max)
            # While a row has seen no valid key its max is -inf; shift by 0 so exp2 gives 0, not NaN.
            shift = cutlass.Float32(0.0) if new_max == -cutlass.Float32.inf else new_max
            local_sum = cutlass.Float32(0.0)
            for j in cutlass.range_constexpr(COLS_PER_SOFTMAX_THREAD):
                p = cute.math.exp2(scaled[j] - shift, fastmath=True)
                local_sum = local_sum + p
                sp[softmax_row, softmax_col0 + j] = p.to(cutlass.BFloat16)
            local_sum = self.row_reduce(local_sum, lambda a, b: a + b)
            alpha = cute.math.exp2(row_max[0] - shift, fastmath=True)
            row_sum[0] = row_sum[0] * alpha + local_sum
            row_max[0] = new_max
            if tidx % THREADS_PER_SOFTMAX_ROW == 0:
                salpha[softmax_row] = alpha
            cute.arch.sync_threads()

            # ---- O = alpha * O + P V ----
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[i] = acc_o[i] * salpha[tOcO[i][0]]
            # V^T[d, j] = K[j, d] for d < 512: the ckv columns of the same rows, read transposed.
            svt = cute.make_tensor(sk_stage.iterator, cute.make_layout((CKV_DIM, BLOCK_N), stride=(1, QK_ROW_STRIDE)))
            tOsVt = thr_ldsm_bt.partition_S(svt)
            tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(svt))
            tOrVt_view = thr_ldsm_bt.retile(tOrVt)
            for k in cutlass.range_constexpr(cute.size(tOsP.shape[2])):
                cute.copy(ldsm_a, tOsP[None, None, k], tOrP_view[None, None, k])
                cute.copy(ldsm_bt, tOsVt[None, None, k], tOrVt_view[None, None, k])
                cute.gemm(tiled_mma, acc_o, tOrP[None, None, k], tOrVt[None, None, k], acc_o)
            # The next iteration overwrites this stage (prefetch) and ss/sp/salpha.
            cute.arch.sync_threads()
        return acc_o, row_max, row_sum

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
        """Issue the cp.async copies of one 64-row chunk into `stage`; zero-fill padding rows.
        `chunk_row` is the chunk's first position in the token's row ids, `split_row` the same within the split.

        Consecutive threads copy consecutive 16-B pieces of one row, so each warp reads 512
        contiguous bytes of a ckv row (and whole 128-B kpe rows)."""
        sk_stage = sk[None, None, stage]
        ckv_segs = CKV_DIM // COPY_ELEMS  # 64 pieces per ckv row
        for i in cutlass.range_constexpr(BLOCK_N * ckv_segs // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            row = linear // ckv_segs
            seg = linear % ckv_segs
            row_id = self.row_id(sparse_indices, srow_ids, token, chunk_row + row, split_row + row)
            dst = cute.local_tile(sk_stage[row, None], (COPY_ELEMS,), (seg,))
            if row_id >= 0 and row_id < num_cache_rows:
                cute.copy(g2s, cute.local_tile(ckv_rows[row_id, None], (COPY_ELEMS,), (seg,)), dst)
            else:
                dst.fill(0.0)
        kpe_segs = KPE_DIM // COPY_ELEMS  # 8 pieces per kpe row
        for i in cutlass.range_constexpr(BLOCK_N * kpe_segs // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            row = linear // kpe_segs
            seg = linear % kpe_segs
            row_id = self.row_id(sparse_indices, srow_ids, token, chunk_row + row, split_row + row)
            dst = cute.local_tile(sk_stage[row, None], (COPY_ELEMS,), (ckv_segs + seg,))
            if row_id >= 0 and row_id < num_cache_rows:
                cute.copy(g2s, cute.local_tile(kpe_rows[row_id, None], (COPY_ELEMS,), (seg,)), dst)
            else:
                dst.fill(0.0)

    @cute.jit
    def row_id(
        self, sparse_indices: cute.Tensor, srow_ids, token: cutlass.Int32, row: cutlass.Int32, split_row: cutlass.Int32
    ) -> cutlass.Int32:
        """The cache row id at position `row` of the token's list (`split_row` within the split)."""
        if cutlass.const_expr(self.staged_indices):
            return srow_ids[split_row]
        else:
            return sparse_indices[token, row]

    @cute.jit
    def row_reduce(self, value: cutlass.Float32, op: cutlass.Constexpr) -> cutlass.Float32:
        """Reduce over the 8 consecutive lanes that share a softmax row (all 8 get the result)."""
        offset = THREADS_PER_SOFTMAX_ROW // 2
        while offset > 0:
            value = op(value, cute.arch.shuffle_sync_bfly(value, offset=offset))
            offset //= 2
        return value


class _CombineKernel:
    """Merges the splits of one (token, head, quarter of the 512 columns) by log-sum-exp; one thread
    per output column.

    Latency, not bandwidth, decides this kernel (it reads 8 KB per CTA), so no load may wait for
    another: lane s of every warp reads split s's max and sum at once (num_splits <= 32), warp
    shuffles reduce them, and the loop over the splits' O columns is unrolled over the largest split
    count with branch-free loads, so that all 32 are in flight together: a split index past the
    actual count reads the last split again (an address that is always valid) and weighs 0, since
    its lane's weight is exp2(-inf) = 0. The sum runs over the splits in order, so the extra terms
    add +0. (Walking the splits with dependent scalar loads, or one CTA per (token, head) with the
    loop unrolled by 8 over the dynamic count, leaves several round trips on the call's tail;
    NOTES.md.)
    """

    @cute.jit
    def launch(self, workspace: cute.Tensor, output: cute.Tensor, lse: cute.Tensor, stream):
        self.kernel(workspace, output, lse).launch(
            grid=[output.shape[0], NUM_HEADS, COMBINE_COLUMN_GROUPS],
            block=[NUM_THREADS, 1, 1],
            stream=stream,
            use_pdl=True,  # a programmatic dependent of the split kernel
        )

    @cute.jit
    def warp_allreduce(self, value: cutlass.Float32, op: cutlass.Constexpr) -> cutlass.Float32:
        offset = cute.arch.WARP_SIZE // 2
        while offset > 0:
            value = op(value, cute.arch.shuffle_sync_bfly(value, offset=offset))
            offset //= 2
        return value

    @cute.jit
    def split_weights(
        self,
        workspace: cute.Tensor,
        token: cutlass.Int32,
        head: cutlass.Int32,
        num_splits: cutlass.Int32,
        lane: cutlass.Int32,
    ):
        """(max over the splits, this lane's split weight, the weighted sum total): lane s of every
        warp reads split s's max and sum; weights are 0 on lanes past num_splits."""
        split_stats = cute.make_rmem_tensor((2,), cutlass.Float32)  # this lane's split: max, sum
        split_stats[0] = -cutlass.Float32.inf
        split_stats[1] = cutlass.Float32(0.0)
        if lane < num_splits:
            split_stats[0] = workspace[token, lane, head, WS_MAX_COL]
            split_stats[1] = workspace[token, lane, head, WS_SUM_COL]
        global_max = self.warp_allreduce(split_stats[0], cute.arch.fmax)
        # A token without any valid row has max -inf: shift by 0 so every weight is exp2(-inf) = 0.
        shift = cutlass.Float32(0.0) if global_max == -cutlass.Float32.inf else global_max
        weight = cute.math.exp2(split_stats[0] - shift, fastmath=True)  # 0 on lanes past num_splits
        total = self.warp_allreduce(weight * split_stats[1], lambda a, b: a + b)
        return global_max, weight, total

    @cute.kernel
    def kernel(self, workspace: cute.Tensor, output: cute.Tensor, lse: cute.Tensor):
        cute.arch.griddepcontrol_wait()  # the split kernel's workspace, complete and visible
        tidx, _, _ = cute.arch.thread_idx()
        token, head, group = cute.arch.block_idx()
        num_splits = workspace.shape[1]
        lane = cute.arch.lane_idx()
        col = group * NUM_THREADS + tidx

        # All 32 partial values first, so that they share one round trip with the statistics
        # (issued in waves around the statistics' shuffles they would cost ~0.5 us more, NOTES.md).
        partials = cute.make_rmem_tensor((MAX_SPLITS,), cutlass.Float32)
        for s in cutlass.range_constexpr(MAX_SPLITS):
            partials[s] = workspace[token, cutlass.min(s, num_splits - 1), head, col]

        global_max, weight, total = self.split_weights(workspace, token, head, num_splits, lane)

        acc = cutlass.Float32(0.0)
        for s in cutlass.range_constexpr(MAX_SPLITS):
            acc = acc + cute.arch.shuffle_sync(weight, s) * partials[s]

        # total >= 1 whenever some row was valid (the max element contributes exp2(0) = 1).
        inv_total = cutlass.Float32(0.0) if total == cutlass.Float32(0.0) else cutlass.Float32(1.0) / total
        output[token, head, col] = (acc * inv_total).to(cutlass.BFloat16)
        if group == 0 and tidx == 0:
            # -inf + log2(0) = -inf for a token without valid rows.
            lse[token, head] = global_max + cute.math.log2(total)


@cute.jit
def cache_rows(ckv_cache: cute.Tensor, kpe_cache: cute.Tensor):
    """Flat row views of the paged caches: row id = page * 64 + offset (static row strides keep
    every 16-B piece provably aligned for cp.async)."""
    num_cache_rows = ckv_cache.shape[0] * PAGE_SIZE
    ckv_rows = cute.make_tensor(ckv_cache.iterator, cute.make_layout((num_cache_rows, CKV_DIM), stride=(CKV_DIM, 1)))
    kpe_rows = cute.make_tensor(kpe_cache.iterator, cute.make_layout((num_cache_rows, KPE_DIM), stride=(KPE_DIM, 1)))
    return ckv_rows, kpe_rows


class DsaSparseAttentionSm90:
    """Host entry of the two kernels; one compile per form of the split kernel serves every T, P and
    split count. `split` and `combine` are the kernels' classes: this file's, or a candidate's
    subclasses of them."""

    def __init__(self, staged_indices: bool, split: type = _SplitKernel, combine: type = _CombineKernel) -> None:
        self.staged_indices = staged_indices
        self.split = split
        self.combine = combine

    @cute.jit
    def __call__(
        self,
        q_nope: cute.Tensor,
        q_pe: cute.Tensor,
        ckv_cache: cute.Tensor,
        kpe_cache: cute.Tensor,
        sparse_indices: cute.Tensor,
        sm_scale: cutlass.Float32,
        output: cute.Tensor,
        lse: cute.Tensor,
        workspace: cute.Tensor,
        stream,
    ):
        ckv_rows, kpe_rows = cache_rows(ckv_cache, kpe_cache)
        scale_log2 = sm_scale * LOG2_E
        self.split(self.staged_indices).launch(
            q_nope, q_pe, ckv_rows, kpe_rows, sparse_indices, scale_log2, workspace, stream
        )
        self.combine().launch(workspace, output, lse, stream)


# ------------------------------------------------------------------------------------------------
# Host side: compile once per architecture, then each call is one TVM-FFI launch.
# ------------------------------------------------------------------------------------------------

_COMPILED: dict[tuple[str, bool, type, type], Callable] = {}


def fake_arguments() -> tuple:
    """Compile-time stand-ins of the launcher's arguments, in `DsaSparseAttentionSm90`'s order: T, P and the
    split count symbolic."""
    num_tokens = cute.sym_int()
    num_pages = cute.sym_int()
    num_splits = cute.sym_int()

    def rowmajor(dtype, shape):
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=16)

    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    return (
        rowmajor(bf16, (num_tokens, NUM_HEADS, CKV_DIM)),
        rowmajor(bf16, (num_tokens, NUM_HEADS, KPE_DIM)),
        rowmajor(bf16, (num_pages, PAGE_SIZE, CKV_DIM)),
        rowmajor(bf16, (num_pages, PAGE_SIZE, KPE_DIM)),
        rowmajor(cutlass.Int32, (num_tokens, TOPK)),
        1.0,
        rowmajor(bf16, (num_tokens, NUM_HEADS, CKV_DIM)),
        rowmajor(f32, (num_tokens, NUM_HEADS)),
        rowmajor(f32, (num_tokens, num_splits, NUM_HEADS, WS_COLS)),
        make_fake_stream(use_tvm_ffi_env_stream=True),
    )


def _compile(arch: str, staged_indices: bool, split: type, combine: type) -> Callable:
    return cute.compile(
        DsaSparseAttentionSm90(staged_indices, split, combine),
        *fake_arguments(),
        options=f"--enable-tvm-ffi --gpu-arch {arch}",
    )


def compiled_for(
    arch: str = GPU_ARCH, staged_indices: bool = False, combine: type = _CombineKernel, split: type = _SplitKernel
) -> Callable:
    """The compiled launcher for `arch`, this form of the split kernel and these kernel classes
    (compiled on first use; needs no GPU)."""
    key = (arch, staged_indices, split, combine)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = _compile(arch, staged_indices, split, combine)
    return fn


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, Callable]:
    """Compile both forms of the launcher for `arch` without touching a GPU (for CI and warm-up)."""
    return tuple(compiled_for(arch, staged) for staged in (False, True))


def stages_indices(num_splits: int) -> bool:
    """Whether the split kernel stages its row ids: where a split has two or more chunks."""
    return NUM_CHUNKS // num_splits >= 2


def num_splits_for(num_tokens: int) -> int:
    """Splits of the 2048 rows per token: the most (a power of two, at most 32) that keep all
    T * splits CTAs in one wave of the one-CTA-per-SM split kernel; 1 once T alone fills it."""
    splits = NUM_CHUNKS
    while splits > 1 and num_tokens * splits > MAX_CTAS_PER_WAVE:
        splits //= 2
    return splits


def _check_inputs(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, output, lse) -> None:
    # One cheap combined test on the hot path; the detailed message only when it fails.
    num_tokens = q_nope.shape[0]
    num_pages = ckv_cache.shape[0]
    expected = (
        ("q_nope", q_nope, (num_tokens, NUM_HEADS, CKV_DIM), torch.bfloat16),
        ("q_pe", q_pe, (num_tokens, NUM_HEADS, KPE_DIM), torch.bfloat16),
        ("ckv_cache", ckv_cache, (num_pages, PAGE_SIZE, CKV_DIM), torch.bfloat16),
        ("kpe_cache", kpe_cache, (num_pages, PAGE_SIZE, KPE_DIM), torch.bfloat16),
        ("sparse_indices", sparse_indices, (num_tokens, TOPK), torch.int32),
        ("output", output, (num_tokens, NUM_HEADS, CKV_DIM), torch.bfloat16),
        ("lse", lse, (num_tokens, NUM_HEADS), torch.float32),
    )
    if all(t.shape == shape and t.dtype == dtype and t.is_contiguous() for _, t, shape, dtype in expected):
        if num_pages * PAGE_SIZE * CKV_DIM >= MAX_CACHE_ELEMENTS:
            raise DsaShapeError(
                f"ckv_cache has {num_pages} pages; the kernel addresses fewer than {MAX_CACHE_ELEMENTS} elements"
            )
        return
    for name, tensor, shape, dtype in expected:
        if tensor.shape != shape or tensor.dtype != dtype or not tensor.is_contiguous():
            raise DsaShapeError(
                f"{name} must be a contiguous {dtype} tensor of shape {shape}, "
                f"got {tensor.dtype} {tuple(tensor.shape)} (contiguous={tensor.is_contiguous()})"
            )


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """Destination-passing entry: fills `output` [T,16,512] bf16 and `lse` [T,16] fp32 (base 2)."""
    run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None)


def run_with_splits(
    q_nope,
    q_pe,
    ckv_cache,
    kpe_cache,
    sparse_indices,
    sm_scale,
    output,
    lse,
    num_splits,
    combine: type = _CombineKernel,
    split: type = _SplitKernel,
) -> None:
    """`run` with an explicit split count (a power of two dividing 32); None picks `num_splits_for(T)`.
    For tuning sweeps and candidates (`split`, `combine`: subclasses of the kernels); `run` is the
    entry the benchmark uses."""
    _check_inputs(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, output, lse)
    num_tokens = q_nope.shape[0]
    if num_tokens == 0:
        return
    if num_splits is None:
        num_splits = num_splits_for(num_tokens)
    elif num_splits not in VALID_SPLITS:
        raise DsaShapeError(f"num_splits must be one of {VALID_SPLITS}, got {num_splits}")
    workspace = torch.empty((num_tokens, num_splits, NUM_HEADS, WS_COLS), dtype=torch.float32, device=q_nope.device)
    compiled_for(GPU_ARCH, stages_indices(num_splits), combine, split)(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, float(sm_scale), output, lse, workspace
    )
