"""GDN prefill's WY-prepass path with its chain on Hopper's warpgroup MMA: `wy_prepass.py`'s key side (gates,
P and T of every (chunk, head) into the workspace), then one CTA per (sequence, v-head) that holds the whole
128 x 128 state as the fp32 accumulator of two warpgroups (64 value rows each) for the whole sequence.

Why (NOTES.md, "Mapping onto the H200"): `wy_prepass.py`'s chain splits a head over four 32-row CTAs that each
reload and convert K, Q, T and P and feed `mma.sync` through `ldmatrix`; at 8192 tokens in 20-57 sequences it
is ~3/4 of the call and runs ~4x fewer row-chunks per us per SM than FlashInfer's SM90 kernel, whose state
warpgroups hold the state as WGMMA accumulators and take their B operands straight from shared memory. This
is that value side, fed by our prepass.

Per chunk of 64 tokens (`chunked_model.py`'s algebra and rounding points; decays in base 2 as `chunked.py`),
every accumulator [v, token] or [v, k]:
    Yk^T = S K^T,  Yq^T = S Q^T                        m64n64k16 x 8, A = S (fp16) in registers
    Xb^T = beta (V^T - exp(G) Yk^T)                    element-wise, into fp16 registers
    V'^T = Xb^T T^T                                    m64n64k16 x 4, A in registers
    O^T  = scale (exp(G) Yq^T + V'^T P^T)              m64n64k16 x 4, A = V' (fp16) in registers
    S    = exp(G_last) S + (V' exp(G_last - G))^T K    m64n128k16 x 4, onto the state, A in registers
Every hand-over is an element-wise conversion in the thread that holds the value: the state accumulator's
fragment is the A fragment of the products over K = 128, a products accumulator [v, token] the A fragment of
the next products and of the update over K = 64, and one 128-B-swizzled copy of the keys is both the K-major B
of `S K^T` and the MN-major B of the update (`tests/kernels/test_gdn_wgmma_value_side.py` traces them).

Loads: the next chunk's raw k and q rows (bf16), T and P (fp16) and G, beta (fp32) are copied by cp.async into
staging buffers while this chunk computes, and a chunk starts by converting them into the operand buffers; its
values go by cp.async straight into the other of two stages of [token, v] rows, which the Xb step reads in
place. The output leaves through a [token, v] tile in 16-B stores. Grid (8 v-heads, N), 256 threads, one CTA
per SM (~148 KB of shared memory); with many sequences the grid rows serve them longest first (`chunked.py`'s
`sequence_of_block`). NOTES.md has its measurements (a chunk step of ~3.8 us for a whole head).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from . import token_serial, wy_prepass
from .accurate_inverse import T_LO_PLANE, chunk_is_slow
from .chunked import CHUNK, _Chunked, sequence_bounds
from .token_serial import GPU_ARCH, HEAD_SIZE, NUM_V_HEADS, V_HEADS_PER_QK_HEAD

__all__ = [
    "NUM_THREADS",
    "WGMMA_CHAIN_MIN_SEQS",
    "WgmmaValueSide",
    "chain_config",
    "compile_only",
    "compiled_for",
    "operands",
    "run",
]

NUM_WARPGROUPS = 2  # each owns 64 of the 128 value rows of the state
NUM_THREADS = 128 * NUM_WARPGROUPS
VEC = 8  # 16-bit elements per 16-B copy
# bf16 [token, v] rows of the values and of the output tile, 272 B apart: 16-B aligned for cp.async and
# vector copies, and 68 words (4 mod 32) so that a warp's reads of an accumulator's (v, token) pattern
# (8 consecutive v, 4 token pairs) fall in distinct banks.
ROW_STRIDE = HEAD_SIZE + 8
OUTPUT_ALIGN = 16  # bytes: the output rows are stored in 16-B pieces
# The WY path takes this chain from 15 sequences (kernel.py's docstring has the measurements).
WGMMA_CHAIN_MIN_SEQS = 15

K_MAJOR = LayoutEnum.ROW_MAJOR
MN_MAJOR = LayoutEnum.COL_MAJOR


@cute.jit
def operands(warpgroups: cutlass.Constexpr = NUM_WARPGROUPS):
    """(state update MMA, products MMA, keys as the products' B, keys as the update's B, T or P as the
    products' B): the tiled MMAs of `warpgroups` x 64 state rows and the 128-B-swizzled shared-memory layouts."""
    update_mma = sm90_utils.make_trivial_tiled_mma(
        Float16, Float16, K_MAJOR.sm90_mma_major_mode(), MN_MAJOR.sm90_mma_major_mode(), Float32,
        (warpgroups, 1, 1), tiler_mn=(64, HEAD_SIZE), a_source=warpgroup.OperandSource.RMEM,
    )  # fmt: skip
    products_mma = sm90_utils.make_trivial_tiled_mma(
        Float16, Float16, K_MAJOR.sm90_mma_major_mode(), K_MAJOR.sm90_mma_major_mode(), Float32,
        (warpgroups, 1, 1), tiler_mn=(64, CHUNK), a_source=warpgroup.OperandSource.RMEM,
    )  # fmt: skip
    keys_k_major = sm90_utils.make_smem_layout_b(K_MAJOR, (HEAD_SIZE, CHUNK, HEAD_SIZE), Float16, 1)
    keys_mn_major = sm90_utils.make_smem_layout_b(MN_MAJOR, (HEAD_SIZE, HEAD_SIZE, CHUNK), Float16, 1)
    square = sm90_utils.make_smem_layout_b(K_MAJOR, (HEAD_SIZE, CHUNK, CHUNK), Float16, 1)
    return update_mma, products_mma, keys_k_major, keys_mn_major, square


class ChainBuffers(NamedTuple):
    """The chain's shared-memory tensors. A summary (`summary`) has no queries, P or output rows (None)."""

    keys: cute.Tensor  # (token, k, 1), 128-B swizzled: the K-major B of S K^T
    keys_mn: cute.Tensor  # the same storage as (k, token, 1): the MN-major B of the update
    queries: cute.Tensor | None
    t: cute.Tensor  # (token i, token j, 1)
    t_lo: cute.Tensor | None  # the same for T_lo, in a chunk that barely decays (`paired`; `accurate_inverse.py`)
    p: cute.Tensor | None
    values: cute.Tensor  # (stage, token, v): this chunk's values and the next's
    o_rows: cute.Tensor | None  # (token, v): the output rows on their way out
    gates: tuple  # G (base 2), beta, exp(G), exp(G_last - G): [CHUNK] each
    raw: tuple  # the next chunk's staged k rows, q rows (None in a summary), T and P, G and beta


class WgmmaValueSide(_Chunked):
    """Kernel 2 of this path (see the module docstring); `wy_prepass._KeySide` is kernel 1. Subclasses
    `_Chunked` for its sequence ranking, gate decay and launch only.

    `summary` (context_parallel.py's `_Summary`): the chain without outputs on a 256-row state of 4 warpgroups,
    the walk of a segment from [0; I] with the values on the first 128 rows only; `copy_chunk`, `enter_chunk`
    and `value_side` skip the queries, P and the outputs."""

    summary = False
    warpgroups = NUM_WARPGROUPS

    def __init__(self, paired: bool = False):
        """`paired`: in a chunk that barely decays, T and V'c as hi / lo pairs (`accurate_inverse.py`), with a key
        side that stores T_lo (`wy_prepass._KeySide(paired=True)`)."""
        self.paired = paired

    @property
    def threads(self) -> int:
        return 128 * self.warpgroups

    @property
    def ctas_per_sequence(self) -> int:
        return NUM_V_HEADS  # one CTA per (sequence, head)

    @property
    def state_rows(self) -> int:
        return 64 * self.warpgroups

    @cute.jit
    def shared_storage(self, keys_k_major: cute.ComposedLayout, square: cute.ComposedLayout):
        """The dynamic shared memory's struct; a summary's queries, P and output rows are empty ranges."""
        rows = cute.cosize(keys_k_major.outer)
        square_size = cute.cosize(square.outer)
        with_outputs = 0 if self.summary else 1
        paired = 1 if self.paired else 0

        @cute.struct
        class SharedStorage:
            keys: cute.struct.Align[cute.struct.MemRange[Float16, rows], 1024]
            queries: cute.struct.Align[cute.struct.MemRange[Float16, rows * with_outputs], 1024]
            t: cute.struct.Align[cute.struct.MemRange[Float16, square_size], 1024]
            t_lo: cute.struct.Align[cute.struct.MemRange[Float16, square_size * paired], 1024]
            p: cute.struct.Align[cute.struct.MemRange[Float16, square_size * with_outputs], 1024]
            # the values of this chunk and the next, copied by cp.async straight into their [token, v] rows
            values: cute.struct.Align[cute.struct.MemRange[BFloat16, 2 * CHUNK * ROW_STRIDE], 128]
            # the chunk's output rows [token, v], bf16, on their way to 16-B global stores
            o_rows: cute.struct.Align[cute.struct.MemRange[BFloat16, CHUNK * ROW_STRIDE * with_outputs], 128]
            g: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]  # G, base 2
            beta: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            decay_in: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]  # exp(G)
            decay_out: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]  # exp(G_last - G)
            # the next chunk's raw rows and key side, copied while this one computes
            raw_k: cute.struct.Align[cute.struct.MemRange[BFloat16, CHUNK * HEAD_SIZE], 128]
            raw_q: cute.struct.Align[cute.struct.MemRange[BFloat16, CHUNK * HEAD_SIZE * with_outputs], 128]
            raw_tp: cute.struct.Align[cute.struct.MemRange[Float16, (1 + with_outputs) * CHUNK * CHUNK], 128]
            raw_gates: cute.struct.Align[cute.struct.MemRange[Float32, 2 * CHUNK], 16]

        return SharedStorage

    @cute.jit
    def buffers(self, storage, keys_k_major, keys_mn_major, square) -> ChainBuffers:
        """`storage`'s tensors (see `ChainBuffers`)."""
        keys = storage.keys.get_tensor(keys_k_major.outer, swizzle=keys_k_major.inner)
        keys_mn = storage.keys.get_tensor(keys_mn_major.outer, swizzle=keys_mn_major.inner)
        queries, p, o_rows, raw_q = None, None, None, None
        if cutlass.const_expr(not self.summary):
            queries = storage.queries.get_tensor(keys_k_major.outer, swizzle=keys_k_major.inner)
        t = storage.t.get_tensor(square.outer, swizzle=square.inner)
        t_lo = None
        if cutlass.const_expr(self.paired):
            t_lo = storage.t_lo.get_tensor(square.outer, swizzle=square.inner)
        if cutlass.const_expr(not self.summary):
            p = storage.p.get_tensor(square.outer, swizzle=square.inner)
        values = storage.values.get_tensor(
            cute.make_layout((2, CHUNK, HEAD_SIZE), stride=(CHUNK * ROW_STRIDE, ROW_STRIDE, 1))
        )
        if cutlass.const_expr(not self.summary):
            o_rows = storage.o_rows.get_tensor(cute.make_layout((CHUNK, HEAD_SIZE), stride=(ROW_STRIDE, 1)))
        gates = (
            storage.g.get_tensor(cute.make_layout(CHUNK)),
            storage.beta.get_tensor(cute.make_layout(CHUNK)),
            storage.decay_in.get_tensor(cute.make_layout(CHUNK)),
            storage.decay_out.get_tensor(cute.make_layout(CHUNK)),
        )
        rows_layout = cute.make_layout((CHUNK, HEAD_SIZE), stride=(HEAD_SIZE, 1))
        raw_k = storage.raw_k.get_tensor(rows_layout)
        if cutlass.const_expr(not self.summary):
            raw_q = storage.raw_q.get_tensor(rows_layout)
        tp_count = 1 if cutlass.const_expr(self.summary) else 2
        raw = (
            raw_k,
            raw_q,
            storage.raw_tp.get_tensor(cute.make_layout((tp_count, CHUNK, CHUNK), stride=(CHUNK * CHUNK, CHUNK, 1))),
            storage.raw_gates.get_tensor(cute.make_layout((2, CHUNK), stride=(CHUNK, 1))),
        )
        return ChainBuffers(keys, keys_mn, queries, t, t_lo, p, values, o_rows, gates, raw)

    @cute.jit
    def launch(
        self, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state, ws_tp, ws_g,
        stream,
    ):  # fmt: skip
        update_mma, products_mma, keys_k_major, keys_mn_major, square = operands(self.warpgroups)
        SharedStorage = self.shared_storage(keys_k_major, square)
        kernel = self.kernel(
            q, k, v, state, cu_seqlens, scale, has_state, output, new_state, ws_tp, ws_g, update_mma, products_mma,
            keys_k_major, keys_mn_major, square, SharedStorage,
        )  # fmt: skip
        self.launch_grid(kernel, [NUM_V_HEADS, new_state.shape[0], 1], SharedStorage, stream, threads=self.threads)

    @cute.kernel
    def kernel(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        state_in: cute.Tensor,
        cu_seqlens: cute.Tensor,
        scale: Float32,
        has_state: Int32,
        output: cute.Tensor,
        new_state: cute.Tensor,
        ws_tp: cute.Tensor,
        ws_g: cute.Tensor,
        update_mma: cute.TiledMma,
        products_mma: cute.TiledMma,
        keys_k_major: cute.ComposedLayout,
        keys_mn_major: cute.ComposedLayout,
        square: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        head, block_y, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        buffers = self.buffers(storage, keys_k_major, keys_mn_major, square)

        # The output rows are first written in the first chunk's value side: scratch of the ranking.
        seq = self.sequence_of_block(cu_seqlens, block_y, new_state.shape[0], tidx, buffers.o_rows)
        start, length = sequence_bounds(cu_seqlens, seq, q.shape[0])

        # The state of (sequence, head) for the whole sequence: the update MMA's accumulator.
        thr_update = update_mma.get_slice(tidx)
        state = cute.make_rmem_tensor(thr_update.partition_shape_C((HEAD_SIZE, HEAD_SIZE)), Float32)
        state_coords = thr_update.partition_C(cute.make_identity_tensor((HEAD_SIZE, HEAD_SIZE)))
        for i in cutlass.range_constexpr(cute.size(state)):
            v_row, k_col = state_coords[i]
            state[i] = state_in[seq, head, v_row, k_col] if has_state != 0 else Float32(0.0)

        self.walk(
            state, q, k, v, ws_tp, ws_g, start, length, seq, head, buffers, scale, output, update_mma, products_mma,
            tidx,
        )  # fmt: skip

        # A sequence of length 0 stores a zero state, as the definition does.
        for i in cutlass.range_constexpr(cute.size(state)):
            v_row, k_col = state_coords[i]
            new_state[seq, head, v_row, k_col] = state[i] if length > 0 else Float32(0.0)

    @cute.jit
    def walk(
        self, state, q, k, v, ws_tp, ws_g, start: Int32, length: Int32, seq: Int32, head: Int32, buffers: ChainBuffers,
        scale: Float32, output, update_mma, products_mma, tidx: Int32,
    ):  # fmt: skip
        """`state` through every chunk of the sequence [start, start + length) (its workspace entries those of
        sequence `seq`), the next chunk's copies landing while this one computes."""
        qk_head = head // V_HEADS_PER_QK_HEAD
        num_chunks = (length + CHUNK - 1) // CHUNK
        if num_chunks > 0:
            self.copy_chunk(q, k, v, ws_tp, ws_g, start, length, 0, seq, qk_head, head, buffers, tidx)
        cute.arch.cp_async_commit_group()
        for chunk in cutlass.range(num_chunks, unroll=1):
            first = start + chunk * CHUNK
            tokens_here = cutlass.min(length - chunk * CHUNK, CHUNK)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()  # every thread's copies of this chunk have landed
            self.enter_chunk(buffers, tokens_here, tidx)
            slow = None
            if cutlass.const_expr(self.paired):
                slow = chunk_is_slow(buffers.gates[0], tokens_here)
                if slow:
                    # T_lo straight into its operand buffer (read only by this chunk's pair product, which waits for
                    # this group): the workspace's plane is written only in such a chunk.
                    self.copy_t_lo(ws_tp, wy_prepass.chunk_slot(start, chunk, seq), head, buffers.t_lo, tidx)
                    cute.arch.cp_async_commit_group()
            # The staging buffers and the other values' stage are free (enter_chunk ends with a barrier): the next
            # chunk's copies land while this one computes.
            if chunk + 1 < num_chunks:
                self.copy_chunk(q, k, v, ws_tp, ws_g, start, length, chunk + 1, seq, qk_head, head, buffers, tidx)
            cute.arch.cp_async_commit_group()
            self.value_side(
                state, buffers.values[chunk % 2, None, None], buffers, scale, output, first, tokens_here, head,
                update_mma, products_mma, slow, tidx,
            )  # fmt: skip
            # The next chunk's (generic-proxy) conversions overwrite what this one's MMAs read.
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()

    @cute.jit
    def copy_chunk(self, q, k, v, ws_tp, ws_g, start: Int32, length: Int32, chunk: Int32, seq: Int32,
                   qk_head: Int32, head: Int32, buffers: ChainBuffers, tidx: Int32):  # fmt: skip
        """Issue the cp.async copies of one chunk: k and q rows (the head's q/k head) into the staging buffers
        and v rows into the chunk's values stage, in 16-B pieces over all threads (tokens past the end are not
        copied: `enter_chunk` zeroes k and q, the value side drops their values); the chunk's T and P from the
        workspace, and its G and beta (threads 0-31)."""
        raw_k, raw_q, raw_tp, raw_gates = buffers.raw
        g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16, num_bits_per_copy=128
        )
        g2s16 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float16, num_bits_per_copy=128
        )
        g2s32 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float32, num_bits_per_copy=128
        )
        first = chunk * CHUNK
        for i in cutlass.range_constexpr(CHUNK * (HEAD_SIZE // VEC) // self.threads):
            linear = i * self.threads + tidx
            token, piece = linear // (HEAD_SIZE // VEC), linear % (HEAD_SIZE // VEC)
            if first + token < length:
                row = start + first + token
                cute.copy(g2s, cute.local_tile(k[row, qk_head, None], (VEC,), (piece,)), cute.local_tile(raw_k[token, None], (VEC,), (piece,)))
                if cutlass.const_expr(not self.summary):
                    cute.copy(g2s, cute.local_tile(q[row, qk_head, None], (VEC,), (piece,)), cute.local_tile(raw_q[token, None], (VEC,), (piece,)))
                cute.copy(g2s, cute.local_tile(v[row, head, None], (VEC,), (piece,)), cute.local_tile(buffers.values[chunk % 2, token, None], (VEC,), (piece,)))
        slot = wy_prepass.chunk_slot(start, chunk, seq)
        tp_count = cute.size(raw_tp, mode=[0])
        for i in cutlass.range_constexpr(tp_count * CHUNK * (CHUNK // VEC) // self.threads):
            linear = i * self.threads + tidx
            which, row, piece = linear // (CHUNK * CHUNK // VEC), linear // (CHUNK // VEC) % CHUNK, linear % (CHUNK // VEC)
            cute.copy(
                g2s16,
                cute.local_tile(ws_tp[slot, head, which, row, None], (VEC,), (piece,)),
                cute.local_tile(raw_tp[which, row, None], (VEC,), (piece,)),
            )
        if tidx < 2 * (CHUNK // 4):
            which, piece = tidx // (CHUNK // 4), tidx % (CHUNK // 4)
            cute.copy(
                g2s32,
                cute.local_tile(ws_g[slot, head, which, None], (4,), (piece,)),
                cute.local_tile(raw_gates[which, None], (4,), (piece,)),
            )

    @cute.jit
    def copy_t_lo(self, ws_tp: cute.Tensor, slot: Int32, head: Int32, t_lo: cute.Tensor, tidx: Int32):
        """cp.async of the chunk's T_lo plane into the swizzled operand buffer, 16-B pieces over all threads."""
        g2s16 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float16, num_bits_per_copy=128
        )
        for i in cutlass.range_constexpr(CHUNK * (CHUNK // VEC) // self.threads):
            linear = i * self.threads + tidx
            row, piece = linear // (CHUNK // VEC), linear % (CHUNK // VEC)
            cute.copy(
                g2s16,
                cute.local_tile(ws_tp[slot, head, T_LO_PLANE, row, None], (VEC,), (piece,)),
                cute.local_tile(t_lo[row, None, 0], (VEC,), (piece,)),
            )

    @cute.jit
    def enter_chunk(self, buffers: ChainBuffers, tokens_here: Int32, tidx: Int32):
        """The chunk's staged rows into their operand buffers: keys and queries (bf16 -> fp16) into the swizzled
        buffers, zero past the end of the sequence; T and P into theirs; per token G, beta, exp(G) and
        exp(G_last - G) (the workspace's G is inert past the end: log g = 0, beta = 0)."""
        raw_k, raw_q, raw_tp, raw_gates = buffers.raw
        s_g, s_beta, s_decay_in, s_decay_out = buffers.gates
        for i in cutlass.range_constexpr(CHUNK * (HEAD_SIZE // VEC) // self.threads):
            linear = i * self.threads + tidx
            token, piece = linear // (HEAD_SIZE // VEC), linear % (HEAD_SIZE // VEC)
            key_dst = cute.local_tile(buffers.keys[token, None, 0], (VEC,), (piece,))
            query_dst = None
            if cutlass.const_expr(not self.summary):
                query_dst = cute.local_tile(buffers.queries[token, None, 0], (VEC,), (piece,))
            if token < tokens_here:
                key_dst.store(cute.local_tile(raw_k[token, None], (VEC,), (piece,)).load().to(Float32).to(Float16))
                if cutlass.const_expr(not self.summary):
                    query_dst.store(cute.local_tile(raw_q[token, None], (VEC,), (piece,)).load().to(Float32).to(Float16))
            else:
                key_dst.fill(0.0)
                if cutlass.const_expr(not self.summary):
                    query_dst.fill(0.0)
        for i in cutlass.range_constexpr(CHUNK * (CHUNK // VEC) // self.threads):
            linear = i * self.threads + tidx
            row, piece = linear // (CHUNK // VEC), linear % (CHUNK // VEC)
            cute.local_tile(buffers.t[row, None, 0], (VEC,), (piece,)).store(
                cute.local_tile(raw_tp[0, row, None], (VEC,), (piece,)).load()
            )
            if cutlass.const_expr(not self.summary):
                cute.local_tile(buffers.p[row, None, 0], (VEC,), (piece,)).store(
                    cute.local_tile(raw_tp[1, row, None], (VEC,), (piece,)).load()
                )
        if tidx < CHUNK:
            g = raw_gates[0, tidx]
            s_g[tidx] = g
            s_beta[tidx] = raw_gates[1, tidx]
            s_decay_in[tidx] = self.decay(g)
            s_decay_out[tidx] = self.decay(raw_gates[0, CHUNK - 1] - g)
        cute.arch.fence_view_async_shared()  # the generic-proxy stores, before the tensor core reads them
        cute.arch.sync_threads()

    @cute.jit
    def value_side(
        self, state, s_values, buffers: ChainBuffers, scale: Float32, output, first: Int32, tokens_here: Int32,
        head: Int32, update_mma, products_mma, slow, tidx: Int32,
    ):  # fmt: skip
        """Yk, Yq, Xb, V', the chunk's output rows (bf16, the tokens of the sequence only) and the state
        update, every hand-over in registers. `s_values`: this chunk's values [token, v]; `buffers.keys` and
        `buffers.keys_mn` one buffer of keys read K-major (token, k, 1) and MN-major (k, token, 1). A summary
        only updates the state; its rows from HEAD_SIZE on (the transition's) have zero values. `slow` (a chunk
        that barely decays): V' also takes Xb T_lo^T, and the state the lo half of V'c, each one more group of MMAs
        beside the main ones, whose instructions stay as they are."""
        s_g, s_beta, s_decay_in, s_decay_out = buffers.gates
        rows = self.state_rows
        thr_update = update_mma.get_slice(tidx)
        thr_products = products_mma.get_slice(tidx)

        # The state's fp16 copy as the products' A operand (same coordinates, same order).
        state_a = cute.make_rmem_tensor(thr_products.partition_shape_A((rows, HEAD_SIZE)), Float16)
        if cutlass.const_expr(not self.summary):
            for i in cutlass.range_constexpr(cute.size(state)):
                state_a[i] = state[i].to(Float16)

        # Yk^T and Yq^T: [v, token].
        by_token_shape = thr_products.partition_shape_C((rows, CHUNK))
        by_token = thr_products.partition_C(cute.make_identity_tensor((rows, CHUNK)))  # (v, token)
        yk = cute.make_rmem_tensor(by_token_shape, Float32)
        yq = None
        if cutlass.const_expr(self.summary):
            # Yk^T alone, over two halves of K, each converted just before its MMAs: a summary thread has 128
            # registers (4 warpgroups), which the state, its whole fp16 copy and Yk^T would fill.
            t_keys = products_mma.make_fragment_B(thr_products.partition_B(buffers.keys))
            state_as_a = cute.make_tensor(state.iterator, state_a.layout)
            half = HEAD_SIZE // 32
            for h in cutlass.range_constexpr(2):
                for step in cutlass.range_constexpr(h * half, (h + 1) * half):
                    state_a[None, None, step].store(state_as_a[None, None, step].load().to(Float16))
                warpgroup.fence()
                self.product(products_mma, yk, state_a, t_keys, half, h > 0, first_step=h * half)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
        else:
            yq = cute.make_rmem_tensor(by_token_shape, Float32)
            t_keys = products_mma.make_fragment_B(thr_products.partition_B(buffers.keys))
            t_queries = products_mma.make_fragment_B(thr_products.partition_B(buffers.queries))
            warpgroup.fence()
            self.product(products_mma, yk, state_a, t_keys, HEAD_SIZE // 16, False)
            self.product(products_mma, yq, state_a, t_queries, HEAD_SIZE // 16, False)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

        # Xb^T = beta (V^T - exp(G) Yk^T), rounded: the A operand of V'^T = Xb^T T^T. Zero past the end, where
        # the values' stage holds stale bits (NaN included): the select drops them.
        over_tokens_shape = thr_products.partition_shape_A((rows, CHUNK))
        xb = cute.make_rmem_tensor(over_tokens_shape, Float16)
        for i in cutlass.range_constexpr(cute.size(yk)):
            v_row, token = by_token[i]
            if cutlass.const_expr(self.summary):
                value = s_values[token, v_row % HEAD_SIZE].to(Float32)
                value = cutlass.select_(v_row < HEAD_SIZE, value, Float32(0.0))
            else:
                value = s_values[token, v_row].to(Float32)
            real = s_beta[token] * (value - s_decay_in[token] * yk[i])
            xb[i] = Float32(cutlass.select_(token < tokens_here, real, Float32(0.0))).to(Float16)
        v_new = cute.make_rmem_tensor(by_token_shape, Float32)
        t_t = products_mma.make_fragment_B(thr_products.partition_B(buffers.t))
        warpgroup.fence()
        self.product(products_mma, v_new, xb, t_t, CHUNK // 16, False)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        if cutlass.const_expr(self.paired):
            if slow:
                cute.arch.cp_async_wait_group(1)  # T_lo's group; the next chunk's copies may still be in flight
                cute.arch.fence_view_async_shared()
                cute.arch.sync_threads()
                t_lo_t = products_mma.make_fragment_B(thr_products.partition_B(buffers.t_lo))
                warpgroup.fence()
                self.pair_product(products_mma, v_new, xb, t_lo_t)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

        # O^T = exp(G) Yq^T + V'^T P^T (scaled at the store), and V'c^T = V'^T exp(G_last - G), both rounded
        # V' operands in registers; S = exp(G_last) S + V'c^T K onto the state.
        decay_last = self.decay(s_g[CHUNK - 1])
        for i in cutlass.range_constexpr(cute.size(state)):
            state[i] = state[i] * decay_last
        t_keys_mn = update_mma.make_fragment_B(thr_update.partition_B(buffers.keys_mn))
        if cutlass.const_expr(self.paired):
            update_mma.set(warpgroup.Field.ACCUMULATE, True)
            if slow:
                # V'c's lo half onto the decayed state first, while v_new is still held: its fragment is dead again
                # before the main group's operands are made, so the pair adds no registers there.
                v_carry_lo = cute.make_rmem_tensor(thr_update.partition_shape_A((rows, CHUNK)), Float16)
                for i in cutlass.range_constexpr(cute.size(v_new)):
                    _, token = by_token[i]
                    v_carry = v_new[i] * s_decay_out[token]
                    v_carry_lo[i] = (v_carry - v_carry.to(Float16).to(Float32)).to(Float16)
                warpgroup.fence()
                self.pair_product(update_mma, state, v_carry_lo, t_keys_mn)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
        v_new_a = None
        if cutlass.const_expr(not self.summary):
            v_new_a = cute.make_rmem_tensor(over_tokens_shape, Float16)
        v_carry_a = cute.make_rmem_tensor(thr_update.partition_shape_A((rows, CHUNK)), Float16)
        for i in cutlass.range_constexpr(cute.size(v_new)):
            _, token = by_token[i]
            if cutlass.const_expr(not self.summary):
                v_new_a[i] = v_new[i].to(Float16)
            v_carry_a[i] = (v_new[i] * s_decay_out[token]).to(Float16)
            if cutlass.const_expr(not self.summary):
                yq[i] = yq[i] * s_decay_in[token]
        t_p = None
        if cutlass.const_expr(not self.summary):
            t_p = products_mma.make_fragment_B(thr_products.partition_B(buffers.p))
        warpgroup.fence()
        if cutlass.const_expr(not self.summary):
            self.product(products_mma, yq, v_new_a, t_p, CHUNK // 16, True)
        self.product(update_mma, state, v_carry_a, t_keys_mn, CHUNK // 16, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        if cutlass.const_expr(not self.summary):
            self.store_outputs(yq, by_token, buffers.o_rows, scale, output, first, tokens_here, head, tidx)

    @cute.jit
    def store_outputs(self, yq, by_token, s_o_rows, scale: Float32, output, first: Int32, tokens_here: Int32,
                      head: Int32, tidx: Int32):  # fmt: skip
        """The output rows through shared memory: each warpgroup writes its 64 values of every token, then copies
        them out in 16-B pieces (its own half of each row, so a warpgroup barrier suffices)."""
        for i in cutlass.range_constexpr(cute.size(yq)):
            v_row, token = by_token[i]
            s_o_rows[token, v_row] = (scale * yq[i]).to(BFloat16)
        warpgroup_id = tidx // 128
        cute.arch.barrier(barrier_id=1 + warpgroup_id, number_of_threads=128)
        half_pieces = HEAD_SIZE // VEC // NUM_WARPGROUPS
        for i in cutlass.range_constexpr(CHUNK * half_pieces // 128):
            linear = i * 128 + tidx % 128
            token, piece = linear // half_pieces, warpgroup_id * half_pieces + linear % half_pieces
            if token < tokens_here:
                cute.autovec_copy(
                    cute.local_tile(s_o_rows[token, None], (VEC,), (piece,)),
                    cute.local_tile(output[first + token, head, None], (VEC,), (piece,)),
                )

    @cute.jit
    def pair_product(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, t_b: cute.Tensor):
        """acc += A B over a chunk's CHUNK // 16 k16 steps, `tiled_mma` already accumulating: a lo half's product in
        a slow chunk's branch, which must leave the MMA's state as it found it (a field set inside the branch would
        not reach the code after it)."""
        for step in cutlass.range_constexpr(CHUNK // 16):
            cute.gemm(tiled_mma, acc, a[None, None, step], t_b[None, None, step, 0], acc)

    @cute.jit
    def product(
        self,
        tiled_mma: cute.TiledMma,
        acc: cute.Tensor,
        a: cute.Tensor,
        t_b: cute.Tensor,
        k_steps: cutlass.Constexpr,
        accumulate: cutlass.Constexpr,
        first_step: cutlass.Constexpr = 0,
    ):
        """acc (+)= A B over `k_steps` k16 steps from `first_step`, A from registers, B from shared memory (not
        waited for)."""
        tiled_mma.set(warpgroup.Field.ACCUMULATE, accumulate)
        for step in cutlass.range_constexpr(first_step, first_step + k_steps):
            cute.gemm(tiled_mma, acc, a[None, None, step], t_b[None, None, step, 0], acc)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)


class GdnPrefillWyWgmmaSm90(wy_prepass.GdnPrefillWyPrepassSm90):
    """Host entry: `wy_prepass`'s key-side kernel, then this value side, in one compiled call (stream order)."""

    def __init__(self):
        pass  # no configuration: the chain holds whole heads

    def chain(self):
        return WgmmaValueSide(paired=True)

    def key_side(self) -> wy_prepass._KeySide:
        return wy_prepass._KeySide(paired=True)


_COMPILED: dict[str, Callable] = {}


def compiled_for(arch: str = GPU_ARCH) -> Callable:
    """The compiled two-kernel launcher for `arch` (compiled on first use; needs no GPU)."""
    fn = _COMPILED.get(arch)
    if fn is None:
        fn = _COMPILED[arch] = token_serial.compile_launcher(
            GdnPrefillWyWgmmaSm90(), arch, wy_prepass._workspace_stand_ins(), output_align=OUTPUT_ALIGN
        )
    return fn


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    return (compiled_for(arch),)


def chain_config(num_seqs: int, output) -> wy_prepass.WyPrepassConfig | None:
    """The chain the WY path takes for `num_seqs` sequences: this one (None) from WGMMA_CHAIN_MIN_SEQS when
    `output` starts on a 16-B boundary (as `run` requires), else `wy_prepass.py`'s at its width (for
    `context_parallel.py`, which runs the WY launchers on its segments)."""
    if num_seqs >= WGMMA_CHAIN_MIN_SEQS and output.data_ptr() % OUTPUT_ALIGN == 0:
        return None
    return wy_prepass.config_for(num_seqs)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.py`'s contract (see `wy_prepass.run`), with this value side as the chain. An `output` that does
    not start on a 16-B boundary (a view, never a fresh tensor) goes to `wy_prepass.py`'s chain, which stores
    it element by element: the same values, more slowly."""
    token_serial.check_inputs(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, output, new_state)
    if output.data_ptr() % OUTPUT_ALIGN:
        wy_prepass.run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
        return
    wy_prepass.run_compiled(compiled_for(GPU_ARCH), q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
