"""GDN prefill candidate `cand_pair_key_side`: the WY path with a key side that serves both v-heads of a q/k
head in one CTA.

Why (NOTES.md, "Mapping onto the H200" and the WGMMA chain's split): at 8192 tokens the key side takes 44-46 us
of a ~100-us call and is latency-bound: shared memory (~66 KB per (chunk, v-head) CTA, 35 KB of it the k and q
rows) holds it to three CTAs of four warps per SM, and the two v-heads of a q/k head each load and convert the
same k and q rows. It cannot overlap the chain as a separate kernel (measured), so it must get cheaper.

Here one 256-thread CTA per (chunk, q/k head): warps 0-3 copy the k, q, a and b rows once and convert k and q
to fp16 once (`wy_prepass._KeySide`'s steps); then warp group g (warps 4g..4g+3) computes v-head 2 q/k + g's
gates, Gram tiles, P and T exactly as `_KeySide` does for that head (`chunked.py`'s methods, each group with
its own buffers), so the workspace holds the same bits. ~93 KB per CTA: two CTAs (four v-heads, 16 warps)
per SM instead of three v-heads in 12 warps, and half the k and q traffic. The chains (`wy_prepass.py`'s
below WGMMA_CHAIN_MIN_SEQS sequences, `wgmma_value_side.py`'s from there) are unchanged.
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from . import kernel, token_serial, wgmma_value_side, wy_prepass
from .chunked import (
    BLOCK,
    CHUNK,
    COPY_ELEMS,
    DIAG_STRIDE,
    KQ_ROWS,
    LOG2_E,
    NARROW_STRIDE,
    NUM_STAGES,
    NUM_THREADS,
    NUM_WARPS,
    SCRATCH_STRIDE,
    SLICE_ROWS,
    SQUARE_T_VIEW,
    WARP_SIZE,
    WIDE_STRIDE,
    _layout,
    _make_operand_copies,
    _make_warp_mma,
)
from .token_serial import GPU_ARCH, NUM_QK_HEADS, NUM_V_HEADS, V_HEADS_PER_QK_HEAD, GdnShapeError, resolve_scale
from .wy_prepass import SQUARE_PIECES, WyPrepassConfig

__all__ = ["GdnShapeError", "compile_only", "resolve_scale", "run", "run_as_kernel"]

GROUPS = V_HEADS_PER_QK_HEAD  # warp groups per CTA, one per v-head of the q/k head
PAIR_THREADS = GROUPS * NUM_THREADS


class _PairKeySide(wy_prepass._KeySide):
    """Kernel 1 of the WY path for both v-heads of a q/k head per CTA (module docstring)."""

    @cute.jit
    def launch(self, q, k, A_log, a, dt_bias, b, cu_seqlens, ws_tp, ws_g, stream):
        tiled_mma = _make_warp_mma()
        f16, bf16, f32 = cutlass.Float16, cutlass.BFloat16, cutlass.Float32

        # The k, q, a and b rows once; each group's A, T, inverse scratch and gates apart.
        @cute.struct
        class SharedStorage:
            raw_a: cute.struct.Align[cute.struct.MemRange[bf16, NUM_STAGES * CHUNK * NUM_V_HEADS], 128]
            raw_b: cute.struct.Align[cute.struct.MemRange[bf16, NUM_STAGES * CHUNK * NUM_V_HEADS], 128]
            kq: cute.struct.Align[cute.struct.MemRange[f16, KQ_ROWS * WIDE_STRIDE], 128]
            a16_0: cute.struct.Align[cute.struct.MemRange[f16, CHUNK * NARROW_STRIDE], 128]
            a16_1: cute.struct.Align[cute.struct.MemRange[f16, CHUNK * NARROW_STRIDE], 128]
            a_diag_0: cute.struct.Align[cute.struct.MemRange[f32, CHUNK * DIAG_STRIDE], 128]
            a_diag_1: cute.struct.Align[cute.struct.MemRange[f32, CHUNK * DIAG_STRIDE], 128]
            t16_0: cute.struct.Align[cute.struct.MemRange[f16, CHUNK * NARROW_STRIDE], 128]
            t16_1: cute.struct.Align[cute.struct.MemRange[f16, CHUNK * NARROW_STRIDE], 128]
            scratch_0: cute.struct.Align[cute.struct.MemRange[f16, NUM_WARPS * BLOCK * SCRATCH_STRIDE], 128]
            scratch_1: cute.struct.Align[cute.struct.MemRange[f16, NUM_WARPS * BLOCK * SCRATCH_STRIDE], 128]
            cum_log_g_0: cute.struct.Align[cute.struct.MemRange[f32, CHUNK], 16]
            cum_log_g_1: cute.struct.Align[cute.struct.MemRange[f32, CHUNK], 16]
            beta_0: cute.struct.Align[cute.struct.MemRange[f32, CHUNK], 16]
            beta_1: cute.struct.Align[cute.struct.MemRange[f32, CHUNK], 16]

        kernel = self.pair_kernel(q, k, A_log, a, dt_bias, b, cu_seqlens, ws_tp, ws_g, tiled_mma, SharedStorage)
        self.launch_grid(kernel, [NUM_QK_HEADS, ws_tp.shape[0], 1], SharedStorage, stream, threads=PAIR_THREADS)

    @cute.kernel
    def pair_kernel(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        A_log: cute.Tensor,
        a: cute.Tensor,
        dt_bias: cute.Tensor,
        b: cute.Tensor,
        cu_seqlens: cute.Tensor,
        ws_tp: cute.Tensor,
        ws_g: cute.Tensor,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        qk_head, slot, _ = cute.arch.block_idx()
        group = tidx // NUM_THREADS
        group_tidx = tidx % NUM_THREADS
        start, length, chunk, num_chunks = self.chunk_of_slot(cu_seqlens, slot, cutlass.Int32(q.shape[0]))
        if chunk < num_chunks:
            st = cutlass.memory.SmemAllocator().allocate(SharedStorage)
            raw_k, raw_a, raw_b, kq, kq_raw = self.staging_views(st, k_staged_in_kq=True)
            head_0 = qk_head * V_HEADS_PER_QK_HEAD
            tokens_here = cutlass.min(length - chunk * CHUNK, cutlass.Int32(CHUNK))
            if group == 0:
                g2s = cute.make_copy_atom(
                    cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.BFloat16,
                    num_bits_per_copy=128,
                )  # fmt: skip
                self.copy_head_rows(g2s, k, raw_k, 0, start, length, chunk, head_0, group_tidx)
                self.copy_gate_rows(g2s, a, b, raw_a, raw_b, start, length, chunk, 0, group_tidx)
                self.load_q(g2s, q, kq_raw, start, length, chunk, head_0, group_tidx)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            if group == 0:
                self.convert_kq(raw_k, kq_raw, kq, tokens_here, group_tidx)
            # Each group's head; the branches are warp-uniform and pass the same CTA barriers in order.
            if group == 0:
                self.head_steps(
                    A_log, dt_bias, ws_tp, ws_g, tiled_mma, st.a16_0, st.a_diag_0, st.t16_0, st.scratch_0,
                    st.cum_log_g_0, st.beta_0, raw_a, raw_b, kq, slot, head_0, tokens_here, group_tidx,
                )  # fmt: skip
            else:
                self.head_steps(
                    A_log, dt_bias, ws_tp, ws_g, tiled_mma, st.a16_1, st.a_diag_1, st.t16_1, st.scratch_1,
                    st.cum_log_g_1, st.beta_1, raw_a, raw_b, kq, slot, head_0 + 1, tokens_here, group_tidx,
                )  # fmt: skip

    @cute.jit
    def head_steps(
        self, A_log, dt_bias, ws_tp, ws_g, tiled_mma, a16_mem, a_diag_mem, t16_mem, scratch_mem, cum_log_g_mem,
        beta_mem, raw_a, raw_b, kq, slot, head, tokens_here, tidx,
    ):  # fmt: skip
        """`_KeySide.key_kernel`'s steps after the loads for one v-head, by one warp group (`tidx` and the warp
        index within the group), with the group's buffers; three CTA barriers before the inverse and its three.
        The first barrier also orders the group-0 conversion of k and q before the Gram tiles. (From the gates
        on, the same code as `key_kernel`'s tail, kept apart so that `key_kernel`'s PTX stays as measured.)"""
        warp_idx = tidx // WARP_SIZE
        lane = tidx % WARP_SIZE
        a16, a_diag, t16, scratch, cum_log_g, beta = self.head_views(
            a16_mem, a_diag_mem, t16_mem, scratch_mem, cum_log_g_mem, beta_mem, warp_idx
        )
        a16_t = cute.make_tensor(a16.iterator, _layout(SQUARE_T_VIEW))
        t16_t = cute.make_tensor(t16.iterator, _layout(SQUARE_T_VIEW))
        p16 = ws_tp[slot, head, 1, None, None]

        copy_a, copy_b, copy_bt = _make_operand_copies(tiled_mma)
        thr_mma = tiled_mma.get_slice(lane)
        coords_sq = thr_mma.partition_C(cute.make_identity_tensor((BLOCK, BLOCK)))
        coords_rows = thr_mma.partition_C(cute.make_identity_tensor((BLOCK, SLICE_ROWS)))
        acc_sq = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK, BLOCK)), cutlass.Float32)
        acc_y = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK, SLICE_ROWS)), cutlass.Float32)

        self.clear_upper_blocks(t16, p16, tidx)
        neg_decay_rate = -cute.math.exp(A_log[head]) * LOG2_E
        if warp_idx == 0:
            self.chunk_gates(raw_a, raw_b, 0, head, neg_decay_rate, dt_bias[head], tokens_here, lane, cum_log_g, beta)
        cute.arch.sync_threads()
        self.gram_tiles(
            tiled_mma, copy_a, copy_b, lane, warp_idx, kq, acc_sq, coords_sq, cum_log_g, beta, a16, a_diag, p16
        )
        cute.arch.sync_threads()
        self.invert_unit_lower(
            tiled_mma, copy_a, copy_bt, lane, warp_idx, tidx, a16_t, a_diag, t16, t16_t, scratch,
            acc_sq, acc_y, coords_sq, coords_rows,
        )  # fmt: skip
        for i in cutlass.range_constexpr(CHUNK * SQUARE_PIECES // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            row = linear // SQUARE_PIECES
            piece = linear % SQUARE_PIECES
            cute.autovec_copy(
                cute.local_tile(t16[row, None], (COPY_ELEMS,), (piece,)),
                cute.local_tile(ws_tp[slot, head, 0, row, None], (COPY_ELEMS,), (piece,)),
            )
        if tidx < CHUNK:
            ws_g[slot, head, 0, tidx] = cum_log_g[tidx]
            ws_g[slot, head, 1, tidx] = beta[tidx]


class _PairKeyWy(wy_prepass.GdnPrefillWyPrepassSm90):
    """`wy_prepass.py`'s launcher (its chain at the configured width) with the pair key side."""

    def key_side(self):
        return _PairKeySide()


class _PairKeyWgmma(wgmma_value_side.GdnPrefillWyWgmmaSm90):
    """`wgmma_value_side.py`'s launcher (its WGMMA chain) with the pair key side."""

    def key_side(self):
        return _PairKeySide()


_COMPILED: dict[tuple[str, WyPrepassConfig | None], Callable] = {}


def compiled_for(arch: str, config: WyPrepassConfig | None) -> Callable:
    """The compiled launcher: the pair key side, then `wy_prepass.py`'s chain at `config`'s width, or the
    WGMMA chain for config None (compiled on first use; needs no GPU)."""
    key = (arch, config)
    fn = _COMPILED.get(key)
    if fn is None:
        launcher = _PairKeyWgmma() if config is None else _PairKeyWy(config)
        align = wgmma_value_side.OUTPUT_ALIGN if config is None else 2
        fn = _COMPILED[key] = token_serial.compile_launcher(
            launcher, arch, wy_prepass._workspace_stand_ins(), output_align=align
        )
    return fn


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    return tuple(compiled_for(arch, config) for config in (*wy_prepass.CONFIGS, None))


def _chain_config(num_seqs: int, output) -> WyPrepassConfig | None:
    """kernel.py's chain for N sequences: the WGMMA chain (None) from WGMMA_CHAIN_MIN_SEQS when `output` is
    16-B aligned (as `wgmma_value_side.run` requires), else `wy_prepass.py`'s at its width."""
    if num_seqs >= kernel.WGMMA_CHAIN_MIN_SEQS and output.data_ptr() % wgmma_value_side.OUTPUT_ALIGN == 0:
        return None
    return wy_prepass.config_for(num_seqs)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """The WY path at any T (`wy_prepass.run`'s contract) with the pair key side and kernel.py's chain."""
    token_serial.check_inputs(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, output, new_state)
    launcher = compiled_for(GPU_ARCH, _chain_config(new_state.shape[0], output))
    wy_prepass.run_compiled(launcher, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)


def run_as_kernel(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.py`'s dispatch with the pair key side on its WY paths (the candidate side)."""
    path = kernel.path_for(q.shape[0], new_state.shape[0])
    entry = run if path in (wy_prepass, wgmma_value_side) else path.run
    entry(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
