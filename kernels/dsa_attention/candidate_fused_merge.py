"""DSA candidate v1.13 ("fused merge", session 18): one cooperative launch in place of the split kernel and
its programmatic-dependent combine, wherever a token has several splits.

Why (NOTES.md, session 18's stamps and runs): after the last split CTA has stored its partial, the combine waits
~0.65 us in `griddepcontrol.wait` for the split grid to complete, then reloads the partials; and at 1-2 tokens the
second launch's host issue races the ~6-us split kernel, so 1-3 us of host gaps land in many calls' spans.

Design. For 1 < splits with T * splits <= 132 (every official workload: T <= 66) the split kernel is launched as a
cooperative grid (all CTAs co-resident, guaranteed by the driver). After `kernel.py`'s epilogue (the partial as
one bulk copy, complete), thread 0 of each CTA publishes it on its token's counter (`fence.proxy.async`, then
`atom.add.release.gpu` of 32 / splits) and waits (`ld.acquire.gpu`) until the counter reaches the next multiple of
32: the token's splits have all published. The counters live in a small int32 buffer per (device, stream), zeroed
once when it is created and never reset: each call adds exactly 32 per token, so a call starts on a multiple of 32
whatever the split count, and the comparison is wrap-safe. Then CTA `split` merges columns
[split * 512 / splits, (split + 1) * 512 / splits) of all 16 heads: its 32 KB of partial columns and the splits'
statistics come in by `cp.async.cg` (L2, never a stale L1 line) into the chunk ring, and each thread merges one head's
columns exactly as `_CombineKernel` does (the same max, the same weights, the same butterfly order of the weighted
sum, the same sequential order of the O sum), so the outputs should equal `kernel.py`'s bit for bit. A wait that
lasts ~2 s traps instead of hanging. Other split counts (T > 66, or a split count chosen by hand that does not fit
one wave) run `kernel.py`'s two kernels.

Prediction: the combine's ~0.65-us hand-over and the second launch gone, the merge's loads about as long as the
combine's; ~0.5-1 us off every call (~1.05-1.10x), more on the 1-2-token rows whose spans carried host gaps.
"""

from __future__ import annotations

from typing import Callable

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_fake_compact_tensor

from . import kernel
from .kernel import DsaShapeError

__all__ = ["DsaShapeError", "compile_only", "run", "run_with_splits"]

COUNTER_STEP = kernel.MAX_SPLITS  # each call adds this much to a token's counter, whatever its split count
NUM_COUNTERS = kernel.MAX_CTAS_PER_WAVE  # T <= 66 whenever the fused path runs (two or more splits)
SPIN_LIMIT = 20_000_000  # ~100-ns naps: a wait beyond ~2 s is a bug, so trap rather than hang
STATS_PER_SPLIT = 4  # m, l and the two padding columns: one 16-B copy
HEAD_THREADS = kernel.NUM_THREADS // kernel.NUM_HEADS  # 8 threads merge one head's columns
MERGE_FLOATS = kernel.NUM_HEADS * kernel.CKV_DIM  # a CTA loads [splits, 16, 512 / splits] partial columns
assert MERGE_FLOATS % (4 * kernel.NUM_THREADS) == 0


def _ld_acquire(address: cutlass.Int64) -> cutlass.Int32:
    return cute.arch.inline_ptx(
        "ld.acquire.gpu.global.s32 {$w0}, [{$r0}];", write_only_types=[cutlass.Int32], read_only_args=[address]
    )


def _mul_no_contract(a: cutlass.Float32, b: cutlass.Float32) -> cutlass.Float32:
    """a * b rounded on its own (`mul.rn` is never fused into an add), as the combine's products are before
    its shuffles."""
    return cute.arch.inline_ptx(
        "mul.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[cutlass.Float32], read_only_args=[a, b]
    )


class _FusedSplitKernel(kernel._SplitKernel):
    @cute.jit
    def launch_fused(
        self,
        q_nope: cute.Tensor,
        q_pe: cute.Tensor,
        ckv_rows: cute.Tensor,
        kpe_rows: cute.Tensor,
        sparse_indices: cute.Tensor,
        scale_log2: cutlass.Float32,
        workspace: cute.Tensor,
        output: cute.Tensor,
        lse: cute.Tensor,
        counters: cute.Tensor,
        stream,
    ):
        tiled_mma, sq_layout, sk_layout, ss_layout, sp_layout, SharedStorage = self.shared_layouts()
        self.fused_kernel(
            q_nope, q_pe, ckv_rows, kpe_rows, sparse_indices, scale_log2, workspace, output, lse, counters,
            tiled_mma, sq_layout, sk_layout, ss_layout, sp_layout, SharedStorage,
        ).launch(
            grid=[q_nope.shape[0], workspace.shape[1], 1],
            block=[kernel.NUM_THREADS, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            cooperative=True,  # the token barrier below needs all of a token's splits resident
        )

    @cute.kernel
    def fused_kernel(
        self,
        q_nope: cute.Tensor,
        q_pe: cute.Tensor,
        ckv_rows: cute.Tensor,
        kpe_rows: cute.Tensor,
        sparse_indices: cute.Tensor,
        scale_log2: cutlass.Float32,
        workspace: cute.Tensor,
        output: cute.Tensor,
        lse: cute.Tensor,
        counters: cute.Tensor,
        tiled_mma: cute.TiledMma,
        sq_layout: cute.Layout,
        sk_layout: cute.Layout,
        ss_layout: cute.Layout,
        sp_layout: cute.Layout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        token, split, _ = cute.arch.block_idx()
        sq, sk, ss, sp, salpha, srow_ids = self.shared_tensors(SharedStorage, sq_layout, sk_layout, ss_layout, sp_layout)
        acc_o, row_max, row_sum = self.attend(
            q_nope, q_pe, ckv_rows, kpe_rows, sparse_indices, scale_log2, workspace.shape[1], tiled_mma,
            sq, sk, ss, sp, salpha, srow_ids, token, split, tidx,
        )
        self.store_partial(acc_o, row_max, row_sum, workspace, tiled_mma, sk, token, split, tidx)
        self.wait_for_token(counters, token, workspace.shape[1], tidx)
        self.merge_columns(workspace, output, lse, sk, token, split, tidx)

    @cute.jit
    def wait_for_token(self, counters: cute.Tensor, token: cutlass.Int32, num_splits: cutlass.Int32, tidx: cutlass.Int32):
        """Publish this split's partial on the token's counter and wait for the token's other splits."""
        if tidx == 0:
            # store_partial's thread 0 has waited for its bulk copy to complete; order those async-proxy
            # writes before the generic release below.
            cute.arch.fence_proxy("async.global")
            address = cutlass.Int64((counters.iterator + token).toint())
            before = cute.arch.inline_ptx(
                "atom.add.release.gpu.global.s32 {$w0}, [{$r0}], {$r1};",
                write_only_types=[cutlass.Int32],
                read_only_args=[address, cutlass.Int32(COUNTER_STEP) // num_splits],
            )
            target = (before & ~(COUNTER_STEP - 1)) + COUNTER_STEP
            seen = _ld_acquire(address)
            spins = cutlass.Int32(0)
            while seen - target < 0:  # wrap-safe: the counter only grows
                cute.arch.inline_ptx("nanosleep.u32 100;")
                seen = _ld_acquire(address)
                spins = spins + 1
                if spins > SPIN_LIMIT:
                    cute.arch.inline_ptx("trap;")
        cute.arch.sync_threads()

    @cute.jit
    def merge_columns(
        self,
        workspace: cute.Tensor,
        output: cute.Tensor,
        lse: cute.Tensor,
        sk: cute.Tensor,
        token: cutlass.Int32,
        split: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        """This split's share of the token's columns, merged over all splits as `_CombineKernel` merges them."""
        num_splits = workspace.shape[1]
        width = kernel.CKV_DIM // num_splits  # columns of each head this CTA merges
        first_col = split * width
        ring = cute.recast_ptr(sk.iterator, dtype=cutlass.Float32)
        # [splits, 16, width] partial columns, then [32, 16, 4] statistics.
        spart = cute.make_tensor(ring, cute.make_layout(MERGE_FLOATS))
        sstats = cute.make_tensor(
            ring + MERGE_FLOATS,
            cute.make_layout(
                (kernel.MAX_SPLITS, kernel.NUM_HEADS, STATS_PER_SPLIT),
                stride=(STATS_PER_SPLIT * kernel.NUM_HEADS, STATS_PER_SPLIT, 1),
            ),
        )
        g2s4 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Float32, num_bits_per_copy=128
        )
        quads = width // 4
        for i in cutlass.range_constexpr(MERGE_FLOATS // 4 // kernel.NUM_THREADS):
            q = i * kernel.NUM_THREADS + tidx
            s = q // (kernel.NUM_HEADS * quads)
            head = (q // quads) % kernel.NUM_HEADS
            quad = q % quads
            cute.copy(
                g2s4,
                cute.local_tile(workspace[token, s, head, None], (4,), ((first_col + 4 * quad) // 4,)),
                cute.local_tile(spart, (4,), (q,)),
            )
        for i in cutlass.range_constexpr(kernel.MAX_SPLITS * kernel.NUM_HEADS // kernel.NUM_THREADS):
            pair = i * kernel.NUM_THREADS + tidx
            s = pair // kernel.NUM_HEADS
            head = pair % kernel.NUM_HEADS
            if s < num_splits:
                cute.copy(
                    g2s4,
                    cute.local_tile(workspace[token, s, head, None], (4,), (kernel.WS_MAX_COL // 4,)),
                    sstats[s, head, None],
                )
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()

        head = tidx // HEAD_THREADS
        lane8 = tidx % HEAD_THREADS
        weights = cute.make_rmem_tensor((kernel.MAX_SPLITS,), cutlass.Float32)
        global_max = -cutlass.Float32.inf
        for s in cutlass.range_constexpr(kernel.MAX_SPLITS):
            if s < num_splits:
                global_max = cute.arch.fmax(global_max, sstats[s, head, 0])
        shift = cutlass.Float32(0.0) if global_max == -cutlass.Float32.inf else global_max
        # The combine's butterfly over 32 lanes, lane 0's tree: pairs (i, i + 16), then (i, i + 8), ...
        terms = cute.make_rmem_tensor((kernel.MAX_SPLITS,), cutlass.Float32)
        for s in cutlass.range_constexpr(kernel.MAX_SPLITS):
            split_max = -cutlass.Float32.inf
            split_sum = cutlass.Float32(0.0)
            if s < num_splits:
                split_max = sstats[s, head, 0]
                split_sum = sstats[s, head, 1]
            weights[s] = cute.math.exp2(split_max - shift, fastmath=True)
            terms[s] = _mul_no_contract(weights[s], split_sum)
        for level in cutlass.range_constexpr(kernel.MAX_SPLITS.bit_length() - 1):
            half = kernel.MAX_SPLITS >> (level + 1)
            for i in cutlass.range_constexpr(half):
                terms[i] = terms[i] + terms[i + half]
        total = terms[0]
        inv_total = cutlass.Float32(0.0) if total == cutlass.Float32(0.0) else cutlass.Float32(1.0) / total

        for k in cutlass.range(width // HEAD_THREADS, unroll=1):
            col = lane8 + HEAD_THREADS * k
            acc = cutlass.Float32(0.0)
            for s in cutlass.range_constexpr(kernel.MAX_SPLITS):
                value = cutlass.Float32(0.0)
                if s < num_splits:
                    value = spart[(s * kernel.NUM_HEADS + head) * width + col]
                acc = acc + weights[s] * value
            output[token, head, first_col + col] = (acc * inv_total).to(cutlass.BFloat16)
        if split == 0 and lane8 == 0:
            lse[token, head] = global_max + cute.math.log2(total)


class DsaFusedSm90:
    """Host entry of the fused path: one cooperative launch."""

    def __init__(self, staged_indices: bool) -> None:
        self.staged_indices = staged_indices

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
        counters: cute.Tensor,
        stream,
    ):
        ckv_rows, kpe_rows = kernel.cache_rows(ckv_cache, kpe_cache)
        _FusedSplitKernel(self.staged_indices).launch_fused(
            q_nope, q_pe, ckv_rows, kpe_rows, sparse_indices, sm_scale * kernel.LOG2_E, workspace, output, lse,
            counters, stream,
        )


_COMPILED: dict[tuple[str, bool], Callable] = {}
_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def compiled_fused(arch: str, staged_indices: bool) -> Callable:
    key = (arch, staged_indices)
    if key not in _COMPILED:
        arguments = list(kernel.fake_arguments())
        counters = make_fake_compact_tensor(cutlass.Int32, (NUM_COUNTERS,), assumed_align=16)
        _COMPILED[key] = cute.compile(
            DsaFusedSm90(staged_indices),
            *arguments[:-1], counters, arguments[-1],
            options=f"--enable-tvm-ffi --gpu-arch {arch}",
        )
    return _COMPILED[key]


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, Callable]:
    """Compile both forms of the fused launcher for `arch` without a GPU (the two-kernel path is kernel.py's)."""
    return tuple(compiled_fused(arch, staged) for staged in (False, True))


def token_counters(device: torch.device) -> torch.Tensor:
    """The counters of the current stream on `device`: zeroed once, then kept on multiples of 32 by the kernel."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch.cuda.current_stream(index).cuda_stream)
    counters = _COUNTERS.get(key)
    if counters is None:
        counters = _COUNTERS[key] = torch.zeros(NUM_COUNTERS, dtype=torch.int32, device=device)
    return counters


def fuses(num_tokens: int, num_splits: int) -> bool:
    """Whether this call runs fused: several splits, and all T * splits CTAs co-resident (one per SM)."""
    return num_splits > 1 and num_tokens * num_splits <= kernel.MAX_CTAS_PER_WAVE


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """`kernel.py`'s contract."""
    run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None)


def run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits) -> None:
    """`kernel.run_with_splits`, fused where `fuses` says so."""
    kernel._check_inputs(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, output, lse)
    num_tokens = q_nope.shape[0]
    if num_splits is None:
        num_splits = kernel.num_splits_for(max(num_tokens, 1))
    if num_tokens == 0 or not fuses(num_tokens, num_splits):
        kernel.run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits)
        return
    if num_splits not in kernel.VALID_SPLITS:
        raise DsaShapeError(f"num_splits must be one of {kernel.VALID_SPLITS}, got {num_splits}")
    workspace = torch.empty(
        (num_tokens, num_splits, kernel.NUM_HEADS, kernel.WS_COLS), dtype=torch.float32, device=q_nope.device
    )
    compiled_fused(kernel.GPU_ARCH, kernel.stages_indices(num_splits))(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, float(sm_scale), output, lse, workspace,
        token_counters(q_nope.device),
    )
