"""DSA sparse attention, candidate v2: kernel.py's split kernel with the combine fused into it.

Same algorithm as kernel.py (read its docstring first) in ONE kernel, grid (T, num_splits):

1. Every CTA computes the partial attention of one token over 2048 / num_splits of its rows
   with kernel.py's `_SplitKernel.attend` (inherited, not copied).
2. With one split the CTA normalises its accumulator and writes `output` and `lse` directly.
3. Otherwise it writes its partial (unnormalised O in fp32, then m and l per head) to a workspace
   row, and one thread takes a ticket from a per-token arrival counter. The CTA whose ticket is
   num_splits - 1 arrived last: every split's partial is complete and visible to it (ordering
   argument below). It resets the counter to 0, merges all the token's partials in split order
   by log-sum-exp (the semantics of kernel.py's `_CombineKernel`: a token without any valid row
   gets output 0 and lse -inf), and writes `output` and `lse`. The other CTAs exit. Nobody waits
   for anybody: no co-residency is assumed, so any T * num_splits is correct. The merge re-reads
   the last CTA's own partial instead of using its registers, so that the result does not depend
   on which CTA arrived last (bitwise-repeatable calls; see `merge_splits`).

Partial record of one (token, split), fp32, PARTIAL_FLOATS = 8224 values: thread t's 64
accumulator values in "fragment order", as 16 float4 at [k * 512 + 4 t, +4) for k = 0..15 (so a
warp stores and loads 512 contiguous bytes per instruction, and thread t of the merging CTA folds
exactly the (head, column) positions its own accumulator holds), then m[16] at 8192 and l[16] at
8208 (log2 domain).

Memory ordering of the last-CTA pattern (PTX memory model; names are PTX):
- Writer: every thread stores its part of the partial (weak st.global), then executes
  `fence.acq_rel.gpu`, then `bar.sync`; thread 0 then does an acq_rel atomic add at gpu scope on
  the token's counter (`cute.arch.atomic_add(sem="acq_rel", scope="gpu")`; LLVM prints it as
  `atom.global.acq_rel.add.u32`, where the omitted scope means .gpu; SASS: MEMBAR.ALL.GPU,
  ATOMG.E.ADD.STRONG.GPU, CCTL.IVALL). Each thread's fence orders its own stores before the
  barrier, the barrier orders the whole CTA before thread 0's atomic, and the atomic is a release
  at gpu scope: the partial happens-before the increment. (Thread 0's fence + atomic after
  `bar.sync` alone is what cooperative groups' grid sync relies on; the per-thread fence is the
  conservative form and costs one store round trip that thread 0's fence would wait for anyway.)
- Reader: the atomics on one counter form a single modification order; the last CTA's atomic
  reads the value written by the previous increment, which read the one before, and so on, so
  it observes (in PTX's observation order, which extends through atomic read-modify-writes)
  every other CTA's release, and as an acquire it synchronises with all of them. Thread 0 adds a
  `fence.acq_rel.gpu`, publishes the verdict in shared memory and `bar.sync`s: every thread's
  subsequent reads are ordered after the acquire.
- The reads are `cp.async.cg` (cache at L2 only, bypassing L1: LDGSTS.E.BYPASS), so no stale L1
  line can serve them; L2 is the point of coherence for the GPU.
- The reset (`counter = 0`, by the last CTA, after its atomic on the same address) cannot race:
  all num_splits increments of this launch have happened. The next launch on the stream starts
  after this one completes, so it sees 0; a CUDA-graph replay is such a launch.

Arrival counters: an int32 buffer cached per (device, stream), zeroed once when created (or
grown), kept at zero by the kernel itself. A fresh `torch.zeros` per call would add a memset to
every call's CUPTI span (it counts every GPU activity of the call), which is what fusing the
combine is meant to remove. Keying by stream keeps two streams' concurrent calls from sharing
counters; inside a CUDA-graph capture the buffer is allocated in the capture, so the graph zeroes
it on every replay and never shares the eager buffer of a stream (a replay may run concurrently
with eager calls on another stream).

Shared memory: kernel.py's storage plus 144 B (175,056 B, 1 CTA per SM); the merge reuses the K
stages (149.5 KB) as MERGE_SLOTS = 4 partial slots of 32.9 KB, filled by `cp.async` three ahead.
Registers: 167 per thread, no spills (ptxas 13.0, sm_90a).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream


def _load_sibling(file_name: str, module_name: str) -> ModuleType:
    """kernels/ is not a package (the harness packs this folder as a solution), so the v1 kernel
    is loaded by path; an already loaded copy of the same file is reused."""
    path = Path(__file__).resolve().with_name(file_name)
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() == path:
            return loaded
        module_name = f"{module_name}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
        if module_name in sys.modules:
            return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # the CuTe DSL looks a class's module up by name
    spec.loader.exec_module(module)
    return module


_v1 = _load_sibling("kernel.py", "dsa_attention_kernel")

NUM_HEADS = _v1.NUM_HEADS
CKV_DIM = _v1.CKV_DIM
KPE_DIM = _v1.KPE_DIM
QK_DIM = _v1.QK_DIM
PAGE_SIZE = _v1.PAGE_SIZE
TOPK = _v1.TOPK
BLOCK_N = _v1.BLOCK_N
NUM_CHUNKS = _v1.NUM_CHUNKS
NUM_THREADS = _v1.NUM_THREADS
NUM_STAGES = _v1.NUM_STAGES
QK_ROW_STRIDE = _v1.QK_ROW_STRIDE
P_ROW_STRIDE = _v1.P_ROW_STRIDE
S_ROW_STRIDE = _v1.S_ROW_STRIDE
COPY_ELEMS = _v1.COPY_ELEMS
THREADS_PER_SOFTMAX_ROW = _v1.THREADS_PER_SOFTMAX_ROW
COLS_PER_SOFTMAX_THREAD = _v1.COLS_PER_SOFTMAX_THREAD
VALID_SPLITS = _v1.VALID_SPLITS
MAX_CTAS_PER_WAVE = _v1.MAX_CTAS_PER_WAVE
LOG2_E = _v1.LOG2_E
GPU_ARCH = _v1.GPU_ARCH
DsaShapeError = _v1.DsaShapeError

# Partial record (see the module docstring).
VEC = 4  # fp32 values per 16-B access
FRAG_VALUES = NUM_HEADS * CKV_DIM // NUM_THREADS  # 64 accumulator values per thread
FRAG_VECTORS = FRAG_VALUES // VEC  # 16
PARTIAL_O = NUM_HEADS * CKV_DIM  # 8192
PARTIAL_MAX = PARTIAL_O
PARTIAL_SUM = PARTIAL_O + NUM_HEADS
PARTIAL_FLOATS = PARTIAL_O + 2 * NUM_HEADS  # 8224 floats = 32,896 B, a multiple of 16
PARTIAL_VECTORS = PARTIAL_FLOATS // VEC  # 2056 16-B pieces
MERGE_SLOTS = 4
# Rounds of 128 threads x 16 B that load one partial record (the last round: 8 pieces).
LOAD_ROUNDS = (PARTIAL_VECTORS + NUM_THREADS - 1) // NUM_THREADS
# Rows of the accumulator a thread holds: an m16n8 accumulator gives lane l rows l/4 and l/4 + 8.
HI_ROW_OFFSET = NUM_HEADS // 2
# The last CTA of a token moves 2.36 MB / splits of gathered rows and then splits x 32.9 KB of
# partials through its one SM: 8 splits 295 + 263 KB, 16 splits 147 + 526 KB, 32 splits 74 +
# 1053 KB. The gather runs at a lower per-SM rate than L2 reads (~26 GB/s measured for v0's
# pipeline), which favours 16 over 8; 32 would read ~1 MB on one SM. A guess for the sweep to settle.
MAX_FUSED_SPLITS = 16
# The workspace is addressed with 32-bit element offsets.
MAX_WORKSPACE_ELEMENTS = 2**31
MIN_COUNTER_CAPACITY = 256

assert PARTIAL_FLOATS % VEC == 0 and FRAG_VALUES % VEC == 0
assert MERGE_SLOTS * PARTIAL_FLOATS * 4 <= NUM_STAGES * BLOCK_N * QK_ROW_STRIDE * 2, "merge slots overflow the K stages"
assert MAX_FUSED_SPLITS in VALID_SPLITS


# Layouts of the partial record and of the per-CTA statistics. Module-level (called while a kernel
# is traced) so that the CPU tests evaluate exactly the index maps the kernel uses.


def partial_fragment_layout() -> cute.Layout:
    """(value in vector, thread, vector) -> float offset in a partial record: thread t's vector k
    (its accumulator values 4k..4k+3) at k * 512 + 4 t, so that a warp moves 512 contiguous bytes."""
    return cute.make_layout((VEC, NUM_THREADS, FRAG_VECTORS), stride=(1, VEC, VEC * NUM_THREADS))


def register_fragment_layout() -> cute.Layout:
    """(value in vector, vector) -> register offset of a thread's accumulator (compact column-major
    over its ((2,2),1,16) shape, so register offset = linear value index = 4k + value)."""
    return cute.make_layout((VEC, FRAG_VECTORS), stride=(1, VEC))


def merge_slots_layout() -> cute.Layout:
    """(float of a partial record, slot) -> float offset in the K stages reused by the merge."""
    return cute.make_layout((PARTIAL_FLOATS, MERGE_SLOTS), stride=(1, PARTIAL_FLOATS))


def stats_layout() -> cute.Layout:
    """(head, 0 = max | 1 = sum) -> float offset in shared memory."""
    return cute.make_layout((NUM_HEADS, 2), stride=(1, NUM_HEADS))


class _FusedSplitKernel(_v1._SplitKernel):
    """kernel.py's split kernel (its gather_chunk and row_reduce are inherited) with the fused
    last-CTA merge as its epilogue."""

    @cute.jit
    def launch(
        self,
        q_nope: cute.Tensor,
        q_pe: cute.Tensor,
        ckv_rows: cute.Tensor,
        kpe_rows: cute.Tensor,
        sparse_indices: cute.Tensor,
        scale_log2: cutlass.Float32,
        partials: cute.Tensor,
        counters: cute.Tensor,
        num_splits: cutlass.Int32,
        output: cute.Tensor,
        lse: cute.Tensor,
        stream,
    ):
        tiled_mma = _v1._make_tiled_mma()
        sq_layout = cute.make_layout((NUM_HEADS, QK_DIM), stride=(QK_ROW_STRIDE, 1))
        sk_layout = cute.make_layout((BLOCK_N, QK_DIM, NUM_STAGES), stride=(QK_ROW_STRIDE, 1, BLOCK_N * QK_ROW_STRIDE))
        ss_layout = cute.make_layout((NUM_HEADS, BLOCK_N), stride=(S_ROW_STRIDE, 1))
        sp_layout = cute.make_layout((NUM_HEADS, BLOCK_N), stride=(P_ROW_STRIDE, 1))

        @cute.struct
        class SharedStorage:
            sq: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, NUM_HEADS * QK_ROW_STRIDE], 128]
            sk: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, NUM_STAGES * BLOCK_N * QK_ROW_STRIDE], 128]
            ss: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, NUM_HEADS * S_ROW_STRIDE], 128]
            sp: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, NUM_HEADS * P_ROW_STRIDE], 128]
            salpha: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, NUM_HEADS], 16]
            # This CTA's m and l per head, handed from the softmax layout to the accumulator layout.
            sstats: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 2 * NUM_HEADS], 16]
            # 1 when this CTA writes the token's output (the last to arrive, or the only split).
            sflag: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 4], 16]

        self.kernel(
            q_nope,
            q_pe,
            ckv_rows,
            kpe_rows,
            sparse_indices,
            scale_log2,
            partials,
            counters,
            num_splits,
            output,
            lse,
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
        partials: cute.Tensor,
        counters: cute.Tensor,
        num_splits: cutlass.Int32,
        output: cute.Tensor,
        lse: cute.Tensor,
        tiled_mma: cute.TiledMma,
        sq_layout: cute.Layout,
        sk_layout: cute.Layout,
        ss_layout: cute.Layout,
        sp_layout: cute.Layout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        token, split, _ = cute.arch.block_idx()

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sq = storage.sq.get_tensor(sq_layout)
        sk = storage.sk.get_tensor(sk_layout)
        ss = storage.ss.get_tensor(ss_layout)
        sp = storage.sp.get_tensor(sp_layout)
        salpha = storage.salpha.get_tensor(cute.make_layout(NUM_HEADS))
        sstats = storage.sstats.get_tensor(stats_layout())
        sflag = storage.sflag.get_tensor(cute.make_layout(4))

        acc_o, row_max, row_sum = self.attend(
            q_nope,
            q_pe,
            ckv_rows,
            kpe_rows,
            sparse_indices,
            scale_log2,
            num_splits,
            tiled_mma,
            sq,
            sk,
            ss,
            sp,
            salpha,
            token,
            split,
            tidx,
        )

        thr_mma = tiled_mma.get_slice(tidx)
        tOcO = thr_mma.partition_C(cute.make_identity_tensor((NUM_HEADS, CKV_DIM)))
        row_lo = tOcO[0][0]
        row_hi = row_lo + HI_ROW_OFFSET
        softmax_row = tidx // THREADS_PER_SOFTMAX_ROW
        if tidx % THREADS_PER_SOFTMAX_ROW == 0:
            sstats[softmax_row, 0] = row_max[0]
            sstats[softmax_row, 1] = row_sum[0]

        if num_splits > 1:
            record = partials[token * num_splits + split, None]
            cute.autovec_copy(self.registers_in_fragment_order(acc_o), self.fragment_view(record, tidx))
            if tidx % THREADS_PER_SOFTMAX_ROW == 0:
                record[PARTIAL_MAX + softmax_row] = row_max[0]
                record[PARTIAL_SUM + softmax_row] = row_sum[0]
            # Release: see the module docstring.
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            if tidx == 0:
                arrived = cute.arch.atomic_add(counters.iterator + token, cutlass.Int32(1), sem="acq_rel", scope="gpu")
                if arrived == num_splits - 1:
                    cute.arch.fence_acq_rel_gpu()
                    counters[token] = cutlass.Int32(0)  # every split of this launch has arrived
                    sflag[0] = cutlass.Int32(1)
                else:
                    sflag[0] = cutlass.Int32(0)
        else:
            if tidx == 0:
                sflag[0] = cutlass.Int32(1)
        cute.arch.sync_threads()  # sstats and sflag

        if sflag[0] != 0:
            # [M_lo, M_hi, L_lo, L_hi]: max and sum of this thread's two heads.
            merged = cute.make_rmem_tensor((4,), cutlass.Float32)
            if num_splits > 1:
                self.merge_splits(partials, acc_o, merged, tOcO, row_lo, row_hi, storage, token, num_splits, tidx)
            else:
                merged[0] = sstats[row_lo, 0]
                merged[1] = sstats[row_hi, 0]
                merged[2] = sstats[row_lo, 1]
                merged[3] = sstats[row_hi, 1]
            self.write_output(output, lse, acc_o, merged, thr_mma, tOcO, row_lo, row_hi, token)

    @cute.jit
    def fragment_view(self, record: cute.Tensor, tidx: cutlass.Int32) -> cute.Tensor:
        """Thread `tidx`'s values of a partial record (global or shared) in fragment order:
        accumulator element i (column-major over its ((2,2),1,16) shape) at 4 tidx + (i % 4) +
        (i / 4) * 512, as a (4, 16) tensor whose 16-B alignment the compiler can see."""
        return cute.make_tensor(record.iterator, partial_fragment_layout())[None, tidx, None]

    @cute.jit
    def registers_in_fragment_order(self, fragment: cute.Tensor) -> cute.Tensor:
        """The same (4, 16) shape over a thread's accumulator registers (stored column-major)."""
        return cute.make_tensor(fragment.iterator, register_fragment_layout())

    @cute.jit
    def merge_splits(
        self,
        partials: cute.Tensor,
        acc_o: cute.Tensor,
        merged: cute.Tensor,
        tOcO: cute.Tensor,
        row_lo: cutlass.Int32,
        row_hi: cutlass.Int32,
        storage,
        token: cutlass.Int32,
        num_splits: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        """Fold the partials of all num_splits splits of this token, in split order, into acc_o
        (overwritten) and `merged`.

        This CTA's own partial is read back too (from L2, where it just went) rather than taken
        from its registers: then the order of the floating-point operations does not depend on
        which CTA happened to arrive last, and repeated calls are bitwise identical. It costs
        1/num_splits of the merge's reads. The partials stream through MERGE_SLOTS shared-memory
        slots (the K stages, free after the main loop, whose last cp.async group was empty) by
        `cp.async.cg`, MERGE_SLOTS - 1 ahead, so about 100 KB is in flight while one slot is
        folded in."""
        slots = storage.sk.get_tensor(merge_slots_layout(), dtype=cutlass.Float32)
        g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Float32, num_bits_per_copy=128
        )
        for ahead in cutlass.range_constexpr(MERGE_SLOTS - 1):
            if ahead < num_splits:
                self.load_partial(g2s, partials, slots, token * num_splits + ahead, ahead, tidx)
            cute.arch.cp_async_commit_group()

        acc_o.fill(0.0)
        merged[0] = -cutlass.Float32.inf
        merged[1] = -cutlass.Float32.inf
        merged[2] = cutlass.Float32(0.0)
        merged[3] = cutlass.Float32(0.0)
        incoming = cute.make_rmem_tensor((VEC, FRAG_VECTORS), cutlass.Float32)
        for s in cutlass.range(num_splits, unroll=1):
            ahead = s + MERGE_SLOTS - 1
            if ahead < num_splits:
                self.load_partial(g2s, partials, slots, token * num_splits + ahead, ahead % MERGE_SLOTS, tidx)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(MERGE_SLOTS - 1)  # partial s has landed (this thread's part)
            cute.arch.sync_threads()  # ... and every thread's part

            slot = slots[None, s % MERGE_SLOTS]
            # Per head: the new max, then the weights of the running state and of split s. A head
            # that has seen no valid row yet keeps max -inf: shift by 0 so that both weights are
            # exp2(-inf) = 0 rather than NaN (its O values are all 0).
            m_lo = slot[PARTIAL_MAX + row_lo]
            m_hi = slot[PARTIAL_MAX + row_hi]
            new_lo = cute.arch.fmax(merged[0], m_lo)
            new_hi = cute.arch.fmax(merged[1], m_hi)
            shift_lo = cutlass.Float32(0.0) if new_lo == -cutlass.Float32.inf else new_lo
            shift_hi = cutlass.Float32(0.0) if new_hi == -cutlass.Float32.inf else new_hi
            keep_lo = cute.math.exp2(merged[0] - shift_lo, fastmath=True)
            keep_hi = cute.math.exp2(merged[1] - shift_hi, fastmath=True)
            take_lo = cute.math.exp2(m_lo - shift_lo, fastmath=True)
            take_hi = cute.math.exp2(m_hi - shift_hi, fastmath=True)
            merged[2] = merged[2] * keep_lo + slot[PARTIAL_SUM + row_lo] * take_lo
            merged[3] = merged[3] * keep_hi + slot[PARTIAL_SUM + row_hi] * take_hi
            merged[0] = new_lo
            merged[1] = new_hi

            cute.autovec_copy(self.fragment_view(slot, tidx), incoming)
            for v in cutlass.range_constexpr(FRAG_VALUES):
                lo = tOcO[v][0] == row_lo
                acc_o[v] = acc_o[v] * (keep_lo if lo else keep_hi) + incoming[v % VEC, v // VEC] * (
                    take_lo if lo else take_hi
                )
            cute.arch.sync_threads()  # slot s % MERGE_SLOTS is refilled in the next iteration

    @cute.jit
    def load_partial(
        self,
        g2s: cute.CopyAtom,
        partials: cute.Tensor,
        slots: cute.Tensor,
        record_index: cutlass.Int32,
        slot: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        """cp.async one partial record (2056 pieces of 16 B) into `slot`."""
        record = partials[record_index, None]
        destination = slots[None, slot]
        for k in cutlass.range_constexpr(LOAD_ROUNDS):
            piece = k * NUM_THREADS + tidx
            source = cute.local_tile(record, (VEC,), (piece,))
            target = cute.local_tile(destination, (VEC,), (piece,))
            if cutlass.const_expr((k + 1) * NUM_THREADS <= PARTIAL_VECTORS):
                cute.copy(g2s, source, target)
            elif piece < PARTIAL_VECTORS:  # the last round covers the 8 pieces past 16 x 128
                cute.copy(g2s, source, target)

    @cute.jit
    def write_output(
        self,
        output: cute.Tensor,
        lse: cute.Tensor,
        acc_o: cute.Tensor,
        merged: cute.Tensor,
        thr_mma,
        tOcO: cute.Tensor,
        row_lo: cutlass.Int32,
        row_hi: cutlass.Int32,
        token: cutlass.Int32,
    ):
        """Normalise and store this thread's part of output[token] (bf16) and lse[token] (base 2)."""
        # The sum is >= 1 whenever a row was valid (its max element contributes exp2(0) = 1).
        inv_lo = cutlass.Float32(0.0) if merged[2] == cutlass.Float32(0.0) else cutlass.Float32(1.0) / merged[2]
        inv_hi = cutlass.Float32(0.0) if merged[3] == cutlass.Float32(0.0) else cutlass.Float32(1.0) / merged[3]
        result = cute.make_rmem_tensor(acc_o.shape, cutlass.BFloat16)
        for v in cutlass.range_constexpr(FRAG_VALUES):
            result[v] = (acc_o[v] * (inv_lo if tOcO[v][0] == row_lo else inv_hi)).to(cutlass.BFloat16)
        tOgOut = thr_mma.partition_C(cute.local_tile(output[token, None, None], (NUM_HEADS, CKV_DIM), (0, 0)))
        cute.autovec_copy(result, tOgOut)
        # The threads that hold column 0 cover every head once (rows r and r + 8 of lanes 4k).
        if tOcO[0][1] == 0:
            # -inf + log2(0) = -inf for a head without any valid row.
            lse[token, row_lo] = merged[0] + cute.math.log2(merged[2])
            lse[token, row_hi] = merged[1] + cute.math.log2(merged[3])


class DsaSparseAttentionFusedSm90:
    """Host entry of the fused kernel; one compile serves every T, P and split count."""

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
        partials: cute.Tensor,
        counters: cute.Tensor,
        num_splits: cutlass.Int32,
        stream,
    ):
        ckv_rows, kpe_rows = _v1.cache_rows(ckv_cache, kpe_cache)
        _FusedSplitKernel().launch(
            q_nope,
            q_pe,
            ckv_rows,
            kpe_rows,
            sparse_indices,
            sm_scale * LOG2_E,
            partials,
            counters,
            num_splits,
            output,
            lse,
            stream,
        )


# ------------------------------------------------------------------------------------------------
# Host side: compile once per architecture, then each call is one TVM-FFI launch.
# ------------------------------------------------------------------------------------------------

_COMPILED: dict[str, Callable] = {}
_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def _compile(arch: str) -> Callable:
    num_tokens = cute.sym_int()
    num_pages = cute.sym_int()
    num_records = cute.sym_int()
    num_counters = cute.sym_int()

    def rowmajor(dtype, shape):
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=16)

    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    args = (
        rowmajor(bf16, (num_tokens, NUM_HEADS, CKV_DIM)),
        rowmajor(bf16, (num_tokens, NUM_HEADS, KPE_DIM)),
        rowmajor(bf16, (num_pages, PAGE_SIZE, CKV_DIM)),
        rowmajor(bf16, (num_pages, PAGE_SIZE, KPE_DIM)),
        rowmajor(cutlass.Int32, (num_tokens, TOPK)),
        1.0,
        rowmajor(bf16, (num_tokens, NUM_HEADS, CKV_DIM)),
        rowmajor(f32, (num_tokens, NUM_HEADS)),
        rowmajor(f32, (num_records, PARTIAL_FLOATS)),
        rowmajor(cutlass.Int32, (num_counters,)),
        cutlass.Int32(1),
        make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    return cute.compile(DsaSparseAttentionFusedSm90(), *args, options=f"--enable-tvm-ffi --gpu-arch {arch}")


def compiled_for(arch: str = GPU_ARCH) -> Callable:
    """The compiled launcher for `arch` (compiled on first use; needs no GPU)."""
    fn = _COMPILED.get(arch)
    if fn is None:
        fn = _COMPILED[arch] = _compile(arch)
    return fn


def compile_only(arch: str = GPU_ARCH) -> Callable:
    """Compile the fused kernel for `arch` without touching a GPU (for CI and warm-up)."""
    return compiled_for(arch)


def num_splits_for(num_tokens: int) -> int:
    """kernel.py's choice (the most splits that keep T * splits CTAs in one wave), capped at
    MAX_FUSED_SPLITS because the merging CTA reads every other split's partial."""
    return min(_v1.num_splits_for(num_tokens), MAX_FUSED_SPLITS)


def _arrival_counters(device: torch.device, num_tokens: int) -> torch.Tensor:
    """Zeroed int32 counters for `num_tokens` tokens that the kernel leaves at zero (see the
    module docstring for why they are cached per (device, stream))."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(num_tokens, dtype=torch.int32, device=device)
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < num_tokens:
        capacity = max(MIN_COUNTER_CAPACITY, 1 << (num_tokens - 1).bit_length())
        # Same stream: the buffer it replaces is freed only after the launches that use it.
        counters = _COUNTERS[key] = torch.zeros(capacity, dtype=torch.int32, device=device)
    return counters


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """Destination-passing entry: fills `output` [T,16,512] bf16 and `lse` [T,16] fp32 (base 2)."""
    run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None)


def run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits) -> None:
    """`run` with an explicit split count (a power of two dividing 32); None picks `num_splits_for(T)`.
    For tuning sweeps; `run` is the entry the benchmark uses."""
    _v1._check_inputs(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, output, lse)
    num_tokens = q_nope.shape[0]
    if num_tokens == 0:
        return
    if num_splits is None:
        num_splits = num_splits_for(num_tokens)
    elif num_splits not in VALID_SPLITS:
        raise DsaShapeError(f"num_splits must be one of {VALID_SPLITS}, got {num_splits}")
    device = q_nope.device
    if num_splits == 1:
        # One split writes the output directly: no partials, no counters (never read).
        partials = torch.empty((1, PARTIAL_FLOATS), dtype=torch.float32, device=device)
        counters = torch.empty((1,), dtype=torch.int32, device=device)
    else:
        if num_tokens * num_splits * PARTIAL_FLOATS >= MAX_WORKSPACE_ELEMENTS:
            raise DsaShapeError(
                f"{num_tokens} tokens x {num_splits} splits overflow the 32-bit workspace offsets; use fewer splits"
            )
        partials = torch.empty((num_tokens * num_splits, PARTIAL_FLOATS), dtype=torch.float32, device=device)
        counters = _arrival_counters(device, num_tokens)
    compiled_for()(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, float(sm_scale), output, lse, partials, counters, num_splits
    )
