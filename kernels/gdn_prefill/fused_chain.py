"""GDN prefill candidate `cand_fused_chain`: `wgmma_value_side.py`'s chain with the key side inside its CTA.

Why (NOTES.md, "WGMMA chain"): from 15 sequences the WY path runs two kernels, the key side of every (chunk,
head) into a workspace, then the WGMMA chain; at 8192 tokens in 32 sequences the key side is ~40 us of the ~85.
FlashInfer's SM90 kernel runs both in one CTA per (sequence, head), a warpgroup of it on the key side. Per chunk
the key side's math alone takes ~3.3 us on an SM (clock probe of the key kernel: gates and conversion 1.25 us,
Gram tiles 1.31, inverse 0.70), below the chain's ~3.8 us step: one chunk ahead of the chain, it can hide
behind it.

One CTA per (sequence, v-head), 384 threads in three warpgroups:
  0, 1  the chain, `WgmmaValueSide.value_side` on chunk c: the whole 128 x 128 state in their accumulators;
  2     the key side of chunk c + 1, with `_Chunked`'s methods as `wy_prepass._KeySide` runs them (its barriers
        a named barrier of the warpgroup): the gates, k and q to fp16, the Gram tiles (A, and P straight into
        the chain's P buffer), T = (I + A)^-1; then the chain's operands of that chunk: the keys and queries
        in the swizzled buffers, T, the per-token decays, and the chunk's values by cp.async. Its own loads
        (k, q, a, b rows) for chunk c + 2 are issued before the inverse and land while it runs.
The chain's operands are double-buffered by chunk parity. Two named barriers per buffer hand it over: READY
(the key side arrives once the buffer holds its chunk, the chain waits) and FREE (the chain arrives once its
MMAs have read the buffer, the key side waits before refilling it two chunks later). `setmaxnreg` gives the
chain's warpgroups CHAIN_REGISTERS each and the key side KEY_REGISTERS (the CTA's registers at launch).

Same math and rounding points as the two-kernel path: the same methods in the same order on the same operands,
so the same bits (the GPU test asserts it). No workspace; ~215 KB of shared memory, one CTA per SM; the grid rows serve the sequences
longest first (`chunked.py`'s `sequence_of_block`).
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32, Int32
from cutlass.cute.nvgpu import cpasync

from . import kernel, token_serial, wgmma_value_side, wy_prepass
from .chunked import (
    BLOCK,
    CHUNK,
    LOG2_E,
    NUM_STAGES,
    SLICE_ROWS,
    SQUARE_T_VIEW,
    WARP_SIZE,
    _layout,
    _make_operand_copies,
    _make_warp_mma,
    sequence_bounds,
)
from .token_serial import GPU_ARCH, HEAD_SIZE, NUM_V_HEADS
from .wgmma_value_side import K_MAJOR, MN_MAJOR, OUTPUT_ALIGN, ROW_STRIDE, VEC, WgmmaValueSide

__all__ = ["FusedChain", "buffered_layouts", "compile_only", "compiled_for", "run", "run_as_kernel"]

WARPGROUP_THREADS = 128
CHAIN_THREADS = 2 * WARPGROUP_THREADS  # warpgroups 0 and 1
NUM_THREADS = CHAIN_THREADS + WARPGROUP_THREADS  # and the key side's, warpgroup 2
KEY_WARPGROUP = 2
# Per-thread registers after setmaxnreg. An increase draws only on what the CTA's decreases return (PTX: a per-CTA
# pool), so the split must fit the launch's 168 per thread: 2 x 128 x 216 + 128 x 72 = 384 x 168. At 216 the chain
# (234 alone) still runs its loop without spills; 224 / 56 spills 148 B in the key side (ptxas).
CHAIN_REGISTERS = 216
KEY_REGISTERS = 72
# Named barriers: 0 is the CTA's; 1 and 2 `value_side`'s, one per chain warpgroup.
KEY_SIDE_BARRIER = 3  # the key side's phases
READY_BARRIER = 4  # + buffer: the key side has filled it
FREE_BARRIER = 6  # + buffer: the chain has read it
NUM_BUFFERS = 2


@cute.jit
def buffered_layouts():
    """(keys read K-major, keys read MN-major, T or P): `wgmma_value_side.operands()`'s shared-memory layouts with
    a buffer mode, (x, y, (1, buffer)); a buffer's two views of the keys address the same elements."""
    return (
        sm90_utils.make_smem_layout_b(K_MAJOR, (HEAD_SIZE, CHUNK, HEAD_SIZE), Float16, NUM_BUFFERS),
        sm90_utils.make_smem_layout_b(MN_MAJOR, (HEAD_SIZE, HEAD_SIZE, CHUNK), Float16, NUM_BUFFERS),
        sm90_utils.make_smem_layout_b(K_MAJOR, (HEAD_SIZE, CHUNK, CHUNK), Float16, NUM_BUFFERS),
    )


class FusedChain(WgmmaValueSide, wy_prepass._KeySide):
    """The kernel of the module docstring. `WgmmaValueSide` gives the chain's chunk step, `_KeySide` (through
    `_Chunked`) the key side's phases and views."""

    @cute.jit
    def phase_barrier(self):
        cute.arch.barrier(barrier_id=KEY_SIDE_BARRIER, number_of_threads=WARPGROUP_THREADS)

    @cute.jit
    def launch(self, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state, stream):
        update_mma, products_mma, _, _, _ = wgmma_value_side.operands()
        keys, keys_mn, square = buffered_layouts()
        tiled_mma = _make_warp_mma()
        rows = cute.cosize(keys.outer)
        square_size = cute.cosize(square.outer)

        @cute.struct
        class SharedStorage:
            # The chain's operands, two buffers each.
            keys: cute.struct.Align[cute.struct.MemRange[Float16, rows], 1024]
            queries: cute.struct.Align[cute.struct.MemRange[Float16, rows], 1024]
            t: cute.struct.Align[cute.struct.MemRange[Float16, square_size], 1024]
            p: cute.struct.Align[cute.struct.MemRange[Float16, square_size], 1024]
            values: cute.struct.Align[cute.struct.MemRange[BFloat16, NUM_BUFFERS * CHUNK * ROW_STRIDE], 128]
            chain_g: cute.struct.Align[cute.struct.MemRange[Float32, NUM_BUFFERS * CHUNK], 16]
            chain_beta: cute.struct.Align[cute.struct.MemRange[Float32, NUM_BUFFERS * CHUNK], 16]
            decay_in: cute.struct.Align[cute.struct.MemRange[Float32, NUM_BUFFERS * CHUNK], 16]
            decay_out: cute.struct.Align[cute.struct.MemRange[Float32, NUM_BUFFERS * CHUNK], 16]
            # The chain's output rows [token, v] on their way to 16-B stores (first the ranking's scratch).
            o_rows: cute.struct.Align[cute.struct.MemRange[BFloat16, CHUNK * ROW_STRIDE], 128]
            key_side: wy_prepass.KeySideStorage  # the key-side warpgroup's own

        kernel = self.kernel(
            q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state, update_mma,
            products_mma, tiled_mma, keys, keys_mn, square, SharedStorage,
        )  # fmt: skip
        self.launch_grid(kernel, [NUM_V_HEADS, new_state.shape[0], 1], SharedStorage, stream, threads=NUM_THREADS)

    @cute.kernel
    def kernel(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        state_in: cute.Tensor,
        A_log: cute.Tensor,
        a: cute.Tensor,
        dt_bias: cute.Tensor,
        b: cute.Tensor,
        cu_seqlens: cute.Tensor,
        scale: Float32,
        has_state: Int32,
        output: cute.Tensor,
        new_state: cute.Tensor,
        update_mma: cute.TiledMma,
        products_mma: cute.TiledMma,
        tiled_mma: cute.TiledMma,
        keys: cute.ComposedLayout,
        keys_mn: cute.ComposedLayout,
        square: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        head, block_y, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        buffers = (
            storage.keys.get_tensor(keys.outer, swizzle=keys.inner),  # (token, k, (1, buffer))
            storage.keys.get_tensor(keys_mn.outer, swizzle=keys_mn.inner),  # (k, token, (1, buffer))
            storage.queries.get_tensor(keys.outer, swizzle=keys.inner),
            storage.t.get_tensor(square.outer, swizzle=square.inner),  # (token i, token j, (1, buffer))
            storage.p.get_tensor(square.outer, swizzle=square.inner),
        )
        by_buffer = cute.make_layout((NUM_BUFFERS, CHUNK), stride=(CHUNK, 1))
        gates = (
            storage.chain_g.get_tensor(by_buffer),  # G, base 2
            storage.chain_beta.get_tensor(by_buffer),
            storage.decay_in.get_tensor(by_buffer),  # exp(G)
            storage.decay_out.get_tensor(by_buffer),  # exp(G_last - G)
        )
        s_values = storage.values.get_tensor(
            cute.make_layout((NUM_BUFFERS, CHUNK, HEAD_SIZE), stride=(CHUNK * ROW_STRIDE, ROW_STRIDE, 1))
        )  # (buffer, token, v)
        s_o_rows = storage.o_rows.get_tensor(cute.make_layout((CHUNK, HEAD_SIZE), stride=(ROW_STRIDE, 1)))

        seq = self.sequence_of_block(cu_seqlens, block_y, new_state.shape[0], tidx, s_o_rows)
        start, length = sequence_bounds(cu_seqlens, seq, q.shape[0])
        num_chunks = (length + CHUNK - 1) // CHUNK
        warpgroup = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        if warpgroup == KEY_WARPGROUP:
            cute.arch.setmaxregister_decrease(KEY_REGISTERS)
            self.key_side(
                q, k, v, A_log, a, dt_bias, b, start, length, num_chunks, head, tidx - CHAIN_THREADS, tiled_mma,
                storage.key_side, buffers, gates, s_values,
            )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(CHAIN_REGISTERS)
            self.chain(
                state_in, scale, has_state, output, new_state, seq, start, length, num_chunks, head, tidx,
                update_mma, products_mma, buffers, gates, s_values, s_o_rows,
            )  # fmt: skip

    @staticmethod
    def buffer_of(tensor: cute.Tensor, buffer: Int32) -> cute.Tensor:
        """An operand buffer's `buffer`, as `value_side` takes it: (x, y, 1)."""
        return tensor[None, None, (None, buffer)]

    @cute.jit
    def chain(self, state_in, scale: Float32, has_state: Int32, output, new_state, seq: Int32, start: Int32,
              length: Int32, num_chunks: Int32, head: Int32, tidx: Int32, update_mma, products_mma, buffers, gates,
              s_values, s_o_rows):  # fmt: skip
        """Warpgroups 0 and 1: the state of (sequence, head) through every chunk, each chunk's step on the buffer
        the key side has filled, then the final state."""
        s_keys, s_keys_mn, s_queries, s_t, s_p = buffers
        thr_update = update_mma.get_slice(tidx)
        state = cute.make_rmem_tensor(thr_update.partition_shape_C((HEAD_SIZE, HEAD_SIZE)), Float32)
        state_coords = thr_update.partition_C(cute.make_identity_tensor((HEAD_SIZE, HEAD_SIZE)))
        for i in cutlass.range_constexpr(cute.size(state)):
            v_row, k_col = state_coords[i]
            state[i] = state_in[seq, head, v_row, k_col] if has_state != 0 else Float32(0.0)

        for chunk in cutlass.range(num_chunks, unroll=1):
            buffer = chunk % NUM_BUFFERS
            cute.arch.barrier(barrier_id=READY_BARRIER + buffer, number_of_threads=NUM_THREADS)
            self.value_side(
                state, s_values[buffer, None, None], s_o_rows, scale, output, start + chunk * CHUNK,
                cutlass.min(length - chunk * CHUNK, CHUNK), head, update_mma, products_mma,
                self.buffer_of(s_keys, buffer), self.buffer_of(s_keys_mn, buffer), self.buffer_of(s_queries, buffer),
                self.buffer_of(s_t, buffer), self.buffer_of(s_p, buffer), tuple(g[buffer, None] for g in gates), tidx,
            )  # fmt: skip
            if chunk + NUM_BUFFERS < num_chunks:
                # The key side's generic-proxy stores overwrite what this chunk's MMAs read.
                cute.arch.fence_view_async_shared()
                cute.arch.barrier_arrive(barrier_id=FREE_BARRIER + buffer, number_of_threads=NUM_THREADS)

        # A sequence of length 0 stores a zero state, as the definition does.
        for i in cutlass.range_constexpr(cute.size(state)):
            v_row, k_col = state_coords[i]
            new_state[seq, head, v_row, k_col] = state[i] if length > 0 else Float32(0.0)

    @cute.jit
    def key_side(self, q, k, v, A_log, a, dt_bias, b, start: Int32, length: Int32, num_chunks: Int32, head: Int32,
                 ktid: Int32, tiled_mma, storage, buffers, gates, s_values):  # fmt: skip
        """Warpgroup 2 (`ktid` its thread, 0-127): every chunk's key side into the chain's buffer of its parity,
        one chunk ahead of the chain (module docstring). `storage`: its `KeySideStorage`."""
        s_keys, _, s_queries, s_t, s_p = buffers
        s_g, s_beta, s_decay_in, s_decay_out = gates
        kwarp = ktid // WARP_SIZE
        lane = ktid % WARP_SIZE
        _, raw_a, raw_b, kq, kq_raw = self.staging_views(storage, k_staged_in_kq=True)
        a16, a_diag, t16, scratch, cum_log_g, beta = self.head_views(storage, kwarp)
        a16_t = cute.make_tensor(a16.iterator, _layout(SQUARE_T_VIEW))
        t16_t = cute.make_tensor(t16.iterator, _layout(SQUARE_T_VIEW))
        copy_a, copy_b, copy_bt = _make_operand_copies(tiled_mma)
        thr_mma = tiled_mma.get_slice(lane)
        coords_sq = thr_mma.partition_C(cute.make_identity_tensor((BLOCK, BLOCK)))
        coords_rows = thr_mma.partition_C(cute.make_identity_tensor((BLOCK, SLICE_ROWS)))
        acc_sq = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK, BLOCK)), Float32)
        acc_y = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK, SLICE_ROWS)), Float32)
        g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16, num_bits_per_copy=128
        )
        neg_decay_rate = -cute.math.exp(A_log[head]) * LOG2_E
        bias = dt_bias[head]

        if num_chunks > 0:
            self.load_key_rows(g2s, q, k, a, b, raw_a, raw_b, kq_raw, start, length, 0, head, ktid)
        cute.arch.cp_async_commit_group()
        # T's blocks above the diagonal, and P's in both buffers, are never written: zeros once.
        for buffer in cutlass.range_constexpr(NUM_BUFFERS):
            self.clear_upper_blocks(t16, s_p[None, None, (0, buffer)], ktid)

        for chunk in cutlass.range(num_chunks, unroll=1):
            buffer = chunk % NUM_BUFFERS
            first = chunk * CHUNK
            tokens_here = cutlass.min(length - first, CHUNK)
            cute.arch.cp_async_wait_group(0)  # this chunk's k, q, a and b rows
            self.phase_barrier()
            self.convert_kq(kq_raw, kq_raw, kq, tokens_here, ktid)
            if kwarp == 0:
                self.chunk_gates(raw_a, raw_b, buffer, head, neg_decay_rate, bias, tokens_here, lane, cum_log_g, beta)
            if chunk >= NUM_BUFFERS:
                cute.arch.barrier(barrier_id=FREE_BARRIER + buffer, number_of_threads=NUM_THREADS)
            self.copy_values(g2s, v, s_values, start, length, first, buffer, head, ktid)
            cute.arch.cp_async_commit_group()
            self.phase_barrier()  # kq and the gates

            self.gram_tiles(
                tiled_mma, copy_a, copy_b, lane, kwarp, kq, acc_sq, coords_sq, cum_log_g, beta, a16, a_diag,
                s_p[None, None, (0, buffer)],
            )  # fmt: skip
            for i in cutlass.range_constexpr(CHUNK * (HEAD_SIZE // VEC) // WARPGROUP_THREADS):
                linear = i * WARPGROUP_THREADS + ktid
                token, piece = linear // (HEAD_SIZE // VEC), linear % (HEAD_SIZE // VEC)
                cute.local_tile(s_keys[token, None, (0, buffer)], (VEC,), (piece,)).store(
                    cute.local_tile(kq[token, None], (VEC,), (piece,)).load()
                )
                cute.local_tile(s_queries[token, None, (0, buffer)], (VEC,), (piece,)).store(
                    cute.local_tile(kq[CHUNK + token, None], (VEC,), (piece,)).load()
                )
            if ktid < CHUNK:
                g = cum_log_g[ktid]
                s_g[buffer, ktid] = g
                s_beta[buffer, ktid] = beta[ktid]
                s_decay_in[buffer, ktid] = self.decay(g)
                s_decay_out[buffer, ktid] = self.decay(cum_log_g[CHUNK - 1] - g)
            self.phase_barrier()  # kq read; A complete

            # The next chunk's rows land in kq and the other a, b stage while the inverse runs.
            if chunk + 1 < num_chunks:
                self.load_key_rows(g2s, q, k, a, b, raw_a, raw_b, kq_raw, start, length, chunk + 1, head, ktid)
            cute.arch.cp_async_commit_group()
            self.invert_unit_lower(
                tiled_mma, copy_a, copy_bt, lane, kwarp, ktid, a16_t, a_diag, t16, t16_t, scratch, acc_sq, acc_y,
                coords_sq, coords_rows,
            )  # fmt: skip
            for i in cutlass.range_constexpr(CHUNK * (CHUNK // VEC) // WARPGROUP_THREADS):
                linear = i * WARPGROUP_THREADS + ktid
                row, piece = linear // (CHUNK // VEC), linear % (CHUNK // VEC)
                cute.local_tile(s_t[row, None, (0, buffer)], (VEC,), (piece,)).store(
                    cute.local_tile(t16[row, None], (VEC,), (piece,)).load()
                )
            cute.arch.cp_async_wait_group(1)  # this chunk's values (the next chunk's rows may still be in flight)
            cute.arch.fence_view_async_shared()  # the generic-proxy stores, before the chain's MMAs read them
            cute.arch.barrier_arrive(barrier_id=READY_BARRIER + buffer, number_of_threads=NUM_THREADS)

    @cute.jit
    def load_key_rows(self, g2s, q, k, a, b, raw_a, raw_b, kq_raw, start: Int32, length: Int32, chunk: Int32,
                      head: Int32, ktid: Int32):  # fmt: skip
        """cp.async of one chunk's k and q rows into kq (bf16, converted there in place) and its a, b rows into the
        stage of its parity, as `_KeySide` loads them."""
        self.copy_head_rows(g2s, k, kq_raw, 0, start, length, chunk, head, ktid)
        self.load_q(g2s, q, kq_raw, start, length, chunk, head, ktid)
        self.copy_gate_rows(g2s, a, b, raw_a, raw_b, start, length, chunk, chunk % NUM_STAGES, ktid)

    @cute.jit
    def copy_values(self, g2s, v, s_values, start: Int32, length: Int32, first: Int32, buffer: Int32, head: Int32,
                    ktid: Int32):  # fmt: skip
        """cp.async of the chunk's values (the head's 128 per token) into the chain's [token, v] rows of `buffer`;
        tokens past the end are not copied (the chain drops them)."""
        for i in cutlass.range_constexpr(CHUNK * (HEAD_SIZE // VEC) // WARPGROUP_THREADS):
            linear = i * WARPGROUP_THREADS + ktid
            token, piece = linear // (HEAD_SIZE // VEC), linear % (HEAD_SIZE // VEC)
            if first + token < length:
                cute.copy(
                    g2s,
                    cute.local_tile(v[start + first + token, head, None], (VEC,), (piece,)),
                    cute.local_tile(s_values[buffer, token, None], (VEC,), (piece,)),
                )


class GdnPrefillFusedChainSm90:
    """Host entry: the one kernel, no workspace."""

    @cute.jit
    def __call__(self, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state, stream):
        FusedChain().launch(
            q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state, stream
        )


_COMPILED: dict[str, Callable] = {}


def compiled_for(arch: str = GPU_ARCH) -> Callable:
    """The compiled launcher for `arch` (compiled on first use; needs no GPU)."""
    fn = _COMPILED.get(arch)
    if fn is None:
        fn = _COMPILED[arch] = token_serial.compile_launcher(GdnPrefillFusedChainSm90(), arch, output_align=OUTPUT_ALIGN)
    return fn


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    return (compiled_for(arch),)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.py`'s contract at any T (for the device check and the tests). An `output` that does not start on a
    16-B boundary goes where `wgmma_value_side.run` sends it."""
    token_serial.check_inputs(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, output, new_state)
    if output.data_ptr() % OUTPUT_ALIGN:
        wgmma_value_side.run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
        return
    if new_state.shape[0] == 0:
        return
    has_state = state is not None
    compiled_for(GPU_ARCH)(
        q, k, v, state if has_state else new_state, A_log, a, dt_bias, b, cu_seqlens, token_serial.resolve_scale(scale),
        int(has_state), output, new_state,
    )  # fmt: skip


def run_as_kernel(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.py`'s dispatch with this kernel in place of the WGMMA chain's two (the candidate side)."""
    path = kernel.path_for(q.shape[0], new_state.shape[0])
    entry = run if path is wgmma_value_side else path.run
    entry(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
