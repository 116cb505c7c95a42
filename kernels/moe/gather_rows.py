"""The row gather before the grouped GEMM1 (`grouped_wgmma.py`): each packed row's token row of x (7168 e4m3) and its
56 scales copied into the grouped buffers that GEMM1 reads by TMA.

Packed row r of local expert e and rank k (r = offset[e] + k, offset the exclusive prefix of the counts: the rows of
every kernel of the call) holds token expert_tokens[e, k]: `a_rows[r] = x[token]`, `a_rows_scale[:, r] =
x_scale[:, token]`. Rows past the counts' sum are not written (nothing reads them: GEMM1 stores no row past an
expert's).

A persistent grid (CTAS_PER_SM per SM) of warps walking the packed rows, ROWS_PER_CTA consecutive rows per CTA and
pass (one a warp), so that a CTA's scale stores of one K block fall in one 32-B sector. Each warp scans the counts
itself (lane e holds expert e's inclusive end, `streaming_gemm.lane_inclusive_sums`): a row's expert is the number
of experts whose rows end at or before it (a ballot), so there is no shared memory and no CTA barrier. A lane copies
CHUNKS_PER_LANE 16-B chunks of the row, all loads before the first store; lanes 0-27 copy the scales, two each.
One compile serves every T and row count; the host never reads a count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .chain import NO_CHAIN, Linked, enter
from .shapes import HIDDEN, HIDDEN_BLOCKS, NUM_LOCAL_EXPERTS
from .standalone import compile_standalone, rowmajor
from .streaming_gemm import lane_inclusive_sums

__all__ = ["CTAS_PER_SM", "GatherRowsKernel", "ROWS_PER_CTA", "compiled", "compile_only"]

GPU_ARCH = "sm_90a"
ROWS_PER_CTA = 8  # warps per CTA, one packed row each per pass
# One wave: at 98 registers a thread (a row's 56 in flight) two CTAs of 256 threads fit an SM, 112 KB of loads in flight.
CTAS_PER_SM = 2
CHUNK = 16  # bytes per vector copy
CHUNKS_PER_LANE = HIDDEN // CHUNK // 32  # 14
SCALE_LANES = HIDDEN_BLOCKS // 2  # 28: lane l < 28 copies the scales of K blocks l and l + 28

assert NUM_LOCAL_EXPERTS == 32  # lane e of a warp holds expert e
assert HIDDEN % (32 * CHUNK) == 0 and HIDDEN_BLOCKS % 2 == 0


class GatherRowsKernel(Linked):
    """Launched after the routing grid in a chain (it waits for it before reading the counts and token lists)."""

    @cute.jit
    def launch(
        self,
        counts: cute.Tensor,
        expert_tokens: cute.Tensor,
        x: cute.Tensor,
        x_scale: cute.Tensor,
        a_rows: cute.Tensor,
        a_rows_scale: cute.Tensor,
        num_sms: Int32,
        stream,
    ):
        """`counts` [32], `expert_tokens` [32, T]: the routing's; `x` [T, 7168] e4m3 and `x_scale` [56, T]: the
        definition's; `a_rows` [R, 7168], `a_rows_scale` [56, R] (R >= the counts' sum). `num_sms`: the SM count (the
        grouped GEMM1's grid)."""
        self.kernel(counts, expert_tokens, x, x_scale, a_rows, a_rows_scale).launch(
            grid=[num_sms * CTAS_PER_SM, 1, 1],
            block=[ROWS_PER_CTA * 32, 1, 1],
            stream=stream,
            use_pdl=self.link.waits,
        )

    @cute.kernel
    def kernel(
        self,
        counts: cute.Tensor,
        expert_tokens: cute.Tensor,
        x: cute.Tensor,
        x_scale: cute.Tensor,
        a_rows: cute.Tensor,
        a_rows_scale: cute.Tensor,
    ):
        enter(self.link)
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = tidx // 32
        lane = tidx % 32
        count = counts[lane]
        (rows_end,) = lane_inclusive_sums((count,), lane)
        total = cute.arch.shuffle_sync(rows_end, 31)
        copy_16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float8E4M3FN, num_bits_per_copy=128)
        held = cute.make_rmem_tensor((CHUNK, CHUNKS_PER_LANE), cutlass.Float8E4M3FN)
        row = cta * ROWS_PER_CTA + warp
        while row < total:
            expert = cute.arch.popc(cute.arch.vote_ballot_sync(rows_end <= row))
            first = cute.arch.shuffle_sync(rows_end - count, expert)
            token = expert_tokens[expert, row - first]
            for i in cutlass.range_constexpr(CHUNKS_PER_LANE):
                cute.copy(copy_16, row_chunk(x, token, lane + 32 * i), held[None, i])
            for i in cutlass.range_constexpr(CHUNKS_PER_LANE):
                cute.copy(copy_16, held[None, i], row_chunk(a_rows, row, lane + 32 * i))
            if lane < SCALE_LANES:
                for half in cutlass.range_constexpr(2):
                    block = lane + half * SCALE_LANES
                    a_rows_scale[block, row] = x_scale[block, token]
            row = row + grid * ROWS_PER_CTA


@cute.jit
def row_chunk(rows: cute.Tensor, row: Int32, chunk: Int32) -> cute.Tensor:
    """16-B chunk `chunk` of row `row` of an e4m3 [*, 7168] tensor, its address known 16-B aligned."""
    start = rows.iterator + cute.assume(row * HIDDEN + chunk * CHUNK, divby=CHUNK)
    return cute.make_tensor(start, cute.make_layout(CHUNK))


class _GatherRows:
    """Host function of the standalone launcher (`compiled`)."""

    @cute.jit
    def __call__(
        self,
        counts: cute.Tensor,
        expert_tokens: cute.Tensor,
        x: cute.Tensor,
        x_scale: cute.Tensor,
        a_rows: cute.Tensor,
        a_rows_scale: cute.Tensor,
        num_sms: Int32,
        stream,
    ):
        GatherRowsKernel(NO_CHAIN).launch(counts, expert_tokens, x, x_scale, a_rows, a_rows_scale, num_sms, stream)


@functools.cache
def compiled(arch: str = GPU_ARCH, dump_dir: str = "") -> Callable:
    """The TVM-FFI launcher `(counts, expert_tokens, x, x_scale, a_rows, a_rows_scale, num_sms)` on the current torch
    stream, compiled once for symbolic T and R (R a multiple of 4, as GEMM1's scale tensor map needs); needs no GPU.
    With `dump_dir` the PTX and cubin are also written there (the CPU test reads the vector copies from the PTX)."""
    tokens = cute.sym_int()
    rows = cute.sym_int(divisibility=4)

    fp8, f32 = cutlass.Float8E4M3FN, cutlass.Float32
    tensors = (
        rowmajor(Int32, (NUM_LOCAL_EXPERTS,)),
        rowmajor(Int32, (NUM_LOCAL_EXPERTS, tokens)),
        rowmajor(fp8, (tokens, HIDDEN)),
        rowmajor(f32, (HIDDEN_BLOCKS, tokens)),
        rowmajor(fp8, (rows, HIDDEN)),
        rowmajor(f32, (HIDDEN_BLOCKS, rows)),
    )
    return compile_standalone(_GatherRows(), tensors, arch, dump_dir)


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the standalone row gather for `arch` without touching a GPU."""
    return (compiled(arch),)
