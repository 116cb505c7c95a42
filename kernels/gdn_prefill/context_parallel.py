"""GDN prefill, context-parallel path (`kernel.py` takes it for one sequence of CONTEXT_PARALLEL_MIN_TOKENS or
more): the WY path with the sequence cut into segments that run in parallel (NOTES.md, "Context-parallel
path"; the algebra and its PyTorch model are `cp_model.py`'s).

Why: the WY chain walks a sequence's chunks one after another, 8 head chains for one sequence, so one long
sequence leaves most SMs idle (8192 tokens ~355 us). Per (sequence, head) a run of tokens maps the state
affinely, S_out = S_in M + B, and M, B of a segment need no S_in.

Each kernel below is an existing one run on a *virtual batch* whose sequences are the segments: a sequence of
n > 2 L tokens (L = `segment_tokens`, a multiple of 64) becomes ceil(n / L) segments, a shorter one stays one.
Segment j of sequence s has slot first_segment_slot(s, start_s, L) + j (`cp_model.segment_bound`: unique
slots below segment_bound(N, T, L), a size known on the host); `seg_cu` holds the virtual batch's bounds, the
slots that hold no segment being empty sequences. Every segment starts on a chunk boundary of its sequence,
so each chunk's key side, and so its workspace entry, is the unsplit batch's. In one compiled call:

1. `_SegmentBounds`: `seg_cu` from `cu_seqlens` (one thread per slot, a binary search over the sequences).
2. `wy_prepass._KeySide` on the virtual batch.
3. The chain twice on the virtual batch, outputs to a scratch: B (the real values, from zero) and M (zero
   values, from the identity: row i of M is where the state row e_i goes). The chain is the WY path's for that
   many sequences (`wgmma_value_side.chain_config`): the WGMMA chain from 15 segments, `wy_prepass.py`'s below.
4. `_Scan`, per (sequence, head, 8 state rows), sequential over the sequence's segments in fp32 FMA:
   S_in(0) = the initial state (or zero), S_in(j + 1) = S_in(j) M_j + B_j, each S_in(j) to `seg_state`.
5. The chain on the virtual batch from `seg_state`: the outputs, each segment's final state.
6. `_FinalStates`: `new_state` of each sequence is its last segment's final state (zero if it is empty).

The summary passes also run on the segments no scan reads (each sequence's last): the price of reusing the
chain unchanged (NOTES.md: the fused summary that would skip them is the next step).
"""

from __future__ import annotations

from typing import Callable

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

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
SLOT_THREADS = 128
FILL_THREADS, FILL_CTAS = 256, 264  # the constants' fill: a grid-stride loop over two CTAs per SM


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
    the end of the sequence before it (at the first sequence's start before it); seg_cu[S] = the last end."""

    @cute.jit
    def launch(self, cu_seqlens, seg_cu, segment_tokens, total_tokens, stream):
        self.kernel(cu_seqlens, seg_cu, segment_tokens, total_tokens).launch(
            grid=[(seg_cu.shape[0] + SLOT_THREADS - 1) // SLOT_THREADS, 1, 1], block=[SLOT_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        cu_seqlens: cute.Tensor,
        seg_cu: cute.Tensor,
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
    the state survives every step)."""

    @cute.jit
    def launch(self, cu_seqlens, state, has_state, transition, reached, seg_state, segment_tokens, total_tokens, stream):
        @cute.struct
        class SharedStorage:
            rows: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, SCAN_ROWS * HEAD_SIZE], 32]

        self.kernel(
            cu_seqlens, state, has_state, transition, reached, seg_state, segment_tokens, total_tokens, SharedStorage
        ).launch(
            grid=self.grid(state.shape[0]), block=[HEAD_SIZE, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        cu_seqlens: cute.Tensor,
        state: cute.Tensor,
        has_state: cutlass.Int32,
        transition: cute.Tensor,
        reached: cute.Tensor,
        seg_state: cute.Tensor,
        segment_tokens: cutlass.Int32,
        total_tokens: cutlass.Int32,
        SharedStorage: cutlass.Constexpr,
    ):
        col, seq, head, row0 = self.coordinates()
        smem = cutlass.memory.SmemAllocator()
        # The CTA's rows by column: column i's SCAN_ROWS values are contiguous, two 16-B broadcast loads.
        by_column = smem.allocate(SharedStorage).rows.get_tensor(
            cute.make_layout((HEAD_SIZE, SCAN_ROWS), stride=(SCAN_ROWS, 1))
        )
        _, length, first, count = sequence_segments(cu_seqlens, seq, segment_tokens, total_tokens)

        own = cute.make_rmem_tensor((SCAN_ROWS,), cutlass.Float32)  # column `col` of this CTA's rows
        own.fill(0.0)
        if has_state != 0 and length > 0:
            for r in cutlass.range_constexpr(SCAN_ROWS):
                own[r] = state[seq, head, row0 + r, col]
        column = cute.make_rmem_tensor((SCAN_ROWS,), cutlass.Float32)
        for j in cutlass.range(count, unroll=1):
            slot = first + j
            for r in cutlass.range_constexpr(SCAN_ROWS):
                seg_state[slot, head, row0 + r, col] = own[r]
            if j + 1 < count:
                cute.autovec_copy(own, by_column[col, None])
                cute.arch.sync_threads()
                for r in cutlass.range_constexpr(SCAN_ROWS):
                    own[r] = reached[slot, head, row0 + r, col]
                for i in cutlass.range(HEAD_SIZE, unroll_full=True):
                    m = transition[slot, head, i, col]
                    cute.autovec_copy(by_column[i, None], column)
                    for r in cutlass.range_constexpr(SCAN_ROWS):
                        own[r] = own[r] + column[r] * m
                # Every thread has read the rows before the next step overwrites them.
                cute.arch.sync_threads()


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

    def chain(self):
        return wgmma_value_side.WgmmaValueSide() if self.config is None else _ValueSide(self.config.slice_rows)

    @cute.jit
    def __call__(
        self, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, has_state, output, new_state,
        ws_tp, ws_g, seg_cu, zero_v, identity, transition, reached, seg_state, seg_out, scratch_output,
        segment_tokens, stream,
    ):  # fmt: skip
        total_tokens = cutlass.Int32(q.shape[0])
        _SegmentBounds().launch(cu_seqlens, seg_cu, segment_tokens, total_tokens, stream)
        _KeySide().launch(q, k, A_log, a, dt_bias, b, seg_cu, ws_tp, ws_g, stream)
        chain = self.chain()
        no_state, from_state = cutlass.Int32(0), cutlass.Int32(1)
        chain.launch(
            q, k, v, identity, A_log, a, dt_bias, b, seg_cu, scale, no_state, scratch_output, reached, ws_tp, ws_g,
            stream,
        )  # fmt: skip
        chain.launch(
            q, k, zero_v, identity, A_log, a, dt_bias, b, seg_cu, scale, from_state, scratch_output, transition,
            ws_tp, ws_g, stream,
        )  # fmt: skip
        _Scan().launch(cu_seqlens, state, has_state, transition, reached, seg_state, segment_tokens, total_tokens, stream)
        chain.launch(
            q, k, v, seg_state, A_log, a, dt_bias, b, seg_cu, scale, from_state, output, seg_out, ws_tp, ws_g, stream
        )
        _FinalStates().launch(cu_seqlens, seg_out, new_state, segment_tokens, total_tokens, stream)


def _stand_ins(output_align: int) -> tuple:
    """The compiled call's extra arguments (after `new_state`): the workspaces, the virtual batch's bounds, the
    M pass's zero values and identity states, the per-segment states, the summaries' output scratch, L."""
    segments, bounds, tokens = cute.sym_int(), cute.sym_int(), cute.sym_int()

    def rowmajor(dtype, shape, align=16):
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=align)

    per_segment = (segments, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE)
    values = (tokens, NUM_V_HEADS, HEAD_SIZE)
    return (
        *wy_prepass._workspace_stand_ins(),
        rowmajor(cutlass.Int64, (bounds,), align=8),  # seg_cu
        rowmajor(cutlass.BFloat16, values),  # zero_v
        *(rowmajor(cutlass.Float32, per_segment) for _ in range(5)),  # identity, transition, reached, seg_state, seg_out
        rowmajor(cutlass.BFloat16, values, align=output_align),  # scratch_output (fresh: 16-B aligned)
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
    return (
        *(compiled_for(arch, config) for config in (*wy_prepass.CONFIGS, None)),
        compiled_fill(arch, False), compiled_fill(arch, True),
    )  # fmt: skip


class _FillConstant:
    """The M pass's read-only inputs, written once when a buffer is made: zero values (bf16 [rows, 8, 128]) or,
    with `identity`, identity states (fp32 [rows, 8, 128, 128]: 1 where the last two indices agree)."""

    def __init__(self, identity: bool):
        self.identity = identity

    @cute.jit
    def __call__(self, buffer: cute.Tensor, stream):
        self.kernel(buffer).launch(grid=[FILL_CTAS, 1, 1], block=[FILL_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, buffer: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        per_row = cute.size(buffer.shape[1:])
        flat = cute.make_tensor(buffer.iterator, cute.make_layout(buffer.shape[0] * per_row))
        for e in cutlass.range(bidx * FILL_THREADS + tidx, buffer.shape[0] * per_row, FILL_CTAS * FILL_THREADS, unroll=1):
            if cutlass.const_expr(self.identity):
                on_diagonal = (e // HEAD_SIZE) % HEAD_SIZE == e % HEAD_SIZE
                flat[e] = cutlass.Float32(cutlass.select_(on_diagonal, cutlass.Float32(1.0), cutlass.Float32(0.0)))
            else:
                flat[e] = cutlass.Float32(0.0).to(buffer.element_type)


_FILLS: dict[tuple[str, bool], Callable] = {}


def compiled_fill(arch: str, identity: bool) -> Callable:
    """The fill launch of a new constant buffer for `arch` (compiled once; needs no GPU)."""
    key = (arch, identity)
    fn = _FILLS.get(key)
    if fn is None:
        rows = cute.sym_int()
        shape = (rows, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE) if identity else (rows, NUM_V_HEADS, HEAD_SIZE)
        dtype = cutlass.Float32 if identity else cutlass.BFloat16
        buffer = make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = _FILLS[key] = cute.compile(_FillConstant(identity), buffer, stream, options=f"--enable-tvm-ffi --gpu-arch {arch}")
    return fn


# Read-only inputs of the M pass, kept per (device, stream) and grown on demand: zero values [T, 8, 128] bf16 and
# identity states [S, 8, 128, 128] fp32, filled by `_FillConstant` on the stream when made (a serving engine would
# make them once, as it does its workspaces). Inside a CUDA-graph capture a fresh one, whose fill the graph holds.
_CONSTANTS: dict[tuple[bool, int, int], torch.Tensor] = {}


def _constant(identity: bool, device: torch.device, rows: int) -> torch.Tensor:
    def make() -> torch.Tensor:
        shape = (rows, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE) if identity else (rows, NUM_V_HEADS, HEAD_SIZE)
        buffer = torch.empty(shape, dtype=torch.float32 if identity else torch.bfloat16, device=device)
        compiled_fill(GPU_ARCH, identity)(buffer)
        return buffer

    if torch.cuda.is_current_stream_capturing():
        return make()
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (identity, index, torch.cuda.current_stream(index).cuda_stream)
    held = _CONSTANTS.get(key)
    if held is None or held.shape[0] < rows:
        held = _CONSTANTS[key] = make()
    return held[:rows]


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
    zero_v, identity = _constant(False, device, num_tokens), _constant(True, device, num_slots)
    per_segment = [torch.empty((num_slots, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE), dtype=f32, device=device) for _ in range(4)]
    has_state = state is not None
    launcher(
        q, k, v, state if has_state else new_state, A_log, a, dt_bias, b, cu_seqlens, resolve_scale(scale),
        int(has_state), output, new_state,
        torch.empty((chunk_slots, NUM_V_HEADS, 2, CHUNK, CHUNK), dtype=torch.float16, device=device),
        torch.empty((chunk_slots, NUM_V_HEADS, 2, CHUNK), dtype=f32, device=device),
        torch.empty((num_slots + 1,), dtype=torch.int64, device=device),
        zero_v, identity, *per_segment, torch.empty_like(output), L,
    )  # fmt: skip

