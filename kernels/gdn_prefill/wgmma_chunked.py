"""GDN prefill on Hopper's warpgroup MMA (design v3, NOTES.md), steps 1-4: every sequence's chunks in one CTA
per (sequence, v-head), the 128 x 128 state an fp32 WGMMA accumulator of two warpgroups (64 value rows
each) for the whole sequence. Candidate v3.3 (`candidate_wgmma_v3.py`); not yet `kernel.py`'s.

Per chunk of 64 tokens, with `chunked_model.py`'s algebra and rounding points (KERNEL precision):

Loads and gates: the raw bf16 rows of k, q, v and the 16-B rows of `a` and `b` of the next chunk are copied
by cp.async into staging buffers while this chunk computes (v3.1). A chunk starts by converting its own: keys
and queries (bf16 -> fp16) into 128-B-swizzled shared memory, the values (bf16) into [v, token]; warp 0 turns
`a`, `b`, `A_log`, `dt_bias` into log g and beta (two tokens per lane), G = cumsum(log g) by a shuffle scan,
and exp(G), exp(G_last - G) per token for the value side. Tokens past the end of the sequence are
k = q = v = 0, log g = 0, beta = 0 (inert, as in the model).
Key side (step 3):
    K K^T (warpgroup 0) and Q K^T (warpgroup 1): m64n64k16 x 8, both operands from shared memory
    A = strict_tril(beta exp(G_i - G_j) K K^T),  P = tril(exp(G_i - G_j) Q K^T)   element-wise, gated
    T = (I + A)^-1: 16 x 16 diagonal blocks by forward substitution (fp32), then two doubling levels
        (SIMT fp32 products of fp16-rounded operands), as `chunked_model.invert_unit_lower`
Value side (steps 1-2), every accumulator [v, token] or [v, k]:
    Yk^T = S K^T,  Yq^T = S Q^T                        m64n64k16 x 8, A = S (fp16) in registers
    Xb^T = beta (V^T - exp(G) Yk^T)                    element-wise, into fp16 registers
    V'^T = Xb^T T^T                                    m64n64k16 x 4, A in registers
    O^T  = scale (exp(G) Yq^T + V'^T P^T)              m64n64k16 x 4, A = V' (fp16) in registers
    S    = exp(G_last) S + (V' exp(G_last - G))^T K    m64n128k16 x 4, onto the state, A in registers

Layout facts that make every hand-over an element-wise conversion in the thread that holds the value
(no shuffles, no shared memory), each checked on CuTe's own layouts by the CPU tests:
- the state accumulator's fragment holds exactly the coordinates of the products' A fragment over
  K = 128, in the same order;
- a products accumulator [v, token] is likewise the A fragment of the products and of the state
  update over K = 64 tokens;
- one 128-B-swizzled copy of the keys (k contiguous) is the K-major A and B of the Gram products, the
  K-major B of `K S^T` and the MN-major B of the state update.
A prototype: a SIMT inverse, no overlap of one chunk's products with the next (NOTES.md says what comes next). Same contract as `kernel.py`'s `run` through `token_serial`'s host launcher.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .chunked import sequence_bounds
from .token_serial import HEAD_SIZE, NUM_V_HEADS, SOFTPLUS_THRESHOLD, V_HEADS_PER_QK_HEAD

__all__ = ["BLOCK", "CHUNK", "NUM_THREADS", "NUM_WARPGROUPS", "WgmmaChunked", "operands"]

CHUNK = 64  # tokens per chunk
BLOCK = 16  # diagonal blocks of T solved directly; the rest by two doubling levels
NUM_WARPGROUPS = 2  # each owns 64 of the 128 value rows of the state
NUM_THREADS = 128 * NUM_WARPGROUPS
SQUARE_STRIDE = CHUNK + 1  # fp32 [token, token] work arrays of the inverse (odd: no bank conflicts by column)
VEC = 8  # 16-bit elements per 16-B global load
VALUES_STRIDE = CHUNK + 8  # bf16 [v, token] staging of the values: a thread's token pairs, rows 144 B apart

K_MAJOR = LayoutEnum.ROW_MAJOR
MN_MAJOR = LayoutEnum.COL_MAJOR


@cute.jit
def operands():
    """(state update MMA, products MMA, Gram MMA, keys as the products' B, keys as the update's B, keys or
    queries as the Gram A, T or P as the products' B): the tiled MMAs and the 128-B-swizzled
    shared-memory layouts."""
    update_mma = sm90_utils.make_trivial_tiled_mma(
        Float16, Float16, K_MAJOR.sm90_mma_major_mode(), MN_MAJOR.sm90_mma_major_mode(), Float32,
        (NUM_WARPGROUPS, 1, 1), tiler_mn=(64, HEAD_SIZE), a_source=warpgroup.OperandSource.RMEM,
    )  # fmt: skip
    products_mma = sm90_utils.make_trivial_tiled_mma(
        Float16, Float16, K_MAJOR.sm90_mma_major_mode(), K_MAJOR.sm90_mma_major_mode(), Float32,
        (NUM_WARPGROUPS, 1, 1), tiler_mn=(64, CHUNK), a_source=warpgroup.OperandSource.RMEM,
    )  # fmt: skip
    # one warpgroup per Gram product (warpgroup 0: K K^T, warpgroup 1: Q K^T)
    gram_mma = sm90_utils.make_trivial_tiled_mma(
        Float16, Float16, K_MAJOR.sm90_mma_major_mode(), K_MAJOR.sm90_mma_major_mode(), Float32,
        (1, 1, 1), tiler_mn=(CHUNK, CHUNK),
    )  # fmt: skip
    keys_k_major = sm90_utils.make_smem_layout_b(K_MAJOR, (HEAD_SIZE, CHUNK, HEAD_SIZE), Float16, 1)
    keys_mn_major = sm90_utils.make_smem_layout_b(MN_MAJOR, (HEAD_SIZE, HEAD_SIZE, CHUNK), Float16, 1)
    gram_a = sm90_utils.make_smem_layout_a(K_MAJOR, (CHUNK, CHUNK, HEAD_SIZE), Float16, 1)
    square = sm90_utils.make_smem_layout_b(K_MAJOR, (HEAD_SIZE, CHUNK, CHUNK), Float16, 1)
    return update_mma, products_mma, gram_mma, keys_k_major, keys_mn_major, gram_a, square


class WgmmaChunked:
    """The kernel, launched by `token_serial.GdnPrefillSm90` with `run`'s arguments: grid (8 v-heads, N
    sequences), 256 threads; see the module docstring."""

    # (rows, columns) of the doubling products' output each thread computes per step, for the levels of
    # 16 and 32: each loaded word of T, A or X serves two products (v3.2: 1.08x over one output per
    # thread and step, bitwise the same outputs; every element's sum runs over m in the same order).
    doubling_tiles = ((1, 2), (2, 2))

    @cute.jit
    def launch(self, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state, stream):
        update_mma, products_mma, gram_mma, keys_k_major, keys_mn_major, gram_a, square = operands()
        rows = cute.cosize(keys_k_major.outer)
        square_size = cute.cosize(square.outer)

        @cute.struct
        class SharedStorage:
            keys: cute.struct.Align[cute.struct.MemRange[Float16, rows], 1024]
            queries: cute.struct.Align[cute.struct.MemRange[Float16, rows], 1024]
            t: cute.struct.Align[cute.struct.MemRange[Float16, square_size], 1024]
            p: cute.struct.Align[cute.struct.MemRange[Float16, square_size], 1024]
            a: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK * SQUARE_STRIDE], 16]  # A, unrounded
            t_work: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK * SQUARE_STRIDE], 16]  # T, rounded
            x: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK * SQUARE_STRIDE], 16]  # doubling scratch
            values: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, HEAD_SIZE * VALUES_STRIDE], 16]
            g: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            beta: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            decay_in: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]  # exp(G)
            decay_out: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]  # exp(G_last - G)
            # the next chunk's raw rows, copied while this one computes
            raw_k: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, CHUNK * HEAD_SIZE], 128]
            raw_q: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, CHUNK * HEAD_SIZE], 128]
            raw_v: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, CHUNK * HEAD_SIZE], 128]
            raw_a: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, CHUNK * NUM_V_HEADS], 16]
            raw_b: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, CHUNK * NUM_V_HEADS], 16]

        self.kernel(
            q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state, update_mma,
            products_mma, gram_mma, keys_k_major, keys_mn_major, gram_a, square, SharedStorage,
        ).launch(
            grid=[NUM_V_HEADS, new_state.shape[0], 1], block=[NUM_THREADS, 1, 1], smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )  # fmt: skip

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
        gram_mma: cute.TiledMma,
        keys_k_major: cute.ComposedLayout,
        keys_mn_major: cute.ComposedLayout,
        gram_a: cute.ComposedLayout,
        square: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        head, seq, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        s_keys = storage.keys.get_tensor(keys_k_major.outer, swizzle=keys_k_major.inner)  # (token, k, 1)
        s_queries = storage.queries.get_tensor(keys_k_major.outer, swizzle=keys_k_major.inner)
        s_t = storage.t.get_tensor(square.outer, swizzle=square.inner)  # (token, token', 1)
        s_p = storage.p.get_tensor(square.outer, swizzle=square.inner)
        square_layout = cute.make_layout((CHUNK, CHUNK), stride=(SQUARE_STRIDE, 1))
        s_a = storage.a.get_tensor(square_layout)
        s_tw = storage.t_work.get_tensor(square_layout)
        s_x = storage.x.get_tensor(square_layout)
        s_values = storage.values.get_tensor(cute.make_layout((HEAD_SIZE, CHUNK), stride=(VALUES_STRIDE, 1)))
        s_g = storage.g.get_tensor(cute.make_layout(CHUNK))
        s_beta = storage.beta.get_tensor(cute.make_layout(CHUNK))
        s_decay_in = storage.decay_in.get_tensor(cute.make_layout(CHUNK))
        s_decay_out = storage.decay_out.get_tensor(cute.make_layout(CHUNK))
        rows_layout = cute.make_layout((CHUNK, HEAD_SIZE), stride=(HEAD_SIZE, 1))
        gates_layout = cute.make_layout((CHUNK, NUM_V_HEADS), stride=(NUM_V_HEADS, 1))
        raw = (
            storage.raw_k.get_tensor(rows_layout),
            storage.raw_q.get_tensor(rows_layout),
            storage.raw_v.get_tensor(rows_layout),
            storage.raw_a.get_tensor(gates_layout),
            storage.raw_b.get_tensor(gates_layout),
        )
        g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.BFloat16, num_bits_per_copy=128
        )

        start, length = sequence_bounds(cu_seqlens, seq, q.shape[0])
        qk_head = head // V_HEADS_PER_QK_HEAD
        neg_decay_rate = -cute.math.exp(A_log[head], fastmath=False)
        bias = dt_bias[head]

        # The state of (sequence, head) for the whole sequence: the update MMA's accumulator.
        thr_update = update_mma.get_slice(tidx)
        state = cute.make_rmem_tensor(thr_update.partition_shape_C((HEAD_SIZE, HEAD_SIZE)), Float32)
        state_coords = thr_update.partition_C(cute.make_identity_tensor((HEAD_SIZE, HEAD_SIZE)))
        for i in cutlass.range_constexpr(cute.size(state)):
            v_row, k_col = state_coords[i]
            state[i] = state_in[seq, head, v_row, k_col] if has_state != 0 else Float32(0.0)

        # T's blocks above the diagonal are never written (`invert`): zero both copies of T once.
        for i in cutlass.range_constexpr(CHUNK * CHUNK // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            s_tw[linear // CHUNK, linear % CHUNK] = Float32(0.0)
            s_t[linear // CHUNK, linear % CHUNK, 0] = Float16(0.0)

        num_chunks = (length + CHUNK - 1) // CHUNK
        if num_chunks > 0:
            self.copy_chunk(g2s, q, k, v, a, b, start, length, 0, qk_head, head, raw, tidx)
        cute.arch.cp_async_commit_group()
        for chunk in cutlass.range(num_chunks, unroll=1):
            first = start + chunk * CHUNK
            tokens_here = cutlass.min(length - chunk * CHUNK, CHUNK)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()  # every thread's copies of this chunk have landed
            self.enter_chunk(raw, tokens_here, head, neg_decay_rate, bias, s_keys, s_queries, s_values, s_g, s_beta,
                             s_decay_in, s_decay_out, tidx)  # fmt: skip
            # The staging buffers are free again (enter_chunk ends with a barrier): the next chunk's copies
            # land while this one computes.
            if chunk + 1 < num_chunks:
                self.copy_chunk(g2s, q, k, v, a, b, start, length, chunk + 1, qk_head, head, raw, tidx)
            cute.arch.cp_async_commit_group()
            self.key_side(gram_mma, gram_a, storage, s_g, s_beta, s_a, s_p, tidx)
            self.invert(s_a, s_tw, s_x, s_t, tidx)
            self.value_side(
                state, s_values, scale, output, first, tokens_here, head, update_mma, products_mma, keys_k_major,
                keys_mn_major, storage, s_t, s_p, s_g, s_beta, s_decay_in, s_decay_out, tidx,
            )  # fmt: skip
            # The next chunk's (generic-proxy) loads overwrite what this one's MMAs read.
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()

        # A sequence of length 0 stores a zero state, as the definition does.
        for i in cutlass.range_constexpr(cute.size(state)):
            v_row, k_col = state_coords[i]
            new_state[seq, head, v_row, k_col] = state[i] if length > 0 else Float32(0.0)

    @cute.jit
    def copy_chunk(self, g2s, q, k, v, a, b, start: Int32, length: Int32, chunk: Int32, qk_head: Int32, head: Int32,
                   raw, tidx: Int32):  # fmt: skip
        """Issue the cp.async copies of one chunk's raw rows into the staging buffers: k and q (the head's q/k
        head) and v (the v-head) in 16-B pieces over all threads, and the 8-head rows of `a` (threads 0-63)
        and `b` (64-127). Tokens past the end are not copied (`enter_chunk` zeroes them)."""
        raw_k, raw_q, raw_v, raw_a, raw_b = raw
        first = chunk * CHUNK
        for i in cutlass.range_constexpr(CHUNK * (HEAD_SIZE // VEC) // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            token, piece = linear // (HEAD_SIZE // VEC), linear % (HEAD_SIZE // VEC)
            if first + token < length:
                row = start + first + token
                cute.copy(
                    g2s, cute.local_tile(k[row, qk_head, None], (VEC,), (piece,)), cute.local_tile(raw_k[token, None], (VEC,), (piece,))
                )
                cute.copy(
                    g2s, cute.local_tile(q[row, qk_head, None], (VEC,), (piece,)), cute.local_tile(raw_q[token, None], (VEC,), (piece,))
                )
                cute.copy(
                    g2s, cute.local_tile(v[row, head, None], (VEC,), (piece,)), cute.local_tile(raw_v[token, None], (VEC,), (piece,))
                )
        token = tidx % CHUNK
        if first + token < length:
            if tidx < CHUNK:
                cute.copy(g2s, a[start + first + token, None], raw_a[token, None])
            elif tidx < 2 * CHUNK:
                cute.copy(g2s, b[start + first + token, None], raw_b[token, None])

    @cute.jit
    def enter_chunk(self, raw, tokens_here: Int32, head: Int32, neg_decay_rate: Float32, bias: Float32, s_keys,
                    s_queries, s_values, s_g, s_beta, s_decay_in, s_decay_out, tidx: Int32):  # fmt: skip
        """The chunk's staged rows into their operand buffers: keys and queries (bf16 -> fp16) into the
        swizzled buffers, values (bf16) into [v, token], zero past the end of the sequence. Warp 0: log g and
        beta of the chunk's tokens (lane l takes 2l and 2l + 1; 0 past the end), G = cumsum(log g) by a
        shuffle scan, and per token exp(G) and exp(G_last - G)."""
        raw_k, raw_q, raw_v, raw_a, raw_b = raw
        for i in cutlass.range_constexpr(CHUNK * (HEAD_SIZE // VEC) // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            token, piece = linear // (HEAD_SIZE // VEC), linear % (HEAD_SIZE // VEC)
            key_dst = cute.local_tile(s_keys[token, None, 0], (VEC,), (piece,))
            query_dst = cute.local_tile(s_queries[token, None, 0], (VEC,), (piece,))
            value_dst = cute.local_tile(s_values[None, token], (VEC,), (piece,))
            if token < tokens_here:
                key_dst.store(cute.local_tile(raw_k[token, None], (VEC,), (piece,)).load().to(Float32).to(Float16))
                query_dst.store(cute.local_tile(raw_q[token, None], (VEC,), (piece,)).load().to(Float32).to(Float16))
                value_dst.store(cute.local_tile(raw_v[token, None], (VEC,), (piece,)).load())
            else:
                key_dst.fill(0.0)
                query_dst.fill(0.0)
                value_dst.fill(0.0)
        if tidx < 32:
            lane = tidx
            log_g0, beta0 = self.token_gates(raw_a, raw_b, head, neg_decay_rate, bias, tokens_here, 2 * lane)
            log_g1, beta1 = self.token_gates(raw_a, raw_b, head, neg_decay_rate, bias, tokens_here, 2 * lane + 1)
            inclusive = log_g0 + log_g1
            offset = 1
            while offset < 32:
                from_below = cute.arch.shuffle_sync_up(inclusive, offset)
                inclusive = inclusive + (from_below if lane >= offset else Float32(0.0))
                offset *= 2
            exclusive = cute.arch.shuffle_sync_up(inclusive, 1)
            g0 = (exclusive if lane > 0 else Float32(0.0)) + log_g0
            g1 = g0 + log_g1
            g_last = cute.arch.shuffle_sync(g1, 31)  # G of token 63, exactly as stored in s_g
            s_g[2 * lane] = g0
            s_g[2 * lane + 1] = g1
            s_beta[2 * lane] = beta0
            s_beta[2 * lane + 1] = beta1
            s_decay_in[2 * lane] = cute.math.exp(g0, fastmath=False)
            s_decay_in[2 * lane + 1] = cute.math.exp(g1, fastmath=False)
            s_decay_out[2 * lane] = cute.math.exp(g_last - g0, fastmath=False)
            s_decay_out[2 * lane + 1] = cute.math.exp(g_last - g1, fastmath=False)
        cute.arch.fence_view_async_shared()  # the generic-proxy stores, before the tensor core reads them
        cute.arch.sync_threads()

    @cute.jit
    def token_gates(self, raw_a, raw_b, head: Int32, neg_decay_rate: Float32, bias: Float32, tokens_here: Int32,
                    token: Int32):  # fmt: skip
        """(log g, beta) of one token in fp32 as the model's `gates`; (0, 0) past the end (its staged
        rows hold stale values)."""
        log_g = Float32(0.0)
        gate_beta = Float32(0.0)
        if token < tokens_here:
            x = raw_a[token, head].to(Float32) + bias
            softplus = x if x > SOFTPLUS_THRESHOLD else cute.math.log1p(cute.math.exp(x))
            log_g = neg_decay_rate * softplus
            gate_beta = Float32(1.0) / (Float32(1.0) + cute.math.exp(-raw_b[token, head].to(Float32)))
        return log_g, gate_beta

    @cute.jit
    def key_side(self, gram_mma, gram_a, storage, s_g, s_beta, s_a, s_p, tidx: Int32):
        """K K^T (warpgroup 0) and Q K^T (warpgroup 1), gated: A (fp32, strictly lower) into `s_a`, P
        (fp16, lower with the diagonal) into `s_p`."""
        warpgroup_id = tidx // 128
        thr_gram = gram_mma.get_slice(tidx % 128)
        # (token, k, 1): the Gram products' A, and the keys' view is also their B as (token', k, 1)
        s_keys = storage.keys.get_tensor(gram_a.outer, swizzle=gram_a.inner)
        s_queries = storage.queries.get_tensor(gram_a.outer, swizzle=gram_a.inner)
        gram = cute.make_rmem_tensor(thr_gram.partition_shape_C((CHUNK, CHUNK)), Float32)
        coords = thr_gram.partition_C(cute.make_identity_tensor((CHUNK, CHUNK)))  # (token i, token j)
        t_b = gram_mma.make_fragment_B(thr_gram.partition_B(s_keys))
        if warpgroup_id == 0:
            self.gram_product(gram_mma, gram, gram_mma.make_fragment_A(thr_gram.partition_A(s_keys)), t_b)
            for i in cutlass.range_constexpr(cute.size(gram)):
                row, col = coords[i]
                decay = cute.math.exp(s_g[row] - s_g[col], fastmath=False) if row > col else Float32(0.0)
                value = s_beta[row] * decay * gram[i] if row > col else Float32(0.0)
                # The forward substitution reads A's diagonal 16 x 16 blocks unrounded, the doubling steps
                # the other blocks rounded to fp16: each block is stored as its one reader wants it (v3.3).
                s_a[row, col] = value if row // BLOCK == col // BLOCK else value.to(Float16).to(Float32)
        else:
            self.gram_product(gram_mma, gram, gram_mma.make_fragment_A(thr_gram.partition_A(s_queries)), t_b)
            for i in cutlass.range_constexpr(cute.size(gram)):
                row, col = coords[i]
                decay = cute.math.exp(s_g[row] - s_g[col], fastmath=False) if row >= col else Float32(0.0)
                s_p[row, col, 0] = (decay * gram[i]).to(Float16)
        cute.arch.sync_threads()

    @cute.jit
    def gram_product(self, gram_mma, acc, t_a, t_b):
        """acc = A B^T over the 128 k, both operands from shared memory (waited for)."""
        gram_mma.set(warpgroup.Field.ACCUMULATE, False)
        warpgroup.fence()
        for step in cutlass.range_constexpr(HEAD_SIZE // 16):
            cute.gemm(gram_mma, acc, t_a[None, None, step, 0], t_b[None, None, step, 0], acc)
            gram_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def invert(self, s_a, s_tw, s_x, s_t, tidx: Int32):
        """T = (I + A)^-1 as `chunked_model.invert_unit_lower`: the four 16 x 16 diagonal blocks by forward
        substitution on the unrounded A (thread c < 64: column c % 16 of block c // 16), rounded; then for
        sizes 16 and 32, X = rnd(T_hh rnd(A_hl)) and T_hl = rnd(-(X T_ll)) (`key_side` stored A's
        off-diagonal blocks rounded). fp32 SIMT dot products of rounded operands, in `doubling_tiles` per
        thread; each block of T goes into `s_t` (fp16, T's B layout) as it is final. The blocks above the
        diagonal are never written: the kernel zeroes both copies once."""
        if tidx < CHUNK:
            base = (tidx // BLOCK) * BLOCK
            col = tidx % BLOCK
            column = cute.make_rmem_tensor((BLOCK,), Float32)
            for r in cutlass.range_constexpr(BLOCK):
                column[r] = Float32(1.0) if col == r else Float32(0.0)
            for j in cutlass.range_constexpr(BLOCK):
                for r in cutlass.range_constexpr(j + 1, BLOCK):
                    column[r] = column[r] - s_a[base + r, base + j] * column[j]
            for r in cutlass.range_constexpr(BLOCK):
                s_tw[base + r, base + col] = column[r].to(Float16).to(Float32)
                s_t[base + r, base + col, 0] = column[r].to(Float16)
        cute.arch.sync_threads()
        for level in cutlass.range_constexpr(2):  # blocks of 16, then of 32
            size = BLOCK << level
            pairs = CHUNK // (2 * size)
            rows, cols = self.doubling_tiles[level]
            tiles_r, tiles_c = size // rows, size // cols
            lhs = cute.make_rmem_tensor((rows,), Float32)
            rhs = cute.make_rmem_tensor((cols,), Float32)
            dots = cute.make_rmem_tensor((rows * cols,), Float32)
            steps = pairs * tiles_r * tiles_c // NUM_THREADS
            # X = rnd(T_hh rnd(A_hl)) for every pair (hi = lo + size), a rows x cols tile per thread and step
            # (`key_side` stored A's off-diagonal blocks rounded)
            for i in cutlass.range_constexpr(steps):
                hi, lo, r0, c0 = self.doubling_tile(i * NUM_THREADS + tidx, size, rows, cols)
                self.tile_dots(self.block(s_tw, size, hi, hi), self.block(s_a, size, hi, lo), lhs, rhs, dots, r0, c0, size)
                for e in cutlass.range_constexpr(rows * cols):
                    s_x[hi * size + r0 + e // cols, lo * size + c0 + e % cols] = dots[e].to(Float16).to(Float32)
            cute.arch.sync_threads()
            # T_hl = rnd(-(X T_ll))
            for i in cutlass.range_constexpr(steps):
                hi, lo, r0, c0 = self.doubling_tile(i * NUM_THREADS + tidx, size, rows, cols)
                self.tile_dots(self.block(s_x, size, hi, lo), self.block(s_tw, size, lo, lo), lhs, rhs, dots, r0, c0, size)
                for e in cutlass.range_constexpr(rows * cols):
                    row, col = hi * size + r0 + e // cols, lo * size + c0 + e % cols
                    s_tw[row, col] = (-dots[e]).to(Float16).to(Float32)
                    s_t[row, col, 0] = (-dots[e]).to(Float16)
            if cutlass.const_expr(level == 0):  # the last level's barrier is the one below
                cute.arch.sync_threads()
        cute.arch.fence_view_async_shared()  # s_t's generic-proxy stores, before the tensor core reads them
        cute.arch.sync_threads()

    def doubling_tile(self, linear: Int32, size: int, rows: int, cols: int):
        """(hi block, lo block, first row, first column) of the tile that thread-and-step number `linear` computes
        in a doubling product of `size` x `size` blocks (blocks in units of `size`; tiles of rows x cols)."""
        tiles_r, tiles_c = size // rows, size // cols
        pair = linear // (tiles_r * tiles_c)
        return 2 * pair + 1, 2 * pair, ((linear // tiles_c) % tiles_r) * rows, (linear % tiles_c) * cols

    def block(self, square: cute.Tensor, size: int, row_block: Int32, col_block: Int32) -> cute.Tensor:
        """The (row_block, col_block) block of a [token, token] work array, in blocks of `size`."""
        return cute.local_tile(square, (size, size), (row_block, col_block))

    @cute.jit
    def tile_dots(self, lhs_block, rhs_block, lhs, rhs, dots, r0: Int32, c0: Int32, size: cutlass.Constexpr):
        """dots[dr * cols + dc] = sum over m in order of lhs_block[r0 + dr, m] * rhs_block[m, c0 + dc] (fp32;
        rows, cols = the sizes of `lhs`, `rhs`): each loaded word serves every product of its row or column."""
        rows, cols = cute.size(lhs), cute.size(rhs)
        dots.fill(0.0)
        for m in cutlass.range_constexpr(size):
            for dr in cutlass.range_constexpr(rows):
                lhs[dr] = lhs_block[r0 + dr, m]
            for dc in cutlass.range_constexpr(cols):
                rhs[dc] = rhs_block[m, c0 + dc]
            for e in cutlass.range_constexpr(rows * cols):
                dots[e] = dots[e] + lhs[e // cols] * rhs[e % cols]

    @cute.jit
    def value_side(
        self, state, s_values, scale: Float32, output, first: Int32, tokens_here: Int32, head: Int32, update_mma,
        products_mma, keys_k_major, keys_mn_major, storage, s_t, s_p, s_g, s_beta, s_decay_in, s_decay_out,
        tidx: Int32,
    ):  # fmt: skip
        """Steps 1-2 on the state accumulator: Yk, Yq, Xb, V', the chunk's output rows (bf16, the tokens of
        the sequence only) and the state update, every hand-over in registers."""
        s_keys = storage.keys.get_tensor(keys_k_major.outer, swizzle=keys_k_major.inner)
        s_keys_mn = storage.keys.get_tensor(keys_mn_major.outer, swizzle=keys_mn_major.inner)  # (k, token, 1)
        s_queries = storage.queries.get_tensor(keys_k_major.outer, swizzle=keys_k_major.inner)
        g_last = s_g[CHUNK - 1]
        thr_update = update_mma.get_slice(tidx)
        thr_products = products_mma.get_slice(tidx)

        # The state's fp16 copy as the products' A operand (same coordinates, same order).
        state_a = cute.make_rmem_tensor(thr_products.partition_shape_A((HEAD_SIZE, HEAD_SIZE)), Float16)
        for i in cutlass.range_constexpr(cute.size(state)):
            state_a[i] = state[i].to(Float16)

        # Yk^T and Yq^T: [v, token].
        by_token_shape = thr_products.partition_shape_C((HEAD_SIZE, CHUNK))
        by_token = thr_products.partition_C(cute.make_identity_tensor((HEAD_SIZE, CHUNK)))  # (v, token)
        yk = cute.make_rmem_tensor(by_token_shape, Float32)
        yq = cute.make_rmem_tensor(by_token_shape, Float32)
        t_keys = products_mma.make_fragment_B(thr_products.partition_B(s_keys))
        t_queries = products_mma.make_fragment_B(thr_products.partition_B(s_queries))
        warpgroup.fence()
        self.product(products_mma, yk, state_a, t_keys, HEAD_SIZE // 16, False)
        self.product(products_mma, yq, state_a, t_queries, HEAD_SIZE // 16, False)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        # Xb^T = beta (V^T - exp(G) Yk^T), rounded: the A operand of V'^T = Xb^T T^T.
        over_tokens_shape = thr_products.partition_shape_A((HEAD_SIZE, CHUNK))
        xb = cute.make_rmem_tensor(over_tokens_shape, Float16)
        for i in cutlass.range_constexpr(cute.size(yk)):
            v_row, token = by_token[i]
            xb[i] = (s_beta[token] * (s_values[v_row, token].to(Float32) - s_decay_in[token] * yk[i])).to(Float16)
        v_new = cute.make_rmem_tensor(by_token_shape, Float32)
        t_t = products_mma.make_fragment_B(thr_products.partition_B(s_t))
        warpgroup.fence()
        self.product(products_mma, v_new, xb, t_t, CHUNK // 16, False)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        # O^T = exp(G) Yq^T + V'^T P^T (scaled at the store), and V'c^T = V'^T exp(G_last - G), both
        # rounded V' operands in registers; S = exp(G_last) S + V'c^T K onto the state.
        v_new_a = cute.make_rmem_tensor(over_tokens_shape, Float16)
        v_carry_a = cute.make_rmem_tensor(thr_update.partition_shape_A((HEAD_SIZE, CHUNK)), Float16)
        for i in cutlass.range_constexpr(cute.size(v_new)):
            _, token = by_token[i]
            v_new_a[i] = v_new[i].to(Float16)
            v_carry_a[i] = (v_new[i] * s_decay_out[token]).to(Float16)
            yq[i] = yq[i] * s_decay_in[token]
        decay_last = cute.math.exp(g_last, fastmath=False)
        for i in cutlass.range_constexpr(cute.size(state)):
            state[i] = state[i] * decay_last
        t_p = products_mma.make_fragment_B(thr_products.partition_B(s_p))
        t_keys_mn = update_mma.make_fragment_B(thr_update.partition_B(s_keys_mn))
        warpgroup.fence()
        self.product(products_mma, yq, v_new_a, t_p, CHUNK // 16, True)
        self.product(update_mma, state, v_carry_a, t_keys_mn, CHUNK // 16, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        for i in cutlass.range_constexpr(cute.size(yq)):
            v_row, token = by_token[i]
            if token < tokens_here:
                output[first + token, head, v_row] = (scale * yq[i]).to(cutlass.BFloat16)

    @cute.jit
    def product(
        self,
        tiled_mma: cute.TiledMma,
        acc: cute.Tensor,
        a: cute.Tensor,
        t_b: cute.Tensor,
        k_steps: cutlass.Constexpr,
        accumulate: cutlass.Constexpr,
    ):
        """acc (+)= A B over `k_steps` k16 steps, A from registers, B from shared memory (not waited for)."""
        tiled_mma.set(warpgroup.Field.ACCUMULATE, accumulate)
        for step in cutlass.range_constexpr(k_steps):
            cute.gemm(tiled_mma, acc, a[None, None, step], t_b[None, None, step, 0], acc)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
