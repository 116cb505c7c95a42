"""The kernel between GEMM1 and a GEMM2 that multiplies f16 (NOTES.md): each
packed row of C rewritten in place from bf16 to f16 times a power of two, with the inverse power of two stored per row
(`c_scale`), so that GEMM2 converts its e4m3 weights once per pair (`cvt.rn.f16x2.e4m3x2`) instead of four times.

The scale puts the row's amax in [2^14, 2^15): bf16's 8-bit significands fit f16's 11 and the multiplication by a
power of two is exact, so each element keeps its value (times the power) unless it lies below 2^-31 of the row's
amax, where f16's subnormals (steps of 2^-24) no longer hold 8 significant bits; such an element (silu of a very
negative gate) is rounded to that step, an error of at most 2^-39 of the amax. One warp per packed row: 64 elements
per lane, read as 32 bf16 pairs, written back as 32 f16 pairs to the same words by the same lane (all reads of a lane
precede its writes through the amax).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .chain import Linked, enter
from .shapes import INTERMEDIATE, NUM_LOCAL_EXPERTS

assert NUM_LOCAL_EXPERTS == 32  # the row count is a warp sum of the counts

ROWS_PER_CTA = 4  # one warp per packed row
WORDS_PER_LANE = INTERMEDIATE // 2 // 32  # bf16 pairs per lane and row


def _bf16x2_abs_max(word: Int32) -> Float32:
    """max(|lo|, |hi|) of the two bf16 values in `word` (a NaN loses to the other value)."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 l, h; .reg .f32 fl, fh; shl.b32 l, {$r0}, 16; and.b32 h, {$r0}, 0x7fff0000; "
        "mov.b32 fl, l; mov.b32 fh, h; abs.f32 fl, fl; max.f32 {$w0}, fl, fh; }",
        write_only_types=[Float32],
        read_only_args=[word],
    )


def _bf16x2_to_scaled_f16x2(word: Int32, factor: Float32) -> Int32:
    """The two bf16 values in `word` times `factor` (a power of two), as f16x2 in the same halves."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 l, h; .reg .f32 fl, fh; shl.b32 l, {$r0}, 16; and.b32 h, {$r0}, 0xffff0000; "
        "mov.b32 fl, l; mov.b32 fh, h; mul.rn.f32 fl, fl, {$r1}; mul.rn.f32 fh, fh, {$r1}; "
        "cvt.rn.f16x2.f32 {$w0}, fh, fl; }",
        write_only_types=[Int32],
        read_only_args=[word, factor],
    )


def _row_powers(amax: Float32):
    """(2^(141 - e), 2^(e - 141)) for amax's biased exponent e clamped to [15, 254]: the first puts the amax in
    [2^14, 2^15), the second undoes it; both are normal floats."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 e, t; mov.b32 e, {$r0}; shr.u32 e, e, 23; and.b32 e, e, 255; max.s32 e, e, 15; "
        "min.s32 e, e, 254; sub.s32 t, 268, e; shl.b32 t, t, 23; mov.b32 {$w0}, t; sub.s32 t, e, 14; "
        "shl.b32 t, t, 23; mov.b32 {$w1}, t; }",
        write_only_types=[Float32, Float32],
        read_only_args=[amax],
    )


class CToF16Kernel(Linked):
    """Launched after GEMM1 in a chain (it waits for GEMM1's grid); rows past the call's total count are left."""

    @cute.jit
    def launch(self, counts: cute.Tensor, intermediate: cute.Tensor, c_scale: cute.Tensor, stream):
        num_rows = intermediate.shape[0]
        words = cute.recast_tensor(intermediate, Int32)  # [rows, 1024]: bf16 pairs, then f16 pairs
        self.kernel(counts, words, c_scale).launch(
            grid=[(num_rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1, 1],
            block=[ROWS_PER_CTA * 32, 1, 1],
            stream=stream,
            use_pdl=self.link.waits,
        )

    @cute.kernel
    def kernel(self, counts: cute.Tensor, words: cute.Tensor, c_scale: cute.Tensor):
        enter(self.link)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * ROWS_PER_CTA + tidx // 32
        # the packed rows in use: the sum of the local experts' counts (32 of them: one per lane)
        total = counts[lane]
        for shift in cutlass.range_constexpr(5):
            total = total + cute.arch.shuffle_sync_bfly(total, offset=16 >> shift)
        if row < total:
            held = cute.make_rmem_tensor((WORDS_PER_LANE,), Int32)
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(WORDS_PER_LANE):
                held[i] = words[row, i * 32 + lane]
                amax = cute.arch.fmax(amax, _bf16x2_abs_max(held[i]))
            for shift in cutlass.range_constexpr(5):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=16 >> shift))
            to_f16, from_f16 = _row_powers(amax)
            for i in cutlass.range_constexpr(WORDS_PER_LANE):
                words[row, i * 32 + lane] = _bf16x2_to_scaled_f16x2(held[i], to_f16)
            if lane == 0:
                c_scale[row] = from_f16
