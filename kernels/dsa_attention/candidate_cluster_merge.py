"""DSA candidate v1.6 ("cluster merge"): at T <= 8 tokens the splits of a token run as one thread-block cluster and
merge their partial results over distributed shared memory, so there is no workspace and no combine kernel;
larger T as `kernel.py`.

Why (NOTES.md, sessions 8 and 11): the call is a chain of memory round trips, and the last of them is the
partials' (33 KB per split written to global memory and read again by a second kernel: 4.2 MB at T = 8, the
combine ~3 us of the 14.9-us span). Candidate v1.5 showed that more CTAs with more partials lose (0.87x).
Here every split CTA runs `kernel.py`'s chunk loop unchanged, then parks its unnormalised O, m and l in its
own chunk ring (free after the loop), the cluster synchronises, and CTA r merges columns
[512 r / S, 512 (r + 1) / S) of all 16 heads by log-sum-exp from every peer's shared memory
(`ld.shared::cluster`, four columns per load) and writes the bf16 output (rank 0 also the base-2 lse). A
second cluster barrier keeps each CTA's shared memory alive until its peers have read it.

Two entries: S = 16 splits (two chunks each; a cluster of 16 needs the non-portable size, which CuTe-DSL
allows on every kernel) and S = 8 (four chunks each, the portable size). `kernel.py` runs 32 one-chunk
splits at T = 1-2 and 16 two-chunk splits at T = 6-8. Numerics: the same chunk loop; the merge weighs the
splits as the combine does but sums `total` in split order (the combine reduces it by a butterfly), so the
last bits can differ. Prediction and bar in NOTES.md.
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import kernel
from .kernel import (
    CKV_DIM,
    GPU_ARCH,
    LOG2_E,
    NUM_CHUNKS,
    NUM_HEADS,
    NUM_THREADS,
    WS_COLS,
    WS_MAX_COL,
    WS_SUM_COL,
    DsaShapeError,
)

__all__ = ["CLUSTER_MAX_TOKENS", "DsaShapeError", "compile_only", "run", "run_eight", "run_sixteen", "run_with_splits"]

# Up to here the T x S CTAs of the cluster kernel fit one wave (one CTA per SM, 132 SMs, S = 16).
CLUSTER_MAX_TOKENS = 8
THREADS_PER_HEAD = NUM_THREADS // NUM_HEADS  # 8 threads merge one head's columns
COLUMNS_PER_LOAD = 4  # one ld.shared::cluster.v4.f32


def _load_peer_f32(pointer, rank: Int32) -> Float32:
    """One fp32 from CTA `rank`'s shared memory at the same offset as the local `pointer`."""
    remote = cute.arch.map_dsmem_ptr(pointer, rank)
    return cute.arch.inline_ptx(
        "ld.shared::cluster.f32 {$w0}, [{$r0}];", write_only_types=[Float32], read_only_args=[Int32(remote.toint())]
    )


def _load_peer_f32x4(pointer, rank: Int32):
    """Four consecutive fp32 (16-B aligned) from CTA `rank`'s shared memory."""
    remote = cute.arch.map_dsmem_ptr(pointer, rank)
    return cute.arch.inline_ptx(
        "ld.shared::cluster.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Float32, Float32, Float32, Float32],
        read_only_args=[Int32(remote.toint())],
    )


class _ClusterSplitKernel(kernel._SplitKernel):
    """`kernel.py`'s split kernel over `cluster_splits` splits per token, launched as clusters of those
    splits, with the log-sum-exp merge in place of the workspace epilogue."""

    cluster_splits = 16

    @cute.jit
    def launch(
        self,
        q_nope: cute.Tensor,
        q_pe: cute.Tensor,
        ckv_rows: cute.Tensor,
        kpe_rows: cute.Tensor,
        sparse_indices: cute.Tensor,
        scale_log2: cutlass.Float32,
        output: cute.Tensor,
        lse: cute.Tensor,
        stream,
    ):
        tiled_mma, sq_layout, sk_layout, ss_layout, sp_layout, SharedStorage = self.shared_layouts()
        self.kernel(
            q_nope, q_pe, ckv_rows, kpe_rows, sparse_indices, scale_log2, output, lse, tiled_mma, sq_layout,
            sk_layout, ss_layout, sp_layout, SharedStorage,
        ).launch(
            grid=[q_nope.shape[0], self.cluster_splits, 1],
            block=[NUM_THREADS, 1, 1],
            cluster=[1, self.cluster_splits, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        q_nope: cute.Tensor,
        q_pe: cute.Tensor,
        ckv_rows: cute.Tensor,
        kpe_rows: cute.Tensor,
        sparse_indices: cute.Tensor,
        scale_log2: cutlass.Float32,
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
        sq, sk, ss, sp, salpha = self.shared_tensors(SharedStorage, sq_layout, sk_layout, ss_layout, sp_layout)
        acc_o, row_max, row_sum = self.attend(
            q_nope, q_pe, ckv_rows, kpe_rows, sparse_indices, scale_log2, self.cluster_splits, tiled_mma, sq, sk, ss,
            sp, salpha, token, split, tidx,
        )  # fmt: skip

        # This split's unnormalised O, m and l, in the workspace row layout, in the chunk ring: its last
        # readers passed the barrier that ends the chunk loop.
        part = cute.make_tensor(
            cute.recast_ptr(sk.iterator, dtype=Float32), cute.make_layout((NUM_HEADS, WS_COLS), stride=(WS_COLS, 1))
        )
        thr_mma = tiled_mma.get_slice(tidx)
        cute.autovec_copy(acc_o, thr_mma.partition_C(cute.local_tile(part, (NUM_HEADS, CKV_DIM), (0, 0))))
        if tidx % kernel.THREADS_PER_SOFTMAX_ROW == 0:
            softmax_row = tidx // kernel.THREADS_PER_SOFTMAX_ROW
            part[softmax_row, WS_MAX_COL] = row_max[0]
            part[softmax_row, WS_SUM_COL] = row_sum[0]
        cute.arch.cluster_arrive()  # release: the parked partials, for every peer
        cute.arch.cluster_wait()
        self.merge(part, output, lse, token, cute.arch.block_idx_in_cluster(), tidx)
        cute.arch.cluster_arrive()  # no CTA leaves while a peer may still read its shared memory
        cute.arch.cluster_wait()

    @cute.jit
    def merge(self, part: cute.Tensor, output: cute.Tensor, lse: cute.Tensor, token: Int32, rank: Int32, tidx: Int32):
        """Columns [CKV_DIM / S * rank, ...) of all heads: thread t takes head t // 8 and CKV_DIM / S / 8
        consecutive columns, weighs every split by exp2(m_s - max) and divides by the weighted sum of l_s, as
        `_CombineKernel` does (a head without any valid row: output 0, lse -inf)."""
        splits = self.cluster_splits
        columns_per_thread = CKV_DIM // splits // THREADS_PER_HEAD
        head = tidx // THREADS_PER_HEAD
        col0 = rank * (CKV_DIM // splits) + (tidx % THREADS_PER_HEAD) * columns_per_thread
        stats_max = cute.make_rmem_tensor((splits,), Float32)
        stats_sum = cute.make_rmem_tensor((splits,), Float32)
        for s in cutlass.range_constexpr(splits):
            stats_max[s] = _load_peer_f32(part.iterator + (head * WS_COLS + WS_MAX_COL), s)
            stats_sum[s] = _load_peer_f32(part.iterator + (head * WS_COLS + WS_SUM_COL), s)
        global_max = -Float32.inf
        for s in cutlass.range_constexpr(splits):
            global_max = cute.arch.fmax(global_max, stats_max[s])
        # A head without any valid row has max -inf: shift by 0 so every weight is exp2(-inf) = 0.
        shift = Float32(0.0) if global_max == -Float32.inf else global_max
        acc = cute.make_rmem_tensor((columns_per_thread,), Float32)
        acc.fill(0.0)
        total = Float32(0.0)
        for s in cutlass.range_constexpr(splits):
            weight = cute.math.exp2(stats_max[s] - shift, fastmath=True)
            total = total + weight * stats_sum[s]
            for q in cutlass.range_constexpr(columns_per_thread // COLUMNS_PER_LOAD):
                quad = _load_peer_f32x4(part.iterator + (head * WS_COLS + col0 + q * COLUMNS_PER_LOAD), s)
                for j in cutlass.range_constexpr(COLUMNS_PER_LOAD):
                    acc[q * COLUMNS_PER_LOAD + j] = acc[q * COLUMNS_PER_LOAD + j] + weight * quad[j]
        # total >= 1 whenever some row was valid (the max element contributes exp2(0) = 1).
        inv_total = Float32(0.0) if total == Float32(0.0) else Float32(1.0) / total
        for j in cutlass.range_constexpr(columns_per_thread):
            output[token, head, col0 + j] = (acc[j] * inv_total).to(cutlass.BFloat16)
        if rank == 0:
            if tidx % THREADS_PER_HEAD == 0:
                lse[token, head] = global_max + cute.math.log2(total)  # -inf + log2(0) = -inf without valid rows


class _EightSplits(_ClusterSplitKernel):
    """Clusters of 8 (the portable size): four chunks per split."""

    cluster_splits = 8


class DsaClusterSm90:
    """Host entry of the cluster split kernel alone (`kernel.DsaSparseAttentionSm90`'s arguments but the
    workspace)."""

    def __init__(self, split: type) -> None:
        self.split = split

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
        stream,
    ):
        ckv_rows, kpe_rows = kernel.cache_rows(ckv_cache, kpe_cache)
        self.split().launch(q_nope, q_pe, ckv_rows, kpe_rows, sparse_indices, sm_scale * LOG2_E, output, lse, stream)


_COMPILED: dict[tuple[str, type], Callable] = {}


def compiled_for(arch: str = GPU_ARCH, split: type = _ClusterSplitKernel) -> Callable:
    """The compiled cluster launcher for `arch` (compiled on first use; needs no GPU)."""
    key = (arch, split)
    if key not in _COMPILED:
        _COMPILED[key] = cute.compile(
            DsaClusterSm90(split), *kernel.fake_arguments(workspace=False), options=f"--enable-tvm-ffi --gpu-arch {arch}"
        )
    return _COMPILED[key]


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """Both cluster launchers and `kernel.py`'s, for `arch`, without a GPU."""
    return compiled_for(arch, _ClusterSplitKernel), compiled_for(arch, _EightSplits), kernel.compile_only(arch)


def _run_with(split: type, q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """`kernel.run`'s contract: the cluster kernel `split` up to CLUSTER_MAX_TOKENS tokens, `kernel.py` above."""
    num_tokens = q_nope.shape[0]
    if num_tokens > CLUSTER_MAX_TOKENS:
        kernel.run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse)
        return
    kernel._check_inputs(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, output, lse)
    if num_tokens == 0:
        return
    compiled_for(GPU_ARCH, split)(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, float(sm_scale), output, lse)


def run_sixteen(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """Clusters of 16 splits (two chunks each) at T <= 8."""
    _run_with(_ClusterSplitKernel, q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse)


def run_eight(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """Clusters of 8 splits (four chunks each) at T <= 8."""
    _run_with(_EightSplits, q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse)


def run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits) -> None:
    """At T <= CLUSTER_MAX_TOKENS, 16 (or None) or 8 splits run the cluster kernel of that size; any other split
    count, and every larger T, `kernel.run_with_splits`."""
    clusters = {None: _ClusterSplitKernel, 16: _ClusterSplitKernel, 8: _EightSplits}
    if q_nope.shape[0] <= CLUSTER_MAX_TOKENS and num_splits in clusters:
        _run_with(clusters[num_splits], q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse)
    else:
        kernel.run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits)


# The entry test_dsa_attention_kernel.py's checks run.
run = run_sixteen

assert NUM_CHUNKS % _ClusterSplitKernel.cluster_splits == 0 and NUM_CHUNKS % _EightSplits.cluster_splits == 0
