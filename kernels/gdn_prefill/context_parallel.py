"""GDN prefill, context-parallel path (`kernel.py` takes it for one sequence of CONTEXT_PARALLEL_MIN_TOKENS or
more): the WY path with the sequence cut into segments that run in parallel (NOTES.md, "Context-parallel
path"; the algebra and its PyTorch model are `cp_model.py`'s).

Why: the WY chain walks a sequence's chunks one after another, 8 head chains for one sequence, so one long
sequence leaves most SMs idle (8192 tokens ~355 us). Per (sequence, head) a run of tokens maps the state
affinely, S_out = S_in M + B, and M, B of a segment need no S_in.

The kernels below run on a *virtual batch* whose sequences are the segments: a sequence of
n > 2 L tokens (L = `segment_tokens`, a multiple of 64) becomes ceil(n / L) segments, a shorter one stays one.
Segment j of sequence s has slot first_segment_slot(s, start_s, L) + j (`cp_model.segment_bound`: unique
slots below segment_bound(N, T, L), a size known on the host); `seg_cu` holds the virtual batch's bounds, the
slots that hold no segment being empty sequences. Every segment starts on a chunk boundary of its sequence,
so each chunk's key side, and so its workspace entry, is the unsplit batch's. In one compiled call:

1. `_SegmentBounds`: `seg_cu` from `cu_seqlens` (one thread per slot, a binary search over the sequences), and
   per slot whether the scan reads its summary (every segment of a split sequence but its last).
2. `wy_prepass._KeySide` on the virtual batch.
3. `_Summary` on the virtual batch: per (segment, head) one CTA walks the segment once with a 256-row state,
   B (rows 0-127: the real values, from zero) and M (rows 128-255: zero values, from the identity; row i of M
   is where the state row e_i goes), the WGMMA chain's arithmetic without outputs; segments the scan does not
   read are skipped.
4. `_Scan`, per (sequence, head, 8 state rows), sequential over the sequence's segments in fp32 FMA:
   S_in(0) = the initial state (or zero), S_in(j + 1) = S_in(j) M_j + B_j, each S_in(j) to `seg_state`.
5. The chain on the virtual batch from `seg_state`: the outputs, each segment's final state. The chain is the WY
   path's for that many sequences (`wgmma_value_side.chain_config`): the WGMMA chain from 15 segments,
   `wy_prepass.py`'s below.
6. `_FinalStates`: `new_state` of each sequence is its last segment's final state (zero if it is empty).
"""

from __future__ import annotations

from typing import Callable

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor

from . import cp_model, token_serial, wgmma_value_side, wy_prepass
from .chunked import CHUNK, sequence_bounds
from .token_serial import GPU_ARCH, HEAD_SIZE, NUM_V_HEADS, GdnShapeError, resolve_scale
from .wy_prepass import WyPrepassConfig, _KeySide, _ValueSide

__all__ = [
    "CP_SEGMENTS",
    "GdnShapeError",
    "compile_only",
    "resolve_scale",
    "run",
    "segment_tokens_for",
]

# Segments per call: 16 (segment, head) chains x 8 heads = 128 CTAs, one wave on 132 SMs, on the WGMMA chain
# (from 15 segments); best of L / 2, L, 2 L at 4K-64K tokens. FlashInfer's SM90 CP path takes 16 on H200 too.
CP_SEGMENTS = 16
SCAN_ROWS = 8  # state rows per scan CTA, one column per thread
ROW_BLOCKS = HEAD_SIZE // SCAN_ROWS
STAGE_ROWS = HEAD_SIZE + SCAN_ROWS  # a scan stage: M_j and the CTA's rows of B_j
SCAN_STAGES = 3  # 204 KB of stages (224 KB with the rows and partials): one CTA per SM, as with two
SCAN_K_SPLIT = HEAD_SIZE // 32  # parts of K: one a scan warp
TILE_COLS = HEAD_SIZE // 32  # columns of a scan thread's tile: a warp's 32 tiles cover the row
SLOT_THREADS = 128


def segment_tokens_for(num_tokens: int) -> int:
    """L in tokens from the shapes: the call's tokens in at least CP_SEGMENTS segments of whole chunks."""
    return CHUNK * max(1, num_tokens // (CP_SEGMENTS * CHUNK))


@cute.jit
def segment_count(length: cutlass.Int32, segment_tokens: cutlass.Int32) -> cutlass.Int32:
    """`cp_model.segment_count` with split_tokens = 2 L: none for an empty sequence, one up to 2 L tokens."""
    count = cutlass.Int32(0)
    if length > 0:
        count = cutlass.Int32(1)
        if length > 2 * segment_tokens:
            count = (length + segment_tokens - 1) // segment_tokens
    return count


@cute.jit
def first_segment_slot(seq: cutlass.Int32, start: cutlass.Int32, segment_tokens: cutlass.Int32) -> cutlass.Int32:
    """`cp_model.segment_bound(seq, start, L)`: the slot of sequence `seq`'s first segment."""
    m = cutlass.min(seq, start)
    return m + (start - m) // segment_tokens


@cute.jit
def sequence_segments(cu_seqlens: cute.Tensor, seq, segment_tokens, total_tokens):
    """(start, length, first slot, segment count) of sequence `seq`."""
    start, length = sequence_bounds(cu_seqlens, seq, total_tokens)
    return start, length, first_segment_slot(seq, start, segment_tokens), segment_count(length, segment_tokens)


class _SegmentBounds:
    """Kernel 1: seg_cu[i] = the first token of slot i's segment; a slot with no segment is an empty sequence at
    the end of the sequence before it (at the first sequence's start before it); seg_cu[S] = the last end.
    summarized[i] = 1 where the scan reads slot i's summary: a segment of a split sequence other than its last."""

    @cute.jit
    def launch(self, cu_seqlens, seg_cu, summarized, segment_tokens, total_tokens, stream):
        self.kernel(cu_seqlens, seg_cu, summarized, segment_tokens, total_tokens).launch(
            grid=[(seg_cu.shape[0] + SLOT_THREADS - 1) // SLOT_THREADS, 1, 1], block=[SLOT_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        cu_seqlens: cute.Tensor,
        seg_cu: cute.Tensor,
        summarized: cute.Tensor,
        segment_tokens: cutlass.Int32,
        total_tokens: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        slot = bidx * SLOT_THREADS + tidx
        num_slots = cutlass.Int32(seg_cu.shape[0] - 1)
        last_seq = cutlass.Int32(cu_seqlens.shape[0] - 2)
        if slot <= num_slots:
            seq = last_seq
            if slot < num_slots:
                seq = wy_prepass.last_sequence_from(
                    cu_seqlens, slot, total_tokens, lambda s, start: first_segment_slot(s, start, segment_tokens)
                )
            start, length, first, count = sequence_segments(cu_seqlens, seq, segment_tokens, total_tokens)
            index = slot - first
            bound = start + length
            if slot < num_slots and index < count:
                bound = start + cutlass.max(index, cutlass.Int32(0)) * segment_tokens
            seg_cu[slot] = cutlass.Int64(bound)
            if slot < num_slots:
                read_by_scan = cutlass.Int32(0)
                if index >= 0:
                    if index < count - 1:
                        read_by_scan = cutlass.Int32(1)
                summarized[slot] = read_by_scan


class _Summary(wgmma_value_side.WgmmaValueSide):
    """Kernel 3: [B; M] of every summarized (segment, head), one CTA of four warpgroups each (64 rows of the
    256-row state), the WGMMA chain's walk without outputs (`WgmmaValueSide.summary`). `summaries`
    [slots, 8, 256, 128] fp32: B in rows 0-127, M in rows 128-255; a slot the scan does not read is not written."""

    summary = True
    warpgroups = 4

    @cute.jit
    def launch(self, q, k, v, seg_cu, summarized, summaries, ws_tp, ws_g, stream):
        update_mma, products_mma, keys_k_major, keys_mn_major, square = wgmma_value_side.operands(self.warpgroups)
        SharedStorage = self.shared_storage(keys_k_major, square)
        kernel = self.kernel(
            q, k, v, seg_cu, summarized, summaries, ws_tp, ws_g, update_mma, products_mma, keys_k_major,
            keys_mn_major, square, SharedStorage,
        )  # fmt: skip
        self.launch_grid(kernel, [NUM_V_HEADS, summaries.shape[0], 1], SharedStorage, stream, threads=self.threads)

    @cute.kernel
    def kernel(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        seg_cu: cute.Tensor,
        summarized: cute.Tensor,
        summaries: cute.Tensor,
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
        head, slot, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        buffers = self.buffers(storage, keys_k_major, keys_mn_major, square)
        start, length = sequence_bounds(seg_cu, slot, q.shape[0])
        if summarized[slot] == 0:
            length = cutlass.Int32(0)

        rows = self.state_rows
        thr_update = update_mma.get_slice(tidx)
        state = cute.make_rmem_tensor(thr_update.partition_shape_C((rows, HEAD_SIZE)), cutlass.Float32)
        state_coords = thr_update.partition_C(cute.make_identity_tensor((rows, HEAD_SIZE)))
        for i in cutlass.range_constexpr(cute.size(state)):
            row, col = state_coords[i]
            state[i] = cutlass.Float32(cutlass.select_(row - HEAD_SIZE == col, cutlass.Float32(1.0), cutlass.Float32(0.0)))

        self.walk(
            state, q, k, v, ws_tp, ws_g, start, length, slot, head, buffers, cutlass.Float32(0.0), None,
            update_mma, products_mma, tidx,
        )  # fmt: skip
        if length > 0:
            for i in cutlass.range_constexpr(cute.size(state)):
                row, col = state_coords[i]
                summaries[slot, head, row, col] = state[i]


class _SequenceRows:
    """A grid of (ROW_BLOCKS x 8 heads, N) CTAs of HEAD_SIZE threads: SCAN_ROWS state rows of one (sequence,
    head) per CTA, one state column per thread (each warp's accesses of a row are 128 contiguous bytes)."""

    @staticmethod
    def coordinates():
        col, _, _ = cute.arch.thread_idx()
        block, seq, _ = cute.arch.block_idx()
        return col, seq, block // ROW_BLOCKS, (block % ROW_BLOCKS) * SCAN_ROWS

    @staticmethod
    def grid(num_seqs) -> list:
        return [ROW_BLOCKS * NUM_V_HEADS, num_seqs, 1]


class _Scan(_SequenceRows):
    """Kernel 4: S_in of every segment, S_in(j + 1) = S_in(j) M_j + B_j in fp32 (unrounded: with decays near 1
    the state survives every step); B_j and M_j are rows 0-127 and 128-255 of `summaries[j]`. M_j and the CTA's
    rows of B_j arrive by two bulk copies (thread 0, completing on the stage's mbarrier) into one of SCAN_STAGES
    shared-memory stages, issued two steps ahead.

    A step is the [SCAN_ROWS, 128] x [128, 128] product, bound by what shared memory delivers to registers (ncu):
    so each thread accumulates a SCAN_ROWS x TILE_COLS tile over one of SCAN_K_SPLIT parts of K (per K index
    two broadcast 16-B loads of the rows and one 16-B load of M_j for 32 FMAs, against 9 loads for 8), the warps'
    partial tiles meet in `partials`, and thread i sums column i, as it stores it."""

    @cute.jit
    def launch(self, cu_seqlens, state, has_state, summaries, seg_state, segment_tokens, total_tokens, stream):
        @cute.struct
        class SharedStorage:
            stages: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, SCAN_STAGES * STAGE_ROWS * HEAD_SIZE], 128]
            rows: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, SCAN_ROWS * HEAD_SIZE], 32]
            partials: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, SCAN_K_SPLIT * SCAN_ROWS * HEAD_SIZE], 16]
            full: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, SCAN_STAGES], 8]

        self.kernel(cu_seqlens, state, has_state, summaries, seg_state, segment_tokens, total_tokens, SharedStorage).launch(
            grid=self.grid(state.shape[0]), block=[HEAD_SIZE, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
            preferred_smem_carveout=100,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        cu_seqlens: cute.Tensor,
        state: cute.Tensor,
        has_state: cutlass.Int32,
        summaries: cute.Tensor,
        seg_state: cute.Tensor,
        segment_tokens: cutlass.Int32,
        total_tokens: cutlass.Int32,
        SharedStorage: cutlass.Constexpr,
    ):
        col, seq, head, row0 = self.coordinates()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        # (stage, row, column): rows 0-127 M_j, then this CTA's SCAN_ROWS rows of B_j
        stages = storage.stages.get_tensor(
            cute.make_layout((SCAN_STAGES, STAGE_ROWS, HEAD_SIZE), stride=(STAGE_ROWS * HEAD_SIZE, HEAD_SIZE, 1))
        )
        # The CTA's rows by column: column i's SCAN_ROWS values are contiguous, two 16-B broadcast loads.
        by_column = storage.rows.get_tensor(cute.make_layout((HEAD_SIZE, SCAN_ROWS), stride=(SCAN_ROWS, 1)))
        _, length, first, count = sequence_segments(cu_seqlens, seq, segment_tokens, total_tokens)
        full = storage.full.data_ptr()
        if col == 0:
            for s in cutlass.range_constexpr(SCAN_STAGES):
                cute.arch.mbarrier_init(full + s, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        own = cute.make_rmem_tensor((SCAN_ROWS,), cutlass.Float32)  # column `col` of this CTA's rows
        own.fill(0.0)
        if has_state != 0 and length > 0:
            for r in cutlass.range_constexpr(SCAN_ROWS):
                own[r] = state[seq, head, row0 + r, col]
        for ahead in cutlass.range_constexpr(SCAN_STAGES - 1):  # the first steps' stages
            if ahead + 1 < count:
                self.prefetch(summaries, first + ahead, head, row0, stages[ahead, None, None], col, full + ahead)
        # (K part, row, column): each warp's partial products over its part of K
        partials = storage.partials.get_tensor(
            cute.make_layout((SCAN_K_SPLIT, SCAN_ROWS, HEAD_SIZE), stride=(SCAN_ROWS * HEAD_SIZE, HEAD_SIZE, 1))
        )
        part, tile = col // 32, col % 32  # this thread's part of K (its warp's) and tile of TILE_COLS columns
        k_part = HEAD_SIZE // SCAN_K_SPLIT
        rows_k = cute.make_rmem_tensor((SCAN_ROWS,), cutlass.Float32)
        m_k = cute.make_rmem_tensor((TILE_COLS,), cutlass.Float32)
        acc = cute.make_rmem_tensor(cute.make_layout((SCAN_ROWS, TILE_COLS), stride=(TILE_COLS, 1)), cutlass.Float32)
        for j in cutlass.range(count, unroll=1):
            slot = first + j
            for r in cutlass.range_constexpr(SCAN_ROWS):
                seg_state[slot, head, row0 + r, col] = own[r]
            if j + 1 < count:
                cute.autovec_copy(own, by_column[col, None])
                cute.arch.mbarrier_wait(full + j % SCAN_STAGES, (j // SCAN_STAGES) % 2)
                cute.arch.sync_threads()  # M_j and B_j have landed, every column of S_in(j) is in by_column
                ahead = j + SCAN_STAGES - 1
                if ahead + 1 < count:  # into the stage step j - 1 read
                    self.prefetch(
                        summaries, first + ahead, head, row0, stages[ahead % SCAN_STAGES, None, None], col,
                        full + ahead % SCAN_STAGES,
                    )  # fmt: skip
                stage = stages[j % SCAN_STAGES, None, None]
                acc.fill(0.0)
                for kk in cutlass.range(k_part, unroll_full=True):
                    i = part * k_part + kk
                    cute.autovec_copy(by_column[i, None], rows_k)
                    cute.autovec_copy(cute.local_tile(stage[i, None], (TILE_COLS,), (tile,)), m_k)  # M_j
                    for r in cutlass.range_constexpr(SCAN_ROWS):
                        for c in cutlass.range_constexpr(TILE_COLS):
                            acc[r, c] = acc[r, c] + rows_k[r] * m_k[c]
                for r in cutlass.range_constexpr(SCAN_ROWS):
                    cute.autovec_copy(acc[r, None], cute.local_tile(partials[part, r, None], (TILE_COLS,), (tile,)))
                # The partial tiles are in; every thread has read the rows and the stage before they are overwritten.
                cute.arch.sync_threads()
                for r in cutlass.range_constexpr(SCAN_ROWS):
                    total = stage[HEAD_SIZE + r, col]  # B_j
                    for q in cutlass.range_constexpr(SCAN_K_SPLIT):
                        total = total + partials[q, r, col]
                    own[r] = total

    @cute.jit
    def prefetch(self, summaries: cute.Tensor, slot, head, row0, stage: cute.Tensor, col, barrier):
        """M_slot and the CTA's rows of B_slot into `stage` by two bulk copies of thread 0, completing on `barrier`."""
        if col == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(barrier, STAGE_ROWS * HEAD_SIZE * 4)
            source = summaries[slot, head, None, None]
            _bulk_copy(stage[0, None].iterator, source[HEAD_SIZE, None].iterator, HEAD_SIZE * HEAD_SIZE * 4, barrier)
            _bulk_copy(stage[HEAD_SIZE, None].iterator, source[row0, None].iterator, SCAN_ROWS * HEAD_SIZE * 4, barrier)


@cute.jit
def _bulk_copy(destination, source, num_bytes: cutlass.Constexpr, barrier):
    """`num_bytes` contiguous bytes from global to this CTA's shared memory, completing on its mbarrier `barrier`."""
    cute.arch.inline_ptx(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{$r0}], [{$r1}], %d, [{$r2}];" % num_bytes,
        read_only_args=[
            cutlass.Int32(destination.toint()), cutlass.Int64(source.toint()), cutlass.Int32(barrier.toint())
        ],
    )  # fmt: skip


class _FinalStates(_SequenceRows):
    """Kernel 6: new_state[s] = the final state of sequence s's last segment, zero for an empty sequence."""

    @cute.jit
    def launch(self, cu_seqlens, seg_out, new_state, segment_tokens, total_tokens, stream):
        self.kernel(cu_seqlens, seg_out, new_state, segment_tokens, total_tokens).launch(
            grid=self.grid(new_state.shape[0]), block=[HEAD_SIZE, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        cu_seqlens: cute.Tensor,
        seg_out: cute.Tensor,
        new_state: cute.Tensor,
        segment_tokens: cutlass.Int32,
        total_tokens: cutlass.Int32,
    ):
        col, seq, head, row0 = self.coordinates()
        _, _, first, count = sequence_segments(cu_seqlens, seq, segment_tokens, total_tokens)
        for r in cutlass.range_constexpr(SCAN_ROWS):
            value = cutlass.Float32(0.0)
            if count > 0:
                value = seg_out[first + count - 1, head, row0 + r, col]
            new_state[seq, head, row0 + r, col] = value


class GdnPrefillContextParallelSm90:
    """Host entry: the six steps of the module docstring in one compiled call (stream order), the chains
    `wy_prepass.py`'s at `config`'s width, or `wgmma_value_side.py`'s for config None."""

    def __init__(self, config: WyPrepassConfig | None):
        self.config = config

    @property
    def paired(self) -> bool:
        """A slow chunk's T and V'c as pairs (`accurate_inverse.py`) in the key side, the summary and the outputs
        chain together: with the WGMMA chain; the mma.sync chain reads `chunked.py`'s T."""
        return self.config is None

    def chain(self):
        if self.config is None:
            return wgmma_value_side.WgmmaValueSide(paired=True)
        return _ValueSide(self.config.slice_rows)

    @cute.jit
    def __call__(
        self, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state,
        ws_tp, ws_g, seg_cu, summarized, summaries, seg_state, seg_out, segment_tokens, stream,
    ):  # fmt: skip
        total_tokens = cutlass.Int32(q.shape[0])
        _SegmentBounds().launch(cu_seqlens, seg_cu, summarized, segment_tokens, total_tokens, stream)
        _KeySide(self.paired).launch(q, k, A_log, a, dt_bias, b, seg_cu, ws_tp, ws_g, stream)
        _Summary(self.paired).launch(q, k, v, seg_cu, summarized, summaries, ws_tp, ws_g, stream)
        _Scan().launch(cu_seqlens, state, has_state, summaries, seg_state, segment_tokens, total_tokens, stream)
        self.chain().launch(
            q, k, v, seg_state, A_log, a, dt_bias, b, seg_cu, scale, cutlass.Int32(1), output, seg_out, ws_tp, ws_g,
            stream,
        )  # fmt: skip
        _FinalStates().launch(cu_seqlens, seg_out, new_state, segment_tokens, total_tokens, stream)


def _stand_ins(output_align: int) -> tuple:
    """The compiled call's extra arguments (after `new_state`): the workspaces, the virtual batch's bounds and
    which slots are summarized, the summaries, the per-segment states in and out, L."""
    segments, bounds = cute.sym_int(), cute.sym_int()

    def rowmajor(dtype, shape, align=16):
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=align)

    per_segment = (segments, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE)
    return (
        *wy_prepass._workspace_stand_ins(),
        rowmajor(cutlass.Int64, (bounds,), align=8),  # seg_cu
        rowmajor(cutlass.Int32, (segments,), align=4),  # summarized
        rowmajor(cutlass.Float32, (segments, NUM_V_HEADS, 2 * HEAD_SIZE, HEAD_SIZE)),  # summaries
        *(rowmajor(cutlass.Float32, per_segment) for _ in range(2)),  # seg_state, seg_out
        CHUNK,  # segment_tokens
    )


_COMPILED: dict[tuple[str, WyPrepassConfig | None], Callable] = {}


def compiled_for(arch: str, config: WyPrepassConfig | None) -> Callable:
    """The compiled launcher for `arch` with `config`'s chains (compiled on first use; no GPU)."""
    key = (arch, config)
    fn = _COMPILED.get(key)
    if fn is None:
        align = 2 if config else wgmma_value_side.OUTPUT_ALIGN
        fn = _COMPILED[key] = token_serial.compile_launcher(
            GdnPrefillContextParallelSm90(config), arch, _stand_ins(align), output_align=align
        )
    return fn


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    return tuple(compiled_for(arch, config) for config in (*wy_prepass.CONFIGS, None))


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state, segment_tokens: int | None = None):
    """`kernel.py`'s contract at any T and N, every sequence of more than 2 L tokens split into segments of L
    (`segment_tokens`, default `segment_tokens_for(T)`). No device reads, no host synchronisation."""
    token_serial.check_inputs(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, output, new_state)
    num_tokens, num_seqs = q.shape[0], new_state.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        wy_prepass.run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
        return
    L = segment_tokens_for(num_tokens) if segment_tokens is None else segment_tokens
    if L <= 0 or L % CHUNK:
        raise GdnShapeError(f"segment_tokens must be a positive multiple of {CHUNK}, got {L}")
    num_slots = cp_model.segment_bound(num_seqs, num_tokens, L)
    device, f32 = q.device, torch.float32
    launcher = compiled_for(GPU_ARCH, wgmma_value_side.chain_config(num_slots, output))
    chunk_slots = wy_prepass.num_chunk_slots(num_tokens, num_slots)
    per_segment = (num_slots, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE)
    has_state = state is not None
    launcher(
        q, k, v, state if has_state else new_state, A_log, a, dt_bias, b, cu_seqlens, resolve_scale(scale),
        int(has_state), output, new_state,
        torch.empty(
            (chunk_slots, NUM_V_HEADS, wy_prepass.TP_PLANES, CHUNK, CHUNK), dtype=torch.float16, device=device
        ),
        torch.empty((chunk_slots, NUM_V_HEADS, 2, CHUNK), dtype=f32, device=device),
        torch.empty((num_slots + 1,), dtype=torch.int64, device=device),
        torch.empty((num_slots,), dtype=torch.int32, device=device),
        torch.empty((num_slots, NUM_V_HEADS, 2 * HEAD_SIZE, HEAD_SIZE), dtype=f32, device=device),
        torch.empty(per_segment, dtype=f32, device=device),
        torch.empty(per_segment, dtype=f32, device=device),
        L,
    )  # fmt: skip
