"""GDN prefill for SM90 in CuTe-DSL, the warp chain: each warp steps 16 rows of one (sequence, head) state through
16-token chunks in `mma.sync` accumulators, with no CTA barrier inside the chain. kernel.py takes it for one or two
sequences from ~22 tokens up to the context-parallel path's lengths, and for more sequences of a mean of up to 500
tokens (`kernel.takes_warp_chain`), where the token-serial kernel pays ~0.14 us a token, `chunked.py`'s barrier
phases ~2.2 us a 16-token chunk and the WY path a second launch and 64-token chunks; correct at any length.

The math is `chunked_model.py`'s chunk step at C = 16 (`chunked_model.run(..., chunk=CHUNK)`), with its rounding
points: k, q, S0, Xb, T, P, V' and V'c as fp16 tensor-core operands, the state, gates and element-wise steps in fp32.
A 16-token chunk's T = (I + A)^-1 is one diagonal block: forward substitution, no doubling levels.

Work split. One CTA = one (sequence, v-head, slice of 64 V rows): grid (8 heads x NUM_SLICES, N), 8 warps in two
roles (`_NarrowWarpChain`, up to NARROW_MAX_SEQS sequences: 16-row slices, one step warp, 64 CTAs a sequence, so
that the state's round trip and the key halves spread over the SMs). Step warp w (0-3) owns 16 state rows, [16, 128]
fp32 in the accumulators of the state-update product, for the whole sequence, so every product of the chain is the
warp's own (the state's V rows evolve independently). Key warp c (4-7) computes the state-free half of chunk c of
each group of GROUP_CHUNKS chunks, one group ahead of the steps, so that the two halves overlap (a sequence of <= 64
tokens is one group). When the grid outgrows the GPU, its rows serve the sequences longest first
(`_Chunked.sequence_of_block`). Per group:
  1. Key warps: cp.async of the next group's k and q rows (bf16, converted in place to fp16 when their group comes,
     CONVERT_BATCH pieces read at a time, rows past the end zeroed, chunks past it skipped), the CTA's v rows and
     the 8-head rows of a and b (NUM_STAGES stages: the steps' group, the key warps' and the one in flight). The
     step warps issue the state's loads first, beside the sequence bounds.
  2. Key warps, chunk c each: the gates of its 16 tokens (log g in base 2, beta, inclusive scan G), A =
     strict_tril(beta_i exp(G_i - G_j) k_i . k_j) in fp32, P = tril(exp(G_i - G_j) q_i . k_j) in fp16, T by forward
     substitution (16 lanes, fp32, stored fp16), into one of KEY_BUFFERS key buffers; then a named-barrier arrival
     (READY) for the steps. They reuse a buffer and a stage once the steps have arrived at FREE for its last group.
  3. Step warps, each alone, per chunk: S0 K^T (two MMA chains over alternate K blocks) and S0 Q^T;
     Xb^T = beta (V^T - exp(G) S0 K^T); V'^T = Xb^T T^T; O^T = scale (exp(G) S0 Q^T + V'^T P^T), stored;
     S = exp(G_last) S + (V' exp(G_last - G))^T K. Each accumulator becomes the next product's A operand in registers
     (S0, Xb^T, V'^T, V'c^T rounded to fp16; `hand_over_order`); only B operands (k, q, T, P) come from shared
     memory, so the chain has no barrier but the group's READY: ~330 SASS instructions a step, 52 of them MMAs.
The final rows go to `new_state`. Tokens past the end have k = q = 0, log g = 0 and beta = 0 and add nothing; a
sequence of length 0 runs no chunk and stores a zero state.

Shared memory ~149 KiB and 175 registers a thread: one CTA an SM (`_NarrowWarpChain` ~131 KiB, 154 registers). From
ADAPTIVE_FROM_SEQS sequences, where the grid of slice CTAs outgrows the GPU, `_AdaptiveWarpChain` takes the batch: 8
step warps (~173 KiB, 168 registers), so that a CTA can step all 128 rows of its head (two chains a scheduler, one
key side a head; its other slice CTA exits) or its slice alone, by its sequence's length against the longest
(WHOLE_HEAD_SLOWDOWN); a slice CTA's idle step warpgroup leaves its registers to the other two (SLICE_MODE_REGS).
Each is compiled once (dynamic T and N) into one TVM-FFI function (token_serial.py's launcher and cache).
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from . import token_serial
from .chunked import (
    BLOCK,
    COPY_ELEMS,
    LOG2_E,
    MAX_RANKED_SEQS,
    PIECES_PER_ROW,
    WARP_SIZE,
    WIDE_STRIDE,
    _Chunked,
    _make_operand_copies,
    _make_warp_mma,
    min_ranked_seqs,
    sequence_bounds,
)
from .token_serial import GPU_ARCH, HEAD_SIZE, NUM_V_HEADS, V_HEADS_PER_QK_HEAD, GdnShapeError, resolve_scale

__all__ = ["CHUNK", "GROUP_CHUNKS", "GdnShapeError", "compile_only", "resolve_scale", "run"]

CHUNK = BLOCK  # tokens per chunk: one MMA tile edge
ROWS_PER_WARP = BLOCK  # state rows (V) a warp steps: the MMA's M
GROUP_CHUNKS = 4  # chunks staged at once, one a warp for the state-free half: a sequence of <= 64 tokens in one group
GROUP_TOKENS = GROUP_CHUNKS * CHUNK
KQ_ROWS = 2 * GROUP_TOKENS  # chunk c: k rows 32c..32c+15, then its q rows
NUM_STAGES = 3  # staged inputs: the steps' group, the key warps' group, the copies of the group after it
KEY_BUFFERS = 2  # gates, T and P: the steps' group and the key warps' group
STEP_WARPS = 4  # warps stepping state rows, 16 each: a CTA's slice of 64 V rows
SLICE_ROWS = STEP_WARPS * ROWS_PER_WARP
NUM_SLICES = HEAD_SIZE // SLICE_ROWS  # CTAs of the grid a (sequence, head)
# `_AdaptiveWarpChain`: step warps for all 128 V rows of a head, two a scheduler
ADAPTIVE_STEP_WARPS = HEAD_SIZE // ROWS_PER_WARP
# Its rule: a sequence is long if WHOLE_HEAD_SLOWDOWN (a fraction) times its length exceeds the longest, as a chain
# that shares its scheduler in a whole-head CTA steps ~1.4-1.5x slower; long sequences keep a slice CTA per slice
# unless more of them than one wave of slice CTAs holds, in which case every sequence runs whole heads.
WHOLE_HEAD_SLOWDOWN = (3, 2)
KEY_WARPS = GROUP_CHUNKS  # warps computing the state-free half, a chunk each
# `_AdaptiveWarpChain`'s registers a thread in a slice CTA (setmaxnreg): its idle step warpgroup gives its registers to
# the step and key warpgroups (2 x 240 + 24 warpgroup shares of 168 at launch).
SLICE_MODE_REGS = 240
IDLE_REGS = 24
KEY_THREADS = KEY_WARPS * WARP_SIZE
assert KQ_ROWS * PIECES_PER_ROW % KEY_THREADS == 0  # convert_kq_rows: whole rounds of pieces, every row in range
CONVERT_BATCH = 8  # kq pieces a key thread reads before converting any
assert KQ_ROWS * PIECES_PER_ROW // KEY_THREADS % CONVERT_BATCH == 0
# Named barriers (0 is the CTA's): READY + b, the key warps' group in key buffer b is ready for the steps; FREE + b,
# the steps are done with the group in key buffer b (and its stage); KEY, the key warps alone.
READY_BARRIER = 1
FREE_BARRIER = READY_BARRIER + KEY_BUFFERS
KEY_BARRIER = FREE_BARRIER + KEY_BUFFERS
# fp16 rows of 16 read by ldmatrix, padded to 48 B: the 8 row addresses of one 8x8 matrix fall on distinct bank groups.
TILE_STRIDE = CHUNK + 8
DIAG_STRIDE = CHUNK + 1  # fp32 A, read by the inverse's 16 lanes

# (shape, stride) of the fp16 views the MMAs read through ldmatrix (the tests emulate ldmatrix on exactly these).
KQ_VIEW = ((KQ_ROWS, HEAD_SIZE), (WIDE_STRIDE, 1))
KQ_T_VIEW = ((HEAD_SIZE, KQ_ROWS), (1, WIDE_STRIDE))  # kq read transposed: K as the update's N-major B
TILES_VIEW = ((GROUP_CHUNKS, CHUNK, CHUNK), (CHUNK * TILE_STRIDE, TILE_STRIDE, 1))  # T and P of each chunk

assert 2 * CHUNK <= WARP_SIZE  # the gate scan: one token per lane of the first half-warp
assert HEAD_SIZE % SLICE_ROWS == 0
# The grid of slice CTAs outgrows the GPU (one CTA an SM) from this many sequences: `_AdaptiveWarpChain` takes those.
ADAPTIVE_FROM_SEQS = min_ranked_seqs(NUM_V_HEADS * NUM_SLICES)
# Up to this many sequences a grid of 16-row slice CTAs (`_NarrowWarpChain`) fits the GPU.
NARROW_MAX_SEQS = min_ranked_seqs(NUM_V_HEADS * HEAD_SIZE // ROWS_PER_WARP) - 1
# More long sequences than this fill a wave of slice CTAs: the rank whose length decides (0-based).
WAVE_RANK = ADAPTIVE_FROM_SEQS - 1


def role_threads(rows: int) -> int:
    """Threads taking part in the step and key barriers of a CTA stepping `rows` V rows."""
    return (rows // ROWS_PER_WARP + KEY_WARPS) * WARP_SIZE


def key_waits_for_free(group):
    """Whether the key warps wait at FREE before `group`: its key buffer and the stage of the group after it last
    held group - KEY_BUFFERS, which the steps must be done with (NUM_STAGES = KEY_BUFFERS + 1)."""
    return group >= KEY_BUFFERS


def steps_signal_free(group, num_groups):
    """Whether the steps arrive at FREE after `group`: exactly where the key warps will wait for it, so that no
    arrival is left over when the CTA exits."""
    return group + KEY_BUFFERS < num_groups


assert NUM_STAGES == KEY_BUFFERS + 1


class _WarpChain(_Chunked):
    """The kernel: one CTA = one (sequence, v-head, slice of `slice_rows` V rows); see the module docstring.
    Reuses `_Chunked`'s warp GEMM, gates, decays and diagonal-block inverse."""

    slice_rows: int = SLICE_ROWS
    step_warps: int = STEP_WARPS
    adaptive: bool = False  # whether a CTA may step its head's every row (`_AdaptiveWarpChain`)
    copy_threads: int = KEY_THREADS  # the key warps issue the copies and convert what they copied

    @property
    def rows_per_cta(self) -> int:  # the V rows a CTA can step, hence stage
        return self.step_warps * ROWS_PER_WARP

    @property
    def num_threads(self) -> int:
        return (self.step_warps + KEY_WARPS) * WARP_SIZE

    @cute.jit
    def launch(self, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state, stream):
        tiled_mma = _make_warp_mma()
        f16, bf16, f32 = cutlass.Float16, cutlass.BFloat16, cutlass.Float32
        tiles = KEY_BUFFERS * GROUP_CHUNKS * CHUNK * TILE_STRIDE

        @cute.struct
        class SharedStorage:
            kq: cute.struct.Align[cute.struct.MemRange[f16, NUM_STAGES * KQ_ROWS * WIDE_STRIDE], 128]
            raw_v: cute.struct.Align[cute.struct.MemRange[bf16, NUM_STAGES * GROUP_TOKENS * self.rows_per_cta], 128]
            raw_a: cute.struct.Align[cute.struct.MemRange[bf16, NUM_STAGES * GROUP_TOKENS * NUM_V_HEADS], 128]
            raw_b: cute.struct.Align[cute.struct.MemRange[bf16, NUM_STAGES * GROUP_TOKENS * NUM_V_HEADS], 128]
            a_diag: cute.struct.Align[cute.struct.MemRange[f32, GROUP_CHUNKS * CHUNK * DIAG_STRIDE], 128]
            t16: cute.struct.Align[cute.struct.MemRange[f16, tiles], 128]
            p16: cute.struct.Align[cute.struct.MemRange[f16, tiles], 128]
            cum_log_g: cute.struct.Align[cute.struct.MemRange[f32, KEY_BUFFERS * GROUP_TOKENS], 16]
            beta: cute.struct.Align[cute.struct.MemRange[f32, KEY_BUFFERS * GROUP_TOKENS], 16]

        kernel = self.kernel(
            q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state,
            tiled_mma, SharedStorage,
        )  # fmt: skip
        self.launch_grid(
            kernel, [NUM_V_HEADS * self.num_slices, new_state.shape[0], 1], SharedStorage, stream, self.num_threads,
            min_blocks=1 if self.adaptive else 0,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        state: cute.Tensor,
        A_log: cute.Tensor,
        a: cute.Tensor,
        dt_bias: cute.Tensor,
        b: cute.Tensor,
        cu_seqlens: cute.Tensor,
        scale: cutlass.Float32,
        has_state: cutlass.Int32,
        output: cute.Tensor,
        new_state: cute.Tensor,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, block_y, head, slice_idx, v0, warp_idx, lane = self.slice_coordinates()

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(SharedStorage)
        a_diag = st.a_diag.get_tensor(
            cute.make_layout((GROUP_CHUNKS, CHUNK, CHUNK), stride=(CHUNK * DIAG_STRIDE, DIAG_STRIDE, 1))
        )
        # Grid rows serve the sequences longest first once the grid outgrows the GPU (`_Chunked.sequence_of_block`,
        # one thread per sequence), with a_diag as the scratch; the key warps write it once every thread has read.
        seq = block_y
        if cutlass.const_expr(self.adaptive):
            seq, whole_head = self.plan_of_block(cu_seqlens, block_y, new_state.shape[0], tidx, a_diag)
            # A whole head: its slice-0 CTA steps all NUM_SLICES slices, the others have nothing to do. Each mode is
            # its own code (the row count a constant), so that a slice CTA runs the slice kernel's loops.
            if whole_head != 0:
                if slice_idx == 0:
                    self.roles(
                        tiled_mma, st, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output,
                        new_state, seq, head, cutlass.Int32(0), HEAD_SIZE, tidx, warp_idx, lane, a_diag,
                    )  # fmt: skip
            else:
                self.roles(
                    tiled_mma, st, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output,
                    new_state, seq, head, v0, self.slice_rows, tidx, warp_idx, lane, a_diag,
                )  # fmt: skip
        else:
            if cutlass.const_expr(self.num_threads >= MAX_RANKED_SEQS):
                seq = self.sequence_of_block(cu_seqlens, block_y, new_state.shape[0], tidx, a_diag)
                cute.arch.sync_threads()
            self.roles(
                tiled_mma, st, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state,
                seq, head, v0, self.slice_rows, tidx, warp_idx, lane, a_diag,
            )  # fmt: skip

    @cute.jit
    def plan_of_block(self, cu_seqlens, block_y, num_seqs, tidx, scratch):
        """(sequence, 1 if the CTA steps its head's every row else 0) of this grid row, by the adaptive rule
        (WHOLE_HEAD_SLOWDOWN): the sequences ranked longest first as `sequence_of_block` ranks them, recording the
        longest length and the one at WAVE_RANK. Beyond MAX_RANKED_SEQS sequences, grid order and whole heads."""
        seq = block_y
        whole_head = cutlass.Int32(0)  # a grid that fits the GPU: slice CTAs
        if num_seqs > MAX_RANKED_SEQS:
            whole_head = cutlass.Int32(1)
        if num_seqs >= ADAPTIVE_FROM_SEQS and num_seqs <= MAX_RANKED_SEQS:
            seq = self.sequence_of_block(cu_seqlens, block_y, num_seqs, tidx, scratch, recorded_ranks=(0, WAVE_RANK))
            slots = self.ranking_slots(scratch, 2)  # the lengths by sequence, then the recorded ones
            longest = slots[MAX_RANKED_SEQS + 1]
            slow, fast = WHOLE_HEAD_SLOWDOWN
            whole_head = cutlass.Int32(1)
            if slow * slots[MAX_RANKED_SEQS + 2] <= fast * longest:  # the long sequences fit a wave of slice CTAs
                if slow * slots[seq] > fast * longest:
                    whole_head = cutlass.Int32(0)
        cute.arch.sync_threads()  # every thread has read the scratch before the key warps write it
        return seq, whole_head

    @cute.jit
    def roles(
        self, tiled_mma, st, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state,
        seq, head, v0, rows, tidx, warp_idx, lane, a_diag,
    ):  # fmt: skip
        """The CTA's warps in their roles, stepping `rows` (a constant) V rows from `v0`. Step warps past `rows` (a
        slice of `_AdaptiveWarpChain`) leave at once, their registers to the step and key warps."""
        coords_tile = tiled_mma.get_slice(lane).partition_C(cute.make_identity_tensor((CHUNK, CHUNK)))
        shares_registers = rows < self.rows_per_cta
        if warp_idx * ROWS_PER_WARP < rows:
            if cutlass.const_expr(shares_registers):
                cute.arch.setmaxregister_increase(SLICE_MODE_REGS)
            self.step_role(
                tiled_mma, st, q, v, state, cu_seqlens, scale, has_state, output, new_state, seq, head, v0, rows,
                warp_idx, lane, coords_tile,
            )  # fmt: skip
        elif warp_idx >= self.step_warps:
            if cutlass.const_expr(shares_registers):
                cute.arch.setmaxregister_increase(SLICE_MODE_REGS)
            self.key_role(
                tiled_mma, st, q, k, v, A_log, a, dt_bias, b, cu_seqlens, seq, head, v0, rows,
                tidx - self.step_warps * WARP_SIZE, warp_idx - self.step_warps, lane, a_diag, coords_tile,
            )  # fmt: skip
        else:
            cute.arch.setmaxregister_decrease(IDLE_REGS)

    @cute.jit
    def step_role(
        self, tiled_mma, st, q, v, state, cu_seqlens, scale, has_state, output, new_state, seq, head, v0, rows,
        warp_idx, lane, coords_tile,
    ):  # fmt: skip
        """A step warp: its 16 state rows through every chunk of the sequence, a group once the key warps have
        signalled it ready, then into `new_state`."""
        thr_mma = tiled_mma.get_slice(lane)
        row_block = v0 // ROWS_PER_WARP + warp_idx  # the warp's rows: 16 row_block ..
        # The warp's rows of the state in fp32 accumulators (zeros without a state), issued before the read of the
        # sequence bounds: their latency overlaps it and the key warps' first group; consumed at the first chunk.
        acc_state = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS_PER_WARP, HEAD_SIZE)), cutlass.Float32)
        acc_state.fill(0.0)
        if has_state != 0:
            cute.autovec_copy(thr_mma.partition_C(self.warp_rows(state, seq, head, row_block)), acc_state)
        start, length = sequence_bounds(cu_seqlens, seq, cutlass.Int32(q.shape[0]))
        num_groups = (length + GROUP_TOKENS - 1) // GROUP_TOKENS
        for group in cutlass.range(num_groups, unroll=1):
            group_start = group * GROUP_TOKENS
            group_tokens = cutlass.min(length - group_start, cutlass.Int32(GROUP_TOKENS))
            kq, _, kq_t, raw_v, _, _ = self.staging(st, group % NUM_STAGES, rows)
            cum_log_g, beta, t16, p16 = self.key_buffers(st, group % KEY_BUFFERS)
            cute.arch.barrier(barrier_id=READY_BARRIER + group % KEY_BUFFERS, number_of_threads=role_threads(rows))
            for chunk in cutlass.range((group_tokens + CHUNK - 1) // CHUNK, unroll=1):
                self.chain_step(
                    tiled_mma, lane, warp_idx, chunk, group_tokens, kq, kq_t, raw_v, cum_log_g, beta, t16, p16,
                    acc_state, coords_tile, output, start + group_start, head, v0 + warp_idx * ROWS_PER_WARP, scale,
                )  # fmt: skip
            if steps_signal_free(group, num_groups):
                cute.arch.barrier_arrive(
                    barrier_id=FREE_BARRIER + group % KEY_BUFFERS, number_of_threads=role_threads(rows)
                )
        if length == 0:  # an empty sequence's new state is zero, whatever the initial one
            acc_state.fill(0.0)
        cute.autovec_copy(acc_state, thr_mma.partition_C(self.warp_rows(new_state, seq, head, row_block)))

    @cute.jit
    def key_role(
        self, tiled_mma, st, q, k, v, A_log, a, dt_bias, b, cu_seqlens, seq, head, v0, rows, key_tidx, key_warp,
        lane, a_diag, coords_tile,
    ):  # fmt: skip
        """A key warp: per group, the copies of the next group, then the state-free half of its chunk of this one
        into a key buffer, signalled ready to the steps. It reuses a key buffer (and a stage) once the steps have
        signalled that they are done with the group that held it."""
        start, length = sequence_bounds(cu_seqlens, seq, cutlass.Int32(q.shape[0]))
        num_groups = (length + GROUP_TOKENS - 1) // GROUP_TOKENS
        g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.BFloat16, num_bits_per_copy=128
        )
        if num_groups > 0:
            self.load_group(g2s, q, k, v, a, b, self.staging(st, 0, rows), start, length, 0, head, v0, rows, key_tidx)
        cute.arch.cp_async_commit_group()

        neg_decay_rate = -cute.math.exp(A_log[head]) * LOG2_E  # log g, hence G, in base 2
        bias = dt_bias[head]
        for group in cutlass.range(num_groups, unroll=1):
            buffer = group % KEY_BUFFERS
            group_tokens = cutlass.min(length - group * GROUP_TOKENS, cutlass.Int32(GROUP_TOKENS))
            if key_waits_for_free(group):
                cute.arch.barrier(barrier_id=FREE_BARRIER + buffer, number_of_threads=role_threads(rows))
            if group + 1 < num_groups:
                self.load_group(
                    g2s, q, k, v, a, b, self.staging(st, (group + 1) % NUM_STAGES, rows), start, length, group + 1,
                    head, v0, rows, key_tidx,
                )  # fmt: skip
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)  # this group's copies; the next group's stay in flight
            kq, kq_raw, _, _, raw_a, raw_b = self.staging(st, group % NUM_STAGES, rows)
            self.convert_kq_rows(kq_raw, kq, group_tokens, key_tidx)
            cute.arch.barrier(barrier_id=KEY_BARRIER, number_of_threads=KEY_THREADS)
            cum_log_g, beta, t16, p16 = self.key_buffers(st, buffer)
            if key_warp * CHUNK < group_tokens:
                self.chunk_key_side(
                    tiled_mma, lane, key_warp, group_tokens, kq, raw_a, raw_b, head, neg_decay_rate, bias, cum_log_g,
                    beta, a_diag, t16, p16, coords_tile,
                )  # fmt: skip
            cute.arch.barrier_arrive(barrier_id=READY_BARRIER + buffer, number_of_threads=role_threads(rows))

    @cute.jit
    def key_buffers(self, st, buffer):
        """(cum_log_g, beta, t16, p16) of one key buffer: the group's gates (inclusive G in base 2, beta per token) and
        each chunk's T and P in fp16."""
        tiles_shape, tiles_stride = TILES_VIEW
        buffer_stride = GROUP_CHUNKS * CHUNK * TILE_STRIDE
        tiles = cute.make_layout((KEY_BUFFERS, *tiles_shape), stride=(buffer_stride, *tiles_stride))
        gates = cute.make_layout((KEY_BUFFERS, GROUP_TOKENS), stride=(GROUP_TOKENS, 1))
        return (
            st.cum_log_g.get_tensor(gates)[buffer, None],
            st.beta.get_tensor(gates)[buffer, None],
            st.t16.get_tensor(tiles)[buffer, None, None, None],
            st.p16.get_tensor(tiles)[buffer, None, None, None],
        )

    @cute.jit
    def staging(self, st, stage, rows):
        """(kq, kq_raw, kq_t, raw_v, raw_a, raw_b) of one stage of the staging buffers: the group's fp16 k and q rows
        (as `kq_piece` places them), the same read as bf16 (copied in, converted in place) and transposed (ldmatrix
        .trans), the CTA's `rows` bf16 v rows, and the 8-head a and b rows of each chunk."""
        kq_shape, (row_stride, _) = KQ_VIEW
        kq_layout = cute.make_layout((NUM_STAGES, *kq_shape), stride=(KQ_ROWS * row_stride, row_stride, 1))
        kq_all = st.kq.get_tensor(kq_layout)
        kq = kq_all[stage, None, None]
        kq_raw = cute.make_tensor(cute.recast_ptr(kq_all.iterator, dtype=cutlass.BFloat16), kq_layout)
        kq_raw = kq_raw[stage, None, None]
        kq_t_layout = cute.make_layout((NUM_STAGES, *KQ_T_VIEW[0]), stride=(KQ_ROWS * row_stride, *KQ_T_VIEW[1]))
        kq_t = cute.make_tensor(kq_all.iterator, kq_t_layout)[stage, None, None]
        raw_v = st.raw_v.get_tensor(
            cute.make_layout((NUM_STAGES, GROUP_TOKENS, rows), stride=(GROUP_TOKENS * rows, rows, 1))
        )[stage, None, None]
        gate_rows = cute.make_layout(
            (NUM_STAGES, GROUP_CHUNKS, CHUNK, NUM_V_HEADS),
            stride=(GROUP_TOKENS * NUM_V_HEADS, CHUNK * NUM_V_HEADS, NUM_V_HEADS, 1),
        )
        raw_a = st.raw_a.get_tensor(gate_rows)[stage, None, None, None]
        raw_b = st.raw_b.get_tensor(gate_rows)[stage, None, None, None]
        return kq, kq_raw, kq_t, raw_v, raw_a, raw_b

    @cute.jit
    def warp_rows(self, state: cute.Tensor, seq: cutlass.Int32, head: cutlass.Int32, row_block: cutlass.Int32):
        """The warp's [16, 128] rows of a [N, 8, 128, 128] state."""
        return cute.local_tile(state[seq, head, None, None], (ROWS_PER_WARP, HEAD_SIZE), (row_block, 0))

    @cute.jit
    def load_group(self, g2s, q, k, v, a, b, staging, start, length, group, head, v0, rows, tidx):
        """cp.async of one group's inputs into a stage (`staging`'s views): its k and q rows (the head's q/k head) into
        kq_raw as `kq_piece` places them, the CTA's `rows` rows of v from `v0`, the 8-head rows of a and b; tokens past
        the end are skipped."""
        _, kq_raw, _, raw_v, raw_a, raw_b = staging
        first = start + group * GROUP_TOKENS
        tokens = cutlass.min(length - group * GROUP_TOKENS, cutlass.Int32(GROUP_TOKENS))
        qk_head = head // V_HEADS_PER_QK_HEAD
        threads = self.copy_threads
        for i in cutlass.range_constexpr((KQ_ROWS * PIECES_PER_ROW + threads - 1) // threads):
            row, piece, token, is_q = self.kq_piece(i * threads + tidx)
            if row < KQ_ROWS and token < tokens:
                dst = cute.local_tile(kq_raw[row, None], (COPY_ELEMS,), (piece,))
                if is_q:
                    cute.copy(g2s, cute.local_tile(q[first + token, qk_head, None], (COPY_ELEMS,), (piece,)), dst)
                else:
                    cute.copy(g2s, cute.local_tile(k[first + token, qk_head, None], (COPY_ELEMS,), (piece,)), dst)
        v_pieces = rows // COPY_ELEMS
        for i in cutlass.range_constexpr((GROUP_TOKENS * v_pieces + threads - 1) // threads):
            linear = i * threads + tidx
            token = linear // v_pieces
            piece = linear % v_pieces
            if token < tokens:
                cute.copy(
                    g2s,
                    cute.local_tile(v[first + token, head, None], (COPY_ELEMS,), (v0 // COPY_ELEMS + piece,)),
                    cute.local_tile(raw_v[token, None], (COPY_ELEMS,), (piece,)),
                )
        for i in cutlass.range_constexpr((2 * GROUP_TOKENS + threads - 1) // threads):
            linear = i * threads + tidx
            token = linear % GROUP_TOKENS
            if linear < 2 * GROUP_TOKENS and token < tokens:
                rows_a = raw_a[token // CHUNK, token % CHUNK, None]
                rows_b = raw_b[token // CHUNK, token % CHUNK, None]
                if linear < GROUP_TOKENS:
                    cute.copy(g2s, a[first + token, None], rows_a)
                else:
                    cute.copy(g2s, b[first + token, None], rows_b)

    @cute.jit
    def kq_piece(self, linear: cutlass.Int32):
        """(row of kq, 16-B piece, token of the group, whether a q row) of the `linear`-th piece: chunk c holds its
        16 k rows at rows 32c.., then its 16 q rows."""
        row = linear // PIECES_PER_ROW
        within = row % (2 * CHUNK)
        token = (row // (2 * CHUNK)) * CHUNK + within % CHUNK
        return row, linear % PIECES_PER_ROW, token, within >= CHUNK

    @cute.jit
    def convert_kq_rows(self, kq_raw: cute.Tensor, kq: cute.Tensor, tokens: cutlass.Int32, tidx: cutlass.Int32):
        """kq = fp16 of the bf16 rows copied in, rows of tokens past the end zeroed, chunks past the end left alone
        (no warp reads them). Each thread rewrites the pieces it copied itself (`load_group`'s mapping), so the
        in-place conversion needs no barrier before it. Its pieces are read CONVERT_BATCH at a time before any is
        written back: the stores may alias the loads, which would otherwise wait for one another one by one."""
        threads = self.copy_threads
        count = KQ_ROWS * PIECES_PER_ROW // threads
        raw = cute.make_rmem_tensor((CONVERT_BATCH, COPY_ELEMS), cutlass.BFloat16)
        for batch in cutlass.range_constexpr(0, count, CONVERT_BATCH):
            for i in cutlass.range_constexpr(CONVERT_BATCH):
                row, piece, _, _ = self.kq_piece((batch + i) * threads + tidx)
                raw[i, None].store(cute.local_tile(kq_raw[row, None], (COPY_ELEMS,), (piece,)).load())
            for i in cutlass.range_constexpr(CONVERT_BATCH):
                row, piece, token, _ = self.kq_piece((batch + i) * threads + tidx)
                if token - token % CHUNK < tokens:
                    dst = cute.local_tile(kq[row, None], (COPY_ELEMS,), (piece,))
                    if token < tokens:
                        dst.store(raw[i, None].load().to(cutlass.Float32).to(cutlass.Float16))
                    else:
                        dst.fill(0.0)

    @cute.jit
    def chunk_key_side(
        self, tiled_mma, lane, chunk, group_tokens, kq, raw_a, raw_b, head, neg_decay_rate, bias, cum_log_g, beta,
        a_diag, t16, p16, coords_tile,
    ):  # fmt: skip
        """One warp: the state-free half of `chunk` of the group (its gates, A, P and T)."""
        copy_a, copy_b, _ = _make_operand_copies(tiled_mma)
        first = chunk * CHUNK
        tokens_here = cutlass.min(group_tokens - first, cutlass.Int32(CHUNK))

        # Gates: lane l < 16 takes token l (zero past the end), then G = inclusive sum over the chunk (base 2).
        log_g, gate_beta = self.token_gates(raw_a, raw_b, chunk, head, neg_decay_rate, bias, tokens_here, lane)
        inclusive = log_g
        offset = 1
        while offset < CHUNK:
            from_below = cute.arch.shuffle_sync_up(inclusive, offset)
            inclusive = inclusive + (from_below if lane >= offset else cutlass.Float32(0.0))
            offset *= 2
        if lane < CHUNK:
            cum_log_g[first + lane] = inclusive
            beta[first + lane] = gate_beta
        cute.arch.sync_warp()

        k_rows = cute.local_tile(kq, (CHUNK, HEAD_SIZE), (2 * chunk, 0))
        q_rows = cute.local_tile(kq, (CHUNK, HEAD_SIZE), (2 * chunk + 1, 0))
        acc = cute.make_rmem_tensor(tiled_mma.get_slice(lane).partition_shape_C((CHUNK, CHUNK)), cutlass.Float32)
        values = cute.make_rmem_tensor(acc.layout, cutlass.Float32)
        acc.fill(0.0)
        self.warp_gemm(tiled_mma, copy_a, copy_b, lane, k_rows, k_rows, acc)
        for e in cutlass.range_constexpr(cute.size(acc)):
            i = coords_tile[e][0]
            j = coords_tile[e][1]
            exponent = cutlass.min(cum_log_g[first + i] - cum_log_g[first + j], cutlass.Float32(0.0))
            below = beta[first + i] * self.decay(exponent) * acc[e]
            values[e] = cutlass.Float32(cutlass.select_(j < i, below, cutlass.Float32(0.0)))
        for e in cutlass.range_constexpr(cute.size(acc)):
            a_diag[chunk, coords_tile[e][0], coords_tile[e][1]] = values[e]

        acc.fill(0.0)
        self.warp_gemm(tiled_mma, copy_a, copy_b, lane, q_rows, k_rows, acc)
        for e in cutlass.range_constexpr(cute.size(acc)):
            i = coords_tile[e][0]
            j = coords_tile[e][1]
            exponent = cutlass.min(cum_log_g[first + i] - cum_log_g[first + j], cutlass.Float32(0.0))
            below = self.decay(exponent) * acc[e]
            values[e] = cutlass.Float32(cutlass.select_(j <= i, below, cutlass.Float32(0.0)))
        for e in cutlass.range_constexpr(cute.size(acc)):
            p16[chunk, coords_tile[e][0], coords_tile[e][1]] = values[e].to(cutlass.Float16)
        cute.arch.sync_warp()

        if lane < CHUNK:  # column `lane` of T, whole (zeros above the diagonal included)
            self.invert_diagonal_block(a_diag[chunk, None, None], t16[chunk, None, None], lane)

    @cute.jit
    def chain_step(
        self, tiled_mma, lane, warp_idx, chunk, group_tokens, kq, kq_t, raw_v, cum_log_g, beta, t16, p16, acc_state,
        coords_tile, output, first_token, head, row0, scale,
    ):  # fmt: skip
        """One warp, one chunk of the group: S0 -> output rows and S (the module docstring's step 3), every hand-over
        from an accumulator to the next product's A operand in registers. `first_token`: the group's first row of
        `output`; `row0`: the warp's first V row."""
        _, copy_b, copy_bt = _make_operand_copies(tiled_mma)
        thr_mma = tiled_mma.get_slice(lane)
        first = chunk * CHUNK
        tokens_here = cutlass.min(group_tokens - first, cutlass.Int32(CHUNK))
        g_last = cum_log_g[first + CHUNK - 1]
        k_rows = cute.local_tile(kq, (CHUNK, HEAD_SIZE), (2 * chunk, 0))
        q_rows = cute.local_tile(kq, (CHUNK, HEAD_SIZE), (2 * chunk + 1, 0))
        k_cols = cute.local_tile(kq_t, (HEAD_SIZE, CHUNK), (0, 2 * chunk))
        state_order = hand_over_order(tiled_mma, (ROWS_PER_WARP, HEAD_SIZE))
        tile_order = hand_over_order(tiled_mma, (ROWS_PER_WARP, CHUNK))

        # S0 in fp16, the A operand of both state products.
        state_a = cute.make_rmem_tensor(thr_mma.partition_shape_A((ROWS_PER_WARP, HEAD_SIZE)), cutlass.Float16)
        for block in cutlass.range_constexpr(cute.size(state_a) // 8):  # nested: static loops of a few steps each
            for i in cutlass.range_constexpr(8 * block, 8 * block + 8):
                state_a[i] = acc_state[state_order[i]].to(cutlass.Float16)
        acc_y = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS_PER_WARP, CHUNK)), cutlass.Float32)
        acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS_PER_WARP, CHUNK)), cutlass.Float32)
        acc_y_odd = cute.make_rmem_tensor(acc_y.layout, cutlass.Float32)
        acc_y.fill(0.0)
        acc_y_odd.fill(0.0)
        self.register_gemm(tiled_mma, copy_b, lane, state_a, k_rows, acc_y, acc_y_odd)  # (K S0^T)^T, on the chain
        acc_o.fill(0.0)
        self.register_gemm(tiled_mma, copy_b, lane, state_a, q_rows, acc_o)  # (Q S0^T)^T

        # Xb^T[r, j] = beta_j (v_j[r] - exp(G_j) (S0 k_j)[r]), 0 past the end (raw_v may hold NaN there: the select
        # drops it); the state's part of the output decayed to each token.
        values = cute.make_rmem_tensor(acc_y.layout, cutlass.Float32)
        for e in cutlass.range_constexpr(cute.size(acc_y)):
            r = coords_tile[e][0]
            j = coords_tile[e][1]
            fresh = raw_v[first + j, warp_idx * ROWS_PER_WARP + r].to(cutlass.Float32)
            real = beta[first + j] * (fresh - self.decay(cum_log_g[first + j]) * (acc_y[e] + acc_y_odd[e]))
            values[e] = cutlass.Float32(cutlass.select_(j < tokens_here, real, cutlass.Float32(0.0)))
            acc_o[e] = self.decay(cum_log_g[first + j]) * acc_o[e]
        xb_a = cute.make_rmem_tensor(thr_mma.partition_shape_A((ROWS_PER_WARP, CHUNK)), cutlass.Float16)
        for i in cutlass.range_constexpr(cute.size(xb_a)):
            xb_a[i] = values[tile_order[i]].to(cutlass.Float16)

        # V'^T = Xb^T T^T, in fp16 as is (the A operand of O) and decayed to the chunk's end (of the update).
        acc_y.fill(0.0)
        self.register_gemm(tiled_mma, copy_b, lane, xb_a, t16[chunk, None, None], acc_y)
        for e in cutlass.range_constexpr(cute.size(acc_y)):
            values[e] = acc_y[e] * self.decay(g_last - cum_log_g[first + coords_tile[e][1]])
        vn_a = cute.make_rmem_tensor(xb_a.layout, cutlass.Float16)
        vnc_a = cute.make_rmem_tensor(xb_a.layout, cutlass.Float16)
        for i in cutlass.range_constexpr(cute.size(vn_a)):
            vn_a[i] = acc_y[tile_order[i]].to(cutlass.Float16)
            vnc_a[i] = values[tile_order[i]].to(cutlass.Float16)

        # O^T += V'^T P^T, scaled, stored for the chunk's tokens.
        self.register_gemm(tiled_mma, copy_b, lane, vn_a, p16[chunk, None, None], acc_o)
        for e in cutlass.range_constexpr(cute.size(acc_o)):
            i = coords_tile[e][1]
            if i < tokens_here:
                output[first_token + first + i, head, row0 + coords_tile[e][0]] = (scale * acc_o[e]).to(
                    cutlass.BFloat16
                )

        # S = exp(G_last) S + V'c^T K.
        chunk_decay = self.decay(g_last)
        for e in cutlass.range(cute.size(acc_state), unroll_full=True):
            acc_state[e] = chunk_decay * acc_state[e]
        self.register_gemm(tiled_mma, copy_bt, lane, vnc_a, k_cols, acc_state)

    @cute.jit
    def register_gemm(
        self, tiled_mma: cute.TiledMma, copy_b: cute.TiledCopy, lane, a_frag: cute.Tensor, s_b: cute.Tensor, acc,
        acc_odd: cute.Tensor | None = None,
    ):  # fmt: skip
        """acc[M, N] += A[M, K] s_b[N, K]^T by one warp: A already in registers (`a_frag`, the MMA's A fragment of
        [M, K]), B from shared memory by ldmatrix (`copy_b`: K-major, or N-major with .trans). With `acc_odd` the odd
        16-wide K blocks accumulate there instead: two dependent MMA chains of half the depth, which the caller adds."""
        thr_mma = tiled_mma.get_slice(lane)
        thr_b = copy_b.get_slice(lane)
        t_sb = thr_b.partition_S(s_b)
        t_rb = thr_mma.make_fragment_B(thr_mma.partition_B(s_b))
        t_rb_view = thr_b.retile(t_rb)
        for kk in cutlass.range_constexpr(cute.size(t_sb.shape[2])):
            cute.copy(copy_b, t_sb[None, None, kk], t_rb_view[None, None, kk])
            target = acc if acc_odd is None or kk % 2 == 0 else acc_odd
            cute.gemm(tiled_mma, target, a_frag[None, None, kk], t_rb[None, None, kk], target)


class _AdaptiveWarpChain(_WarpChain):
    """The warp chain for grids that outgrow the GPU: 8 step warps, so that a CTA can step its head's every row,
    two chains a scheduler and one key side a head where slice CTAs compute it twice (fewer CTAs, more work an
    SM), or only its slice with four of them (each chain at full speed, on the 8-warp kernel's registers). The CTA
    picks by its sequence's length against the longest (`plan_of_block`)."""

    step_warps: int = ADAPTIVE_STEP_WARPS
    adaptive: bool = True


class _NarrowWarpChain(_WarpChain):
    """The warp chain on 16-row slices, one step warp a CTA: for batches of a few short sequences, where the 64-row
    CTAs would leave most SMs idle while the state's round trip and the first group's key half bound the call."""

    slice_rows: int = ROWS_PER_WARP
    step_warps: int = 1


def hand_over_order(tiled_mma: cute.TiledMma, tile: tuple[int, int]) -> tuple[int, ...]:
    """For each element of a lane's A fragment over `tile` ([M, K]), the index of the element of its accumulator
    fragment over the same [M, N] shape that holds the same (row, column): how an accumulator becomes the next
    product's A operand in registers (an m16n8 accumulator pair is an m16k16 A block). Traced on lane 0 at compile
    time; every lane's fragments differ from lane 0's by the same offset in both (test_gdn_warp_chain.py checks all)."""
    c = tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor(tile))
    a = tiled_mma.get_slice(0).partition_A(cute.make_identity_tensor(tile))
    where = {tuple(c[i]): i for i in range(cute.size(c))}
    return tuple(where[tuple(a[i])] for i in range(cute.size(a)))


# ------------------------------------------------------------------------------------------------
# Host side: token_serial.py's launcher and compile cache (keyed on the kernel class).
# ------------------------------------------------------------------------------------------------


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the kernel for `arch` without touching a GPU (for CI and warm-up)."""
    kernels = (_NarrowWarpChain, _WarpChain, _AdaptiveWarpChain)
    return tuple(token_serial.compiled_for(arch, kernel) for kernel in kernels)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """Destination-passing entry: fills `output` [T,8,128] bf16 and `new_state` [N,8,128,128] fp32; one launch, no
    host sync. `state` None means zeros; `scale` None or 0 means 1/sqrt(128)."""
    num_seqs = new_state.shape[0]
    if num_seqs <= NARROW_MAX_SEQS:
        kernel = _NarrowWarpChain
    elif num_seqs < ADAPTIVE_FROM_SEQS:
        kernel = _WarpChain
    else:
        kernel = _AdaptiveWarpChain
    token_serial.run_kernel(kernel, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
