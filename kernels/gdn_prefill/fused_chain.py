"""GDN prefill candidate `cand_fused_chain`: `wgmma_value_side.py`'s chain with the key side inside its CTA, split
as FlashInfer's SM90 kernel splits it: a producer warpgroup and a key-side warpgroup beside the two of the chain.

Why (NOTES.md, "WGMMA chain"): from 15 sequences the WY path runs two kernels, the key side of every (chunk, head)
into a workspace, then the WGMMA chain; at 8192 tokens in 20-57 sequences the key side is 36-41 us of 96-117.
Here it runs beside the chain, one chunk ahead, split over a producer and a key-side warpgroup (one warpgroup
doing both bounded the chunk step). Where it stands, measured, is in NOTES.md's fused-chain bullet.

One CTA per (sequence, v-head), 512 threads in four warpgroups:
  0, 1  the chain, `WgmmaValueSide.value_side` on chunk c: the whole 128 x 128 state in their accumulators;
  2     the key side of chunk c + 1, into the chain's buffers of its parity: A = K K^T and P = Q K^T as
        SS-WGMMA m64n64k16 from the chain's key and query buffers, both in flight (whole 64 x 64 squares: the
        upper triangles cost nothing on the tensor cores); one epilogue over both accumulators (one exp2 an
        element for both, a select for the masks, as FlashInfer's key-side warpgroup does), stored by
        `stmatrix` from the fragment: A into the inverse's fp16 and fp32 diagonal blocks, P (fp16) straight into
        the chain's buffer; T = (I + A)^-1 by `_Chunked.invert_unit_lower` (forward substitution on the diagonal
        blocks, then two doubling levels) into the chain's buffer; the chunk's values by cp.async into the
        chain's [token, v] rows;
  3     the producer: the k, q, a and b rows of chunk c + 1 staged by cp.async, converted (k, q to fp16) into
        the chain's swizzled buffers once the chain frees them, the gates (G in base 2, beta, exp(G),
        exp(G_last - G)) into the chain's arrays; then the next chunk's rows are issued.
The chain's operands are double-buffered by chunk parity; named barriers hand each buffer over, each with one
arriving and one waiting group: KQ_READY (producer -> key side), READY (key side -> chain), FREE_KEY and
FREE_PRODUCER (chain -> key side, chain -> producer: the chain has read the buffer, which is refilled two chunks
later). `setmaxnreg` gives the warpgroups CHAIN_REGISTERS, KEY_REGISTERS and PRODUCER_REGISTERS (the CTA's
registers at launch).

Same algebra and rounding points as the two-kernel path (the WGMMA Grams sum as `mma.sync` does on the H200: the
outputs are equal bit for bit). No workspace; ~215 KB of shared memory, one CTA per SM; the grid rows serve the
sequences longest first (`chunked.py`'s `sequence_of_block`).
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from . import kernel, token_serial, wgmma_value_side
from .chunked import (
    BLOCK,
    CHUNK,
    DIAG_STRIDE,
    KQ_ROWS,
    LOG2_E,
    NARROW_STRIDE,
    NUM_STAGES,
    NUM_WARPS,
    SCRATCH_STRIDE,
    SLICE_ROWS,
    SQUARE_T_VIEW,
    WARP_SIZE,
    WIDE_STRIDE,
    _layout,
    _make_operand_copies,
    _make_warp_mma,
    sequence_bounds,
)
from .token_serial import GPU_ARCH, HEAD_SIZE, NUM_V_HEADS
from .wgmma_value_side import K_MAJOR, MN_MAJOR, OUTPUT_ALIGN, ROW_STRIDE, VEC, ChainBuffers, WgmmaValueSide
from .wy_prepass import _KeySide

__all__ = ["FusedChain", "buffered_layouts", "compile_only", "compiled_for", "gram_mma", "run", "run_as_kernel"]

WARPGROUP_THREADS = 128
CHAIN_THREADS = 2 * WARPGROUP_THREADS  # warpgroups 0 and 1
KEY_WARPGROUP = 2
PRODUCER_WARPGROUP = 3
NUM_THREADS = CHAIN_THREADS + 2 * WARPGROUP_THREADS
# Per-thread registers after setmaxnreg. An increase draws only on what the CTA's decreases return (PTX: a per-CTA
# pool), so the split must fit the launch's 128 per thread: 2 x 128 x 160 + 128 x 120 + 128 x 72 = 512 x 128.
# Measured on the H200 (NOTES.md, fused chain): FlashInfer's 192 / 104 / 24 leaves the producer and the key side
# spilling, 1.3-1.4x slower; the chain gives up registers at less cost than they do.
CHAIN_REGISTERS = 160
KEY_REGISTERS = 120
PRODUCER_REGISTERS = 72
# Named barriers: 0 is the CTA's; 1 and 2 `value_side`'s, one per chain warpgroup. Each hand-over barrier has one
# arriving and one waiting group, so that no group can arrive twice in one generation.
KEY_SIDE_BARRIER = 3  # the key side's phases
READY_BARRIER = 4  # + buffer: the key side has filled T, P and the values (chain waits)
FREE_KEY_BARRIER = 6  # + buffer: the chain has read T, P and the values (key side waits)
FREE_PRODUCER_BARRIER = 8  # + buffer: the chain has read the keys, queries and gates (producer waits)
KQ_READY_BARRIER = 10  # + buffer: the producer has filled the keys, queries and gates (key side waits)
PRODUCER_BARRIER = 12  # the producer's phases
HANDOVER_THREADS = CHAIN_THREADS + WARPGROUP_THREADS  # chain and one other warpgroup
NUM_BUFFERS = 2
PIECES_PER_ROW = HEAD_SIZE // VEC
CONVERT_BATCH = 2  # 16-B pieces a producer thread holds at once (4 registers each)


def _align(dtype: type[cutlass.Numeric], elems: int, align: int):
    return cute.struct.Align[cute.struct.MemRange[dtype, elems], align]


# The producer's and the key side's own shared memory: the producer's staged k and q rows (bf16, in `kq`'s rows 0..63
# and 64..127, read through `staging_views`' kq_raw) and a, b rows; the key side's A (fp16, and fp32 diagonal
# blocks), T and the inverse's scratch (`head_views`, whose G and beta views go unused: the gates live in the chain's
# arrays). Given as a dict: this module's annotations are strings (`from __future__ import annotations`), which
# `cute.struct` does not evaluate.
KeySideStorage = cute.struct(
    type(
        "KeySideStorage",
        (),
        {
            "__annotations__": {
                "raw_a": _align(BFloat16, NUM_STAGES * CHUNK * NUM_V_HEADS, 128),
                "raw_b": _align(BFloat16, NUM_STAGES * CHUNK * NUM_V_HEADS, 128),
                "kq": _align(Float16, KQ_ROWS * WIDE_STRIDE, 128),
                "a16": _align(Float16, CHUNK * NARROW_STRIDE, 128),
                "a_diag": _align(Float32, CHUNK * DIAG_STRIDE, 128),
                "t16": _align(Float16, CHUNK * NARROW_STRIDE, 128),
                "scratch": _align(Float16, NUM_WARPS * BLOCK * SCRATCH_STRIDE, 128),
                "cum_log_g": _align(Float32, CHUNK, 16),
                "beta": _align(Float32, CHUNK, 16),
            }
        },
    )
)


@cute.jit
def buffered_layouts():
    """(keys read K-major, keys read MN-major, T or P): `wgmma_value_side.operands()`'s shared-memory layouts with
    a buffer mode, (x, y, (1, buffer)); a buffer's two views of the keys address the same elements."""
    return (
        sm90_utils.make_smem_layout_b(K_MAJOR, (HEAD_SIZE, CHUNK, HEAD_SIZE), Float16, NUM_BUFFERS),
        sm90_utils.make_smem_layout_b(MN_MAJOR, (HEAD_SIZE, HEAD_SIZE, CHUNK), Float16, NUM_BUFFERS),
        sm90_utils.make_smem_layout_b(K_MAJOR, (HEAD_SIZE, CHUNK, CHUNK), Float16, NUM_BUFFERS),
    )


@cute.jit
def gram_mma():
    """The key side's Gram products, [token i, token j] = row_i . row_j over the head dimension: one warpgroup,
    m64n64k16, both operands K-major from shared memory (a K-major buffer of 64 rows of keys or queries is the
    same canonical layout as an A or a B operand)."""
    return sm90_utils.make_trivial_tiled_mma(
        Float16, Float16, K_MAJOR.sm90_mma_major_mode(), K_MAJOR.sm90_mma_major_mode(), Float32, (1, 1, 1),
        tiler_mn=(CHUNK, CHUNK),
    )  # fmt: skip


class FusedChain(WgmmaValueSide, _KeySide):
    """The kernel of the module docstring. `WgmmaValueSide` gives the chain's chunk step, `_KeySide` (through
    `_Chunked`) the gates, the inverse, the loads and the views."""

    @cute.jit
    def phase_barrier(self):
        cute.arch.barrier(barrier_id=KEY_SIDE_BARRIER, number_of_threads=WARPGROUP_THREADS)

    @cute.jit
    def launch(self, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state, stream):
        update_mma, products_mma, _, _, _ = wgmma_value_side.operands()
        keys, keys_mn, square = buffered_layouts()
        tiled_mma = _make_warp_mma()
        grams = gram_mma()
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
            key_side: KeySideStorage  # the key-side warpgroup's own

        kernel = self.kernel(
            q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state, update_mma,
            products_mma, tiled_mma, grams, keys, keys_mn, square, SharedStorage,
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
        grams: cute.TiledMma,
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
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        if warpgroup_idx == PRODUCER_WARPGROUP:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            self.producer(
                q, k, A_log, a, dt_bias, b, start, length, num_chunks, head, tidx - CHAIN_THREADS - WARPGROUP_THREADS,
                storage.key_side, buffers, gates,
            )  # fmt: skip
        elif warpgroup_idx == KEY_WARPGROUP:
            cute.arch.setmaxregister_decrease(KEY_REGISTERS)
            self.key_side(
                v, start, length, num_chunks, head, tidx - CHAIN_THREADS, tiled_mma, grams, storage.key_side,
                buffers, gates, s_values,
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
            cute.arch.barrier(barrier_id=READY_BARRIER + buffer, number_of_threads=HANDOVER_THREADS)
            chunk_buffers = ChainBuffers(
                keys=self.buffer_of(s_keys, buffer), keys_mn=self.buffer_of(s_keys_mn, buffer),
                queries=self.buffer_of(s_queries, buffer), t=self.buffer_of(s_t, buffer), p=self.buffer_of(s_p, buffer),
                values=s_values, o_rows=s_o_rows, gates=tuple(g[buffer, None] for g in gates), raw=(),
            )  # fmt: skip
            self.value_side(
                state, s_values[buffer, None, None], chunk_buffers, scale, output, start + chunk * CHUNK,
                cutlass.min(length - chunk * CHUNK, CHUNK), head, update_mma, products_mma, tidx,
            )  # fmt: skip
            if chunk + NUM_BUFFERS < num_chunks:
                # The key side's and the producer's generic-proxy stores overwrite what this chunk's MMAs read.
                cute.arch.fence_view_async_shared()
                cute.arch.barrier_arrive(barrier_id=FREE_KEY_BARRIER + buffer, number_of_threads=HANDOVER_THREADS)
                cute.arch.barrier_arrive(barrier_id=FREE_PRODUCER_BARRIER + buffer, number_of_threads=HANDOVER_THREADS)

        # A sequence of length 0 stores a zero state, as the definition does.
        for i in cutlass.range_constexpr(cute.size(state)):
            v_row, k_col = state_coords[i]
            new_state[seq, head, v_row, k_col] = state[i] if length > 0 else Float32(0.0)

    @cute.jit
    def producer(self, q, k, A_log, a, dt_bias, b, start: Int32, length: Int32, num_chunks: Int32, head: Int32,
                 ptid: Int32, storage, buffers, gates):  # fmt: skip
        """Warpgroup 3 (`ptid` its thread, 0-127): every chunk's k, q, a and b rows staged by cp.async, then, once
        the chain has freed the buffer of the chunk's parity, k and q converted into it (fp16, swizzled) and the
        gates (G, beta, exp(G), exp(G_last - G)) into the chain's arrays; the next chunk's rows are issued as soon
        as these are read."""
        s_keys, _, s_queries, _, _ = buffers
        s_g, s_beta, s_decay_in, s_decay_out = gates
        pwarp = cute.arch.make_warp_uniform(ptid // WARP_SIZE)
        lane = ptid % WARP_SIZE
        _, raw_a, raw_b, _, kq_raw = self.staging_views(storage, k_staged_in_kq=True)
        g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16, num_bits_per_copy=128
        )
        neg_decay_rate = -cute.math.exp(A_log[head]) * LOG2_E
        bias = dt_bias[head]

        if num_chunks > 0:
            self.load_key_rows(g2s, q, k, a, b, raw_a, raw_b, kq_raw, start, length, 0, head, ptid)
        cute.arch.cp_async_commit_group()
        for chunk in cutlass.range(num_chunks, unroll=1):
            buffer = chunk % NUM_BUFFERS
            tokens_here = cutlass.min(length - chunk * CHUNK, CHUNK)
            cute.arch.cp_async_wait_group(0)  # this chunk's rows
            if chunk >= NUM_BUFFERS:
                cute.arch.barrier(barrier_id=FREE_PRODUCER_BARRIER + buffer, number_of_threads=HANDOVER_THREADS)
            self.producer_barrier()  # every thread's rows have landed; the buffer is free
            if pwarp == 0:
                self.chunk_gates(raw_a, raw_b, chunk % NUM_STAGES, head, neg_decay_rate, bias, tokens_here, lane,
                                 s_g[buffer, None], s_beta[buffer, None])  # fmt: skip
            self.convert_rows(kq_raw, 0, self.buffer_of(s_keys, buffer), tokens_here, ptid)
            self.convert_rows(kq_raw, CHUNK, self.buffer_of(s_queries, buffer), tokens_here, ptid)
            self.producer_barrier()  # the staged rows are read; G is complete
            if chunk + 1 < num_chunks:
                self.load_key_rows(g2s, q, k, a, b, raw_a, raw_b, kq_raw, start, length, chunk + 1, head, ptid)
            cute.arch.cp_async_commit_group()
            if ptid < CHUNK:
                g = s_g[buffer, ptid]
                s_decay_in[buffer, ptid] = self.decay(g)
                s_decay_out[buffer, ptid] = self.decay(s_g[buffer, CHUNK - 1] - g)
            cute.arch.fence_view_async_shared()  # the converted rows, before the Gram and chain MMAs read them
            cute.arch.barrier_arrive(barrier_id=KQ_READY_BARRIER + buffer, number_of_threads=2 * WARPGROUP_THREADS)

    @cute.jit
    def producer_barrier(self):
        cute.arch.barrier(barrier_id=PRODUCER_BARRIER, number_of_threads=WARPGROUP_THREADS)

    @cute.jit
    def key_side(self, v, start: Int32, length: Int32, num_chunks: Int32, head: Int32, ktid: Int32, tiled_mma,
                 grams, storage, buffers, gates, s_values):  # fmt: skip
        """Warpgroup 2 (`ktid` its thread, 0-127): every chunk's P and T into the chain's buffers of its parity,
        from the keys, queries and gates the producer has put there, and the chunk's values by cp.async; one
        chunk ahead of the chain (module docstring). `storage`: its `KeySideStorage`."""
        s_keys, _, s_queries, s_t, s_p = buffers
        s_g, s_beta, _, _ = gates
        kwarp = ktid // WARP_SIZE
        kwarp_uniform = cute.arch.make_warp_uniform(kwarp)
        lane = ktid % WARP_SIZE
        a16, a_diag, t16, scratch, _, _ = self.head_views(storage, kwarp)
        a16_t = cute.make_tensor(a16.iterator, _layout(SQUARE_T_VIEW))
        t16_t = cute.make_tensor(t16.iterator, _layout(SQUARE_T_VIEW))
        copy_a, _, copy_bt = _make_operand_copies(tiled_mma)
        thr_mma = tiled_mma.get_slice(lane)
        coords_sq = thr_mma.partition_C(cute.make_identity_tensor((BLOCK, BLOCK)))
        coords_rows = thr_mma.partition_C(cute.make_identity_tensor((BLOCK, SLICE_ROWS)))
        acc_sq = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK, BLOCK)), Float32)
        acc_y = cute.make_rmem_tensor(thr_mma.partition_shape_C((BLOCK, SLICE_ROWS)), Float32)
        thr_grams = grams.get_slice(ktid)
        gram_a = cute.make_rmem_tensor(thr_grams.partition_shape_C((CHUNK, CHUNK)), Float32)
        gram_p = cute.make_rmem_tensor(thr_grams.partition_shape_C((CHUNK, CHUNK)), Float32)
        # The Gram squares leave by `stmatrix` from the accumulator fragment (8 x 8 fp16 tiles, 16-B rows).
        gram_store = cute.make_tiled_copy_C(cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), Float16), grams)
        g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16, num_bits_per_copy=128
        )
        # T's blocks above the diagonal are never written by the inverse: zeros once.
        for i in cutlass.range_constexpr(CHUNK * CHUNK // WARPGROUP_THREADS):
            linear = i * WARPGROUP_THREADS + ktid
            t16[linear // CHUNK, linear % CHUNK] = Float16(0.0)

        for chunk in cutlass.range(num_chunks, unroll=1):
            buffer = chunk % NUM_BUFFERS
            if chunk >= NUM_BUFFERS:
                cute.arch.barrier(barrier_id=FREE_KEY_BARRIER + buffer, number_of_threads=HANDOVER_THREADS)
            self.copy_values(g2s, v, s_values, start, length, chunk * CHUNK, buffer, head, ktid)
            cute.arch.cp_async_commit_group()
            cute.arch.barrier(barrier_id=KQ_READY_BARRIER + buffer, number_of_threads=2 * WARPGROUP_THREADS)

            self.grams_of(grams, thr_grams, gram_a, gram_p, self.buffer_of(s_keys, buffer),
                          self.buffer_of(s_queries, buffer))  # fmt: skip
            self.gram_epilogue(
                gram_a, gram_p, thr_grams, gram_store, ktid, kwarp_uniform, s_g[buffer, None], s_beta[buffer, None],
                a16, a_diag, s_p[None, None, (0, buffer)],
            )  # fmt: skip
            self.phase_barrier()  # A complete

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
            cute.arch.cp_async_wait_group(0)  # this chunk's values
            cute.arch.fence_view_async_shared()  # the generic-proxy stores, before the chain's MMAs read them
            cute.arch.barrier_arrive(barrier_id=READY_BARRIER + buffer, number_of_threads=HANDOVER_THREADS)

    @cute.jit
    def convert_rows(self, kq_raw, row0: cutlass.Constexpr, dst, tokens_here: Int32, ptid: Int32):
        """The chunk's 64 staged bf16 rows at kq_raw's rows row0.. into `dst` (token, k, 1) as fp16, zero past the
        end; CONVERT_BATCH pieces of a thread loaded before they are stored (the producer's registers are few)."""
        rounds = CHUNK * PIECES_PER_ROW // WARPGROUP_THREADS
        for batch in cutlass.range_constexpr(rounds // CONVERT_BATCH):
            pieces = [None] * CONVERT_BATCH
            for n in cutlass.range_constexpr(CONVERT_BATCH):
                linear = (batch * CONVERT_BATCH + n) * WARPGROUP_THREADS + ptid
                token, piece = linear // PIECES_PER_ROW, linear % PIECES_PER_ROW
                pieces[n] = cute.local_tile(kq_raw[row0 + token, None], (VEC,), (piece,)).load()
            for n in cutlass.range_constexpr(CONVERT_BATCH):
                linear = (batch * CONVERT_BATCH + n) * WARPGROUP_THREADS + ptid
                token, piece = linear // PIECES_PER_ROW, linear % PIECES_PER_ROW
                dst_piece = cute.local_tile(dst[token, None, 0], (VEC,), (piece,))
                if token < tokens_here:
                    dst_piece.store(pieces[n].to(Float32).to(Float16))
                else:
                    dst_piece.fill(0.0)

    @cute.jit
    def grams_of(self, grams, thr_grams, acc_a, acc_p, keys, queries):
        """acc_a = K K^T and acc_p = Q K^T (64 x 64, fp32) over the head dimension: SS-WGMMA, both in flight, one
        wait."""
        t_keys_a = grams.make_fragment_A(thr_grams.partition_A(keys))
        t_queries = grams.make_fragment_A(thr_grams.partition_A(queries))
        t_keys_b = grams.make_fragment_B(thr_grams.partition_B(keys))
        warpgroup.fence()
        for acc, t_a in ((acc_a, t_keys_a), (acc_p, t_queries)):
            grams.set(warpgroup.Field.ACCUMULATE, False)
            for step in cutlass.range_constexpr(HEAD_SIZE // 16):
                cute.gemm(grams, acc, t_a[None, None, step, 0], t_keys_b[None, None, step, 0], acc)
                grams.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def gram_epilogue(self, acc_a, acc_p, thr_grams, gram_store, ktid: Int32, warp_idx: Int32, cum_log_g, beta,
                      a16, a_diag, p16):  # fmt: skip
        """A[i, j] = beta_i exp(G_i - G_j) (k_i . k_j) where j < i and P[i, j] = exp(G_i - G_j) (q_i . k_j) where
        j <= i, else 0 (`a_tile_epilogue`'s and `p_tile_epilogue`'s arithmetic), on the accumulators' fragment:
        element e = c + 2 r + 4 n of a thread is (row0 + 8 r, col0 + 8 n + c); one exp2 an element serves both,
        a thread's two G_i and beta_i are loaded once and every load comes before any store (every warp does the
        same work: a select masks the whole square). A (fp16) into a16 and P into the chain's buffer `p16` by
        `stmatrix`; the warp's diagonal block of A (fp32) into a_diag."""
        row0, col0 = thr_grams.partition_C(cute.make_identity_tensor((CHUNK, CHUNK)))[0]
        g_rows = (cum_log_g[row0], cum_log_g[row0 + 8])
        beta_rows = (beta[row0], beta[row0 + 8])
        p_values = cute.make_rmem_tensor(acc_p.layout, Float16)
        for group in cutlass.range_constexpr(CHUNK // 8):
            for c in cutlass.range_constexpr(2):
                j = col0 + 8 * group + c
                g_col = cum_log_g[j]
                for r in cutlass.range_constexpr(2):
                    e = c + 2 * r + 4 * group
                    i = row0 + 8 * r
                    decay = self.decay(cutlass.min(g_rows[r] - g_col, Float32(0.0)))
                    acc_a[e] = Float32(cutlass.select_(j < i, beta_rows[r] * decay * acc_a[e], Float32(0.0)))
                    p_values[e] = Float32(cutlass.select_(j <= i, decay * acc_p[e], Float32(0.0))).to(Float16)
        a_values = cute.make_rmem_tensor(acc_a.layout, Float16)
        a_values.store(acc_a.load().to(Float16))
        thr_store = gram_store.get_slice(ktid)
        cute.copy(gram_store, thr_store.retile(a_values), thr_store.partition_D(a16))
        cute.copy(gram_store, thr_store.retile(p_values), thr_store.partition_D(p16))
        for group in cutlass.range_constexpr(CHUNK // 8):
            if group // 2 == warp_idx:
                for r in cutlass.range_constexpr(2):
                    for c in cutlass.range_constexpr(2):
                        a_diag[row0 + 8 * r, col0 + 8 * (group % 2) + c] = acc_a[c + 2 * r + 4 * group]

    @cute.jit
    def load_key_rows(self, g2s, q, k, a, b, raw_a, raw_b, kq_raw, start: Int32, length: Int32, chunk: Int32,
                      head: Int32, ptid: Int32):  # fmt: skip
        """cp.async of one chunk's k and q rows into kq_raw's rows 0..63 and 64..127 (bf16) and its a, b rows into
        the stage of its parity, as `_KeySide` loads them (`ptid`: the producer's thread)."""
        self.copy_head_rows(g2s, k, kq_raw, 0, start, length, chunk, head, ptid)
        self.load_q(g2s, q, kq_raw, start, length, chunk, head, ptid)
        self.copy_gate_rows(g2s, a, b, raw_a, raw_b, start, length, chunk, chunk % NUM_STAGES, ptid)

    @cute.jit
    def copy_values(self, g2s, v, s_values, start: Int32, length: Int32, first: Int32, buffer: Int32, head: Int32,
                    ktid: Int32):  # fmt: skip
        """cp.async of the chunk's values (the head's 128 per token) into the chain's [token, v] rows of `buffer`;
        tokens past the end are not copied (the chain drops them)."""
        for i in cutlass.range_constexpr(CHUNK * PIECES_PER_ROW // WARPGROUP_THREADS):
            linear = i * WARPGROUP_THREADS + ktid
            token, piece = linear // PIECES_PER_ROW, linear % PIECES_PER_ROW
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
        fn = _COMPILED[arch] = token_serial.compile_launcher(
            GdnPrefillFusedChainSm90(), arch, output_align=OUTPUT_ALIGN
        )
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
