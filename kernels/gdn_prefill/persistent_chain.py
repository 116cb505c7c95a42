"""GDN prefill candidate `cand_persistent_chain`: `wgmma_value_side.py`'s chain as a persistent kernel whose CTAs
prefetch their next (sequence, head) while stepping the current one's last chunk.

Why (NOTES.md, "WGMMA chain", next levers (2)): at 8192 tokens in 32 sequences a chain CTA steps 4 chunks
(~15 us) but the kernel takes 48 us in two waves: ~9 us per CTA go to its start (the ranking's reads of
`cu_seqlens`, the state's 64 KB from DRAM, the first chunk's copies) and its end (the state's 64 KB out), paid
again by every wave. Here min(8 N, NUM_SMS) CTAs each serve several (sequence, head) items one after another;
during an item's last chunk a CTA issues the next item's state (cp.async into a 64 KB staging buffer, thread by
thread in the accumulator's order) and its first chunk's copies, so that they land while the chain computes.

Items are (rank, head) in rank-major order, the rank being the sequence's place in decreasing length (the
base kernel's LPT order, `chunked.py`'s ranking, computed once per CTA into a map). CTA c starts on item c; its
next items it claims from a counter (thread 0, one claim ahead, published through shared memory), so that the
CTAs that finish first take the next longest items, as the hardware's block scheduler does for the base grid.
A static serpentine over the sorted items was modelled first and balances worse than that (NOTES.md). The
counter is kept per (device, stream), zeroed by our kernel when made; each launch makes exactly one failing
claim per CTA, and the CTA whose claim is the launch's last brings it back to zero (the MoE GEMM2's scheme).

The arithmetic is the base kernel's (its `enter_chunk` and `value_side` unchanged): outputs and states are
`wgmma_value_side.py`'s bit for bit. A candidate: NOTES.md has its contract.
"""

from __future__ import annotations

from typing import Callable

import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from . import kernel, token_serial, wgmma_value_side, wy_prepass
from .chunked import CHUNK, MAX_RANKED_SEQS, MIN_RANKED_SEQS, NUM_SMS, sequence_bounds
from .token_serial import GPU_ARCH, HEAD_SIZE, NUM_V_HEADS, V_HEADS_PER_QK_HEAD, GdnShapeError, resolve_scale
from .wgmma_value_side import NUM_THREADS, OUTPUT_ALIGN, ROW_STRIDE, VEC, WgmmaValueSide, operands

__all__ = ["GdnShapeError", "compile_only", "resolve_scale", "run", "run_as_kernel"]

STATE_PER_THREAD = HEAD_SIZE * HEAD_SIZE // NUM_THREADS  # fp32 state elements each thread holds: 64


@cute.jit
def take_claim(claims: cute.Tensor) -> Int32:
    """Thread 0: the next claim n of the counter (its item is num_ctas + n). Nothing reads n until
    `publish_claim`, so the atomic's round trip overlaps the chunks in between."""
    return cute.arch.atomic_add(claims.iterator.llvm_ptr, Int32(1), scope="gpu")


@cute.jit
def publish_claim(claims: cute.Tensor, claimed: cute.Tensor, n: Int32, num_items: Int32):
    """Thread 0: claim n into shared memory, where the CTA reads it after the next barrier. A launch makes num_items
    claims in all (one failing claim per CTA), so claim num_items - 1 is its last: that CTA brings the counter
    back to zero for the next launch, which stream order places after this one."""
    claimed[0] = n
    if n == num_items - 1:
        cute.arch.atomic_add(claims.iterator.llvm_ptr, -num_items, scope="gpu")


class PersistentValueSide(WgmmaValueSide):
    """The persistent chain kernel (the module docstring); `wy_prepass._KeySide` runs before it."""

    @cute.jit
    def launch(
        self, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state, ws_tp, ws_g,
        claims, stream,
    ):  # fmt: skip
        update_mma, products_mma, keys_k_major, keys_mn_major, square = operands()
        rows = cute.cosize(keys_k_major.outer)
        square_size = cute.cosize(square.outer)

        @cute.struct
        class SharedStorage:
            keys: cute.struct.Align[cute.struct.MemRange[Float16, rows], 1024]
            queries: cute.struct.Align[cute.struct.MemRange[Float16, rows], 1024]
            t: cute.struct.Align[cute.struct.MemRange[Float16, square_size], 1024]
            p: cute.struct.Align[cute.struct.MemRange[Float16, square_size], 1024]
            values: cute.struct.Align[cute.struct.MemRange[BFloat16, 2 * CHUNK * ROW_STRIDE], 128]
            o_rows: cute.struct.Align[cute.struct.MemRange[BFloat16, CHUNK * ROW_STRIDE], 128]
            g: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            beta: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            decay_in: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            decay_out: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            raw_k: cute.struct.Align[cute.struct.MemRange[BFloat16, CHUNK * HEAD_SIZE], 128]
            raw_q: cute.struct.Align[cute.struct.MemRange[BFloat16, CHUNK * HEAD_SIZE], 128]
            raw_tp: cute.struct.Align[cute.struct.MemRange[Float16, 2 * CHUNK * CHUNK], 128]
            raw_gates: cute.struct.Align[cute.struct.MemRange[Float32, 2 * CHUNK], 16]
            # the next item's state, element i of thread t at i * NUM_THREADS + t (conflict-free both ways)
            staged_state: cute.struct.Align[cute.struct.MemRange[Float32, HEAD_SIZE * HEAD_SIZE], 128]
            # rank -> sequence (the LPT order), computed once per CTA
            ranked: cute.struct.Align[cute.struct.MemRange[Int32, MAX_RANKED_SEQS], 16]
            claimed: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]  # thread 0's pending claim

        kernel_ = self.kernel(
            q, k, v, state, cu_seqlens, scale, has_state, output, new_state, ws_tp, ws_g, claims, update_mma,
            products_mma, keys_k_major, keys_mn_major, square, SharedStorage,
        )  # fmt: skip
        grid = cutlass.min(NUM_V_HEADS * new_state.shape[0], NUM_SMS)
        self.launch_grid(kernel_, [grid, 1, 1], SharedStorage, stream, threads=NUM_THREADS)

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
        claims: cute.Tensor,
        update_mma: cute.TiledMma,
        products_mma: cute.TiledMma,
        keys_k_major: cute.ComposedLayout,
        keys_mn_major: cute.ComposedLayout,
        square: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        s_keys = storage.keys.get_tensor(keys_k_major.outer, swizzle=keys_k_major.inner)
        s_queries = storage.queries.get_tensor(keys_k_major.outer, swizzle=keys_k_major.inner)
        s_t = storage.t.get_tensor(square.outer, swizzle=square.inner)
        s_p = storage.p.get_tensor(square.outer, swizzle=square.inner)
        s_values = storage.values.get_tensor(
            cute.make_layout((2, CHUNK, HEAD_SIZE), stride=(CHUNK * ROW_STRIDE, ROW_STRIDE, 1))
        )  # (stage, token, v)
        s_o_rows = storage.o_rows.get_tensor(cute.make_layout((CHUNK, HEAD_SIZE), stride=(ROW_STRIDE, 1)))
        gates = (
            storage.g.get_tensor(cute.make_layout(CHUNK)),
            storage.beta.get_tensor(cute.make_layout(CHUNK)),
            storage.decay_in.get_tensor(cute.make_layout(CHUNK)),
            storage.decay_out.get_tensor(cute.make_layout(CHUNK)),
        )
        rows_layout = cute.make_layout((CHUNK, HEAD_SIZE), stride=(HEAD_SIZE, 1))
        raw = (
            storage.raw_k.get_tensor(rows_layout),
            storage.raw_q.get_tensor(rows_layout),
            storage.raw_tp.get_tensor(cute.make_layout((2, CHUNK, CHUNK), stride=(CHUNK * CHUNK, CHUNK, 1))),
            storage.raw_gates.get_tensor(cute.make_layout((2, CHUNK), stride=(CHUNK, 1))),
        )
        staged = storage.staged_state.get_tensor(
            cute.make_layout((STATE_PER_THREAD, NUM_THREADS), stride=(NUM_THREADS, 1))
        )
        ranked = storage.ranked.get_tensor(cute.make_layout(MAX_RANKED_SEQS))
        claimed = storage.claimed.get_tensor(cute.make_layout(4))

        num_seqs = new_state.shape[0]
        num_items = NUM_V_HEADS * num_seqs
        # The lengths go through the output rows' buffer, free until the first chunk's value side.
        self.rank_sequences(cu_seqlens, num_seqs, tidx, s_o_rows, ranked)

        thr_update = update_mma.get_slice(tidx)
        state = cute.make_rmem_tensor(thr_update.partition_shape_C((HEAD_SIZE, HEAD_SIZE)), Float32)
        state_coords = thr_update.partition_C(cute.make_identity_tensor((HEAD_SIZE, HEAD_SIZE)))

        # The first item, cta (< num_items: the grid is at most 8 N): its state and first chunk, into values stage
        # 0; thread 0 claims the item after it (read at the item's start, after a barrier). From then on thread 0
        # takes the next claim at an item's start and publishes it at its end.
        item = Int32(cta)
        self.stage_item(
            q, k, v, state_in, has_state, cu_seqlens, ws_tp, ws_g, item, num_seqs, ranked, raw,
            s_values[0, None, None], staged, state_coords, tidx,
        )  # fmt: skip
        cute.arch.cp_async_commit_group()
        if tidx == 0:
            publish_claim(claims, claimed, take_claim(claims), num_items)
        stage = Int32(0)  # the values stage that holds the current item's next chunk

        while item < num_items:
            seq, head = self.item_sequence(item, num_seqs, ranked)
            start, length = sequence_bounds(cu_seqlens, seq, q.shape[0])
            num_chunks = (length + CHUNK - 1) // CHUNK

            # The item's state and first chunk have landed; the staging buffer is free once every thread has taken
            # its state out of it, and thread 0 may then claim the item after the next (published at the end).
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            next_item = num_ctas + claimed[0]
            for i in cutlass.range_constexpr(cute.size(state)):
                state[i] = staged[i, tidx] if has_state != 0 else Float32(0.0)
            cute.arch.sync_threads()
            pending = Int32(0)
            if tidx == 0 and next_item < num_items:
                pending = take_claim(claims)
            if num_chunks == 0 and next_item < num_items:
                self.stage_item(
                    q, k, v, state_in, has_state, cu_seqlens, ws_tp, ws_g, next_item, num_seqs, ranked, raw,
                    s_values[stage, None, None], staged, state_coords, tidx,
                )  # fmt: skip
            cute.arch.cp_async_commit_group()

            for chunk in cutlass.range(num_chunks, unroll=1):
                first = start + chunk * CHUNK
                tokens_here = cutlass.min(length - chunk * CHUNK, CHUNK)
                cute.arch.cp_async_wait_group(0)
                cute.arch.sync_threads()
                self.enter_chunk(raw, tokens_here, s_keys, s_queries, s_t, s_p, gates, tidx)
                # Staging and the other values stage are free: the next chunk's copies, or in the last chunk the
                # next item's state and first chunk, land while this chunk computes.
                if chunk + 1 < num_chunks:
                    self.copy_chunk_into(
                        q, k, v, ws_tp, ws_g, start, length, chunk + 1, seq, head, raw,
                        s_values[1 - stage, None, None], tidx,
                    )  # fmt: skip
                elif next_item < num_items:
                    self.stage_item(
                        q, k, v, state_in, has_state, cu_seqlens, ws_tp, ws_g, next_item, num_seqs, ranked, raw,
                        s_values[1 - stage, None, None], staged, state_coords, tidx,
                    )  # fmt: skip
                cute.arch.cp_async_commit_group()
                self.value_side(
                    state, s_values[stage, None, None], s_o_rows, scale, output, first, tokens_here, head,
                    update_mma, products_mma, keys_k_major, keys_mn_major, storage, s_t, s_p, gates, tidx,
                )  # fmt: skip
                cute.arch.fence_view_async_shared()
                cute.arch.sync_threads()
                stage = 1 - stage

            if tidx == 0 and next_item < num_items:
                publish_claim(claims, claimed, pending, num_items)
            for i in cutlass.range_constexpr(cute.size(state)):
                v_row, k_col = state_coords[i]
                new_state[seq, head, v_row, k_col] = state[i] if length > 0 else Float32(0.0)
            item = next_item

    @cute.jit
    def rank_sequences(self, cu_seqlens: cute.Tensor, num_seqs: Int32, tidx: Int32, scratch, ranked: cute.Tensor):
        """ranked[r] = the sequence of rank r in decreasing length (ties by index), for MIN_RANKED_SEQS to
        MAX_RANKED_SEQS sequences (`chunked.py`'s rule); `item_sequence` takes rank = sequence otherwise."""
        if num_seqs >= MIN_RANKED_SEQS and num_seqs <= MAX_RANKED_SEQS:
            lengths = cute.make_tensor(
                cute.recast_ptr(scratch.iterator, dtype=Int32), cute.make_layout(MAX_RANKED_SEQS)
            )
            my_length = Int32(0)
            if tidx < num_seqs:
                my_length = Int32(cu_seqlens[tidx + 1]) - Int32(cu_seqlens[tidx])
                lengths[tidx] = my_length
            cute.arch.sync_threads()
            if tidx < num_seqs:
                rank = Int32(0)
                for j in cutlass.range(num_seqs, unroll=4):
                    other = lengths[j]
                    if other > my_length or (other == my_length and j < tidx):
                        rank += 1
                ranked[rank] = tidx
        cute.arch.sync_threads()

    @cute.jit
    def item_sequence(self, item: Int32, num_seqs: Int32, ranked: cute.Tensor):
        """(sequence, v-head) of an item: rank item // 8 through the ranking, head item % 8."""
        rank = item // NUM_V_HEADS
        seq = rank
        if num_seqs >= MIN_RANKED_SEQS and num_seqs <= MAX_RANKED_SEQS:
            seq = ranked[rank]
        return seq, item % NUM_V_HEADS

    @cute.jit
    def stage_item(
        self, q, k, v, state_in, has_state: Int32, cu_seqlens, ws_tp, ws_g, item: Int32, num_seqs: Int32,
        ranked, raw, values_stage, staged, state_coords, tidx: Int32,
    ):  # fmt: skip
        """Issue the cp.async copies that start `item`: its state (if given) into the staging buffer, each thread
        the elements it holds in the state accumulator, and its first chunk (if any) into `values_stage` and
        the staging rows."""
        seq, head = self.item_sequence(item, num_seqs, ranked)
        start, length = sequence_bounds(cu_seqlens, seq, q.shape[0])
        if has_state != 0:
            g2s4 = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), Float32, num_bits_per_copy=32
            )
            for i in cutlass.range_constexpr(STATE_PER_THREAD):
                v_row, k_col = state_coords[i]
                cute.copy(
                    g2s4,
                    cute.local_tile(state_in[seq, head, v_row, None], (1,), (k_col,)),
                    cute.local_tile(staged[i, None], (1,), (tidx,)),
                )
        if length > 0:
            self.copy_chunk_into(q, k, v, ws_tp, ws_g, start, length, Int32(0), seq, head, raw, values_stage, tidx)

    @cute.jit
    def copy_chunk_into(self, q, k, v, ws_tp, ws_g, start: Int32, length: Int32, chunk: Int32, seq: Int32,
                        head: Int32, raw, values_stage, tidx: Int32):  # fmt: skip
        """`WgmmaValueSide.copy_chunk` with the values stage given (the stages alternate across items here)."""
        raw_k, raw_q, raw_tp, raw_gates = raw
        qk_head = head // V_HEADS_PER_QK_HEAD
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
        for i in cutlass.range_constexpr(CHUNK * (HEAD_SIZE // VEC) // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            token, piece = linear // (HEAD_SIZE // VEC), linear % (HEAD_SIZE // VEC)
            if first + token < length:
                row = start + first + token
                cute.copy(g2s, cute.local_tile(k[row, qk_head, None], (VEC,), (piece,)), cute.local_tile(raw_k[token, None], (VEC,), (piece,)))
                cute.copy(g2s, cute.local_tile(q[row, qk_head, None], (VEC,), (piece,)), cute.local_tile(raw_q[token, None], (VEC,), (piece,)))
                cute.copy(g2s, cute.local_tile(v[row, head, None], (VEC,), (piece,)), cute.local_tile(values_stage[token, None], (VEC,), (piece,)))
        slot = wy_prepass.chunk_slot(start, chunk, seq)
        for i in cutlass.range_constexpr(2 * CHUNK * (CHUNK // VEC) // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
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


class GdnPrefillPersistentSm90(wgmma_value_side.GdnPrefillWyWgmmaSm90):
    """Host entry: `wy_prepass`'s key-side kernel, then the persistent chain, in one compiled call."""

    @cute.jit
    def __call__(
        self, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale: Float32, has_state: Int32, output,
        new_state, ws_tp, ws_g, claims, stream,
    ):  # fmt: skip
        wy_prepass._KeySide().launch(q, k, A_log, a, dt_bias, b, cu_seqlens, ws_tp, ws_g, stream)
        PersistentValueSide().launch(
            q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state, ws_tp, ws_g,
            claims, stream,
        )  # fmt: skip


class _ZeroClaims:
    """The zeroing launch of a new claim counter."""

    @cute.jit
    def __call__(self, claims: cute.Tensor, stream):
        self.kernel(claims).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, claims: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            claims[0] = Int32(0)


def _claims_stand_in():
    return make_fake_compact_tensor(Int32, (1,), assumed_align=4)


_COMPILED: dict[str, Callable] = {}


def compiled_for(arch: str = GPU_ARCH) -> Callable:
    """The compiled two-kernel launcher for `arch` (compiled on first use; needs no GPU)."""
    fn = _COMPILED.get(arch)
    if fn is None:
        fn = _COMPILED[arch] = token_serial.compile_launcher(
            GdnPrefillPersistentSm90(), arch, (*wy_prepass._workspace_stand_ins(), _claims_stand_in()),
            output_align=OUTPUT_ALIGN,
        )  # fmt: skip
    return fn


_ZERO: dict[str, Callable] = {}


def compiled_zero(arch: str = GPU_ARCH) -> Callable:
    fn = _ZERO.get(arch)
    if fn is None:
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = _ZERO[arch] = cute.compile(
            _ZeroClaims(), _claims_stand_in(), stream, options=f"--enable-tvm-ffi --gpu-arch {arch}"
        )
    return fn


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    return (compiled_for(arch), compiled_zero(arch))


# The claim counter, kept per (device, stream) and zeroed by `_ZeroClaims` when made (every launch leaves it at
# zero); inside a CUDA-graph capture a fresh one, whose zeroing the graph holds.
_CLAIMS: dict[tuple[int, int], torch.Tensor] = {}


def _claims(device: torch.device) -> torch.Tensor:
    def make() -> torch.Tensor:
        claims = torch.empty(1, dtype=torch.int32, device=device)
        compiled_zero(GPU_ARCH)(claims)
        return claims

    if torch.cuda.is_current_stream_capturing():
        return make()
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch.cuda.current_stream(index).cuda_stream)
    if key not in _CLAIMS:
        _CLAIMS[key] = make()
    return _CLAIMS[key]


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`wgmma_value_side.run` with the persistent chain (an output off a 16-B boundary goes to `wy_prepass.py`'s
    chain, as there)."""
    token_serial.check_inputs(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, output, new_state)
    if output.data_ptr() % OUTPUT_ALIGN:
        wy_prepass.run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
        return
    wy_prepass.run_compiled(
        compiled_for(GPU_ARCH), q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state,
        _claims(q.device),
    )  # fmt: skip


def run_as_kernel(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.py` with this chain where it takes the WGMMA chain (the candidate side)."""
    if kernel.path_for(q.shape[0], new_state.shape[0]) is wgmma_value_side:
        run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
    else:
        kernel.run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
