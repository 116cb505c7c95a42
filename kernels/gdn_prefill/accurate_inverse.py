"""The key side's inverse T = (I + A)^-1 in fp32 for chunks whose state barely decays, kept as hi / lo fp16 pairs.

Why (NOTES.md, "Accuracy"): where a chunk's decay exp(G_last) is close to 1 the state carries every chunk's
rounding for thousands of tokens. With one key repeated over each 64-token run (beta 0.95, slow decay) the fp16
roundings of T and of V'c = V' exp(G_last - G) add up to more than the tolerance at 16384 tokens in one sequence.
The CPU model (`probes/rounding_points.py`) puts the state error at 0.12-0.14 of the tolerance with both as pairs,
T computed on pairs too; T kept as pairs of the fp16-operand inverse makes it worse (2.5-2.8): the blocks must be
one inverse's. So in such a chunk (SLOW_CHUNK_DECAY) a paired key side (`wy_prepass._KeySide(paired=True)`) computes T
in fp32 and stores T_hi = fp16(T) where it stores T, and T_lo = fp16(T - T_hi) in the workspace's plane T_LO_PLANE;
the WGMMA chain built paired (`wgmma_value_side.py`) adds Xb T_lo to V' and the lo half of V'c to the state update.
The mma.sync chain keeps an unpaired key side: T_hi alone is less accurate than `chunked.py`'s blocked fp16 inverse,
whose roundings partly cancel (CPU model, repeated keys at 4096 tokens: 1.5 of the tolerance against 0.85). No chunk of the mamba2 gates
decays that little (every official workload runs the fp16 path), and a chunk decides alone, from its own gates.

The fp32 inverse, one 128-thread CTA (P2-P4 of `chunked.py`'s, as SIMT FMAs over shared memory):
1. the four 16 x 16 diagonal blocks by forward substitution (`chunked.py`'s, fp32 out);
2. T_hl = -(T_hh A_hl) T_ll for (h, l) = (1, 0), (3, 2);
3. T[32:, :32] = -(T[32:, 32:] A[32:, :32]) T[:32, :32].
A's off-diagonal blocks come from the Gram epilogue in fp32 (`chunked.a_tile_epilogue` with `a32`), in a16's storage
(the fp16 path's operand, unused in such a chunk); T and the intermediate X in the k / q rows' storage, dead after
the Grams. T starts zeroed, so the products run over whole blocks.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32

from .chunked import BLOCK, CHUNK, COPY_ELEMS, NUM_THREADS

__all__ = ["SLOW_CHUNK_DECAY", "T_LO_PLANE", "AccurateInverse", "chunk_is_slow"]

SLOW_CHUNK_DECAY = 0.9  # a chunk's decay over 64 tokens above which its T and V'c are kept as pairs
LOG2_SLOW_CHUNK_DECAY = math.log2(SLOW_CHUNK_DECAY)
T_LO_PLANE = 2  # the workspace's [slot, head, plane] of T_lo, after T (0) and P (1)
OFF_DIAGONAL_BLOCKS = 6  # strictly lower 16 x 16 blocks of A: (r, c) at r (r - 1) / 2 + c
PADDED = BLOCK + 1  # fp32 rows of a packed block, against bank conflicts
T32_STRIDE = CHUNK + 1
HALF = CHUNK // 2
X32_STRIDE = HALF + 1
# Words zeroed at the start: T's padded rows, rounded up to whole rounds of the CTA's threads (into X's storage,
# written before it is read).
ZEROED_WORDS = (CHUNK * T32_STRIDE + NUM_THREADS - 1) // NUM_THREADS * NUM_THREADS


@cute.jit
def chunk_is_slow(cum_log_g: cute.Tensor, tokens: Int32):
    """Whether the chunk's decay over 64 tokens at its own per-token rate exceeds SLOW_CHUNK_DECAY: G_last 64 / tokens >
    log2(SLOW_CHUNK_DECAY), from its base-2 cumulative log decays in shared memory (the key side's, or the same bits in
    the chain's copy of them, and the same token count, so both decide alike). One value in every thread, so a branch
    on it is uniform. Per token, not per chunk: a sequence's short last chunk of fast-decaying tokens decays little in
    total but carries no long memory (on the GPU, mamba2 batches' tails took the pairs when the test was exp(G_last))."""
    return cum_log_g[CHUNK - 1] * Float32(CHUNK) > Float32(LOG2_SLOW_CHUNK_DECAY) * Float32(tokens)


class AccurateInverse:
    """Mixed into the key side (`wy_prepass._KeySide`, a `chunked._Chunked`): the fp32 views and the inverse."""

    def a32_view(self, a16: cute.Tensor) -> cute.Tensor:
        """A's strictly lower 16 x 16 blocks in fp32 [block, row, col] over a16's storage (6.5 of its 9 KB)."""
        layout = cute.make_layout((OFF_DIAGONAL_BLOCKS, BLOCK, BLOCK), stride=(BLOCK * PADDED, PADDED, 1))
        return cute.make_tensor(cute.recast_ptr(a16.iterator, dtype=Float32), layout)

    def t32_x32_views(self, kq: cute.Tensor) -> tuple[cute.Tensor, cute.Tensor]:
        """T [64, 64] and the intermediate X [32, 32] in fp32 over the k / q rows' storage (20.8 of its 34 KB)."""
        base = cute.recast_ptr(kq.iterator, dtype=Float32)
        t32 = cute.make_tensor(base, cute.make_layout((CHUNK, CHUNK), stride=(T32_STRIDE, 1)))
        x32 = cute.make_tensor(base + CHUNK * T32_STRIDE, cute.make_layout((HALF, HALF), stride=(X32_STRIDE, 1)))
        return t32, x32

    @cute.jit
    def accurate_inverse(
        self, a_diag: cute.Tensor, a32: cute.Tensor, t32: cute.Tensor, x32: cute.Tensor, t16: cute.Tensor,
        t_lo: cute.Tensor, tidx: Int32,
    ):  # fmt: skip
        """T = (I + A)^-1 in fp32 (module docstring), then T_hi into t16 (shared; its upper blocks stay the zeros
        they hold) and T_lo into `t_lo` (the workspace's [64, 64] plane, every entry)."""
        flat = cute.make_tensor(t32.iterator, cute.make_layout(ZEROED_WORDS))  # T's rows, padding and all
        for i in cutlass.range_constexpr(ZEROED_WORDS // NUM_THREADS):
            flat[i * NUM_THREADS + tidx] = Float32(0.0)
        cute.arch.sync_threads()

        # 1. Diagonal blocks: thread c < 64 solves column c % 16 of block c // 16 (`chunked.py`'s, fp32 out).
        if tidx < CHUNK:
            self.invert_diagonal_block(a_diag, t32, tidx)
        cute.arch.sync_threads()

        # 2. T_hl = -(T_hh A_hl) T_ll, (h, l) = (1, 0) and (3, 2): threads 0-63 the first, 64-127 the second, each
        # four entries of a row of X, then of T_hl.
        pair = tidx // (NUM_THREADS // 2)
        hi = (2 * pair + 1) * BLOCK
        lo = 2 * pair * BLOCK
        row = (tidx % (NUM_THREADS // 2)) // 4
        col0 = (tidx % 4) * 4
        a_hl = a32[5 * pair, None, None]  # blocks (1, 0) and (3, 2) are packed 0 and 5
        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        for m in cutlass.range(BLOCK, unroll=4):
            left = t32[hi + row, hi + m]
            for c in cutlass.range_constexpr(4):
                acc[c] = acc[c] + left * a_hl[m, col0 + c]
        for c in cutlass.range_constexpr(4):
            x32[pair * BLOCK + row, col0 + c] = acc[c]
        cute.arch.sync_threads()
        acc.fill(0.0)
        for m in cutlass.range(BLOCK, unroll=4):
            left = x32[pair * BLOCK + row, m]
            for c in cutlass.range_constexpr(4):
                acc[c] = acc[c] + left * t32[lo + m, lo + col0 + c]
        for c in cutlass.range_constexpr(4):
            t32[hi + row, lo + col0 + c] = -acc[c]
        cute.arch.sync_threads()

        # 3. T[32:, :32] = -(T[32:, 32:] A[32:, :32]) T[:32, :32]: thread t eight entries of row t // 4, four at a
        # time. A[32 + m, col] is packed block r (r - 1) / 2 + col // 16 with r = 2 + m // 16.
        row = tidx // 4
        for half in cutlass.range_constexpr(2):
            col0 = (tidx % 4) * 8 + 4 * half
            acc.fill(0.0)
            for m in cutlass.range(HALF, unroll=4):
                left = t32[HALF + row, HALF + m]
                block = 1 + 2 * (m // BLOCK) + col0 // BLOCK
                for c in cutlass.range_constexpr(4):
                    acc[c] = acc[c] + left * a32[block, m % BLOCK, (col0 + c) % BLOCK]
            for c in cutlass.range_constexpr(4):
                x32[row, col0 + c] = acc[c]
        cute.arch.sync_threads()
        for half in cutlass.range_constexpr(2):
            col0 = (tidx % 4) * 8 + 4 * half
            acc.fill(0.0)
            for m in cutlass.range(HALF, unroll=4):
                left = x32[row, m]
                for c in cutlass.range_constexpr(4):
                    acc[c] = acc[c] + left * t32[m, col0 + c]
            for c in cutlass.range_constexpr(4):
                t32[HALF + row, col0 + c] = -acc[c]
        cute.arch.sync_threads()

        # The pairs: thread t half a row, 16-B pieces of T_lo.
        row = tidx // 2
        for piece in cutlass.range_constexpr(CHUNK // 2 // COPY_ELEMS):
            col0 = (tidx % 2) * (CHUNK // 2) + piece * COPY_ELEMS
            lows = cute.make_rmem_tensor((COPY_ELEMS,), Float16)
            for c in cutlass.range_constexpr(COPY_ELEMS):
                value = t32[row, col0 + c]
                high = value.to(Float16)
                t16[row, col0 + c] = high
                lows[c] = (value - high.to(Float32)).to(Float16)
            cute.autovec_copy(lows, cute.local_tile(t_lo[row, None], (COPY_ELEMS,), (col0 // COPY_ELEMS,)))
