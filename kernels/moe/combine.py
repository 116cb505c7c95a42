"""The last kernel of the MoE: the deterministic per-token combine of the weighted expert outputs into bf16, which
also leaves the kept counters at zero for the next call, so that no kernel of its own releases them."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .chain import NO_CHAIN, ChainLink, Linked, enter
from .shapes import HIDDEN, NUM_LOCAL_EXPERTS, NUM_THREADS, TOP_K

COMBINE_COLS_PER_THREAD = 8
COMBINE_COLS_PER_CTA = NUM_THREADS * COMBINE_COLS_PER_THREAD  # 1024
COMBINE_CTAS_PER_TOKEN = HIDDEN // COMBINE_COLS_PER_CTA  # 7

assert HIDDEN % COMBINE_COLS_PER_CTA == 0


# ------------------------------------------------------------------------------------------------
# combine
# ------------------------------------------------------------------------------------------------


@cute.jit
def release_counters(release, cta_index: cutlass.Int32, tidx: cutlass.Int32):
    """CTA 0 of the combine leaves the kept counters (and the kept count of routed tokens, if any) at zero for the
    next call, whose first kernel is launched plainly and so starts after this grid has completed."""
    kept_counts, routed = release
    if cta_index == 0:
        if tidx < NUM_LOCAL_EXPERTS:
            kept_counts[tidx] = cutlass.Int32(0)
        if cutlass.const_expr(routed is not None):
            if tidx == 0:
                routed[0] = cutlass.Int32(0)


class CombineKernel(Linked):
    def __init__(self, link: ChainLink = NO_CHAIN, loads_first: bool = False):
        """`loads_first` (up to FEW_TOKENS_MAX tokens): every load of a thread is issued before the first one is
        used (the token's eight slots beside the counts, then the eight rows), instead of one dependent chain per slot.
        It takes 92 registers per thread against 28 (3x fewer CTAs per SM), which costs where the grid is large."""
        super().__init__(link)
        self.loads_first = loads_first

    @cute.jit
    def launch(
        self,
        counts: cute.Tensor,
        slot_expert: cute.Tensor,
        slot_rank: cute.Tensor,
        slot_weight: cute.Tensor,
        expert_out: cute.Tensor,
        output: cute.Tensor,
        stream,
        release,
    ):
        """`counts`: the call's final counts per local expert (GEMM1's copy). `release` (the combine is the
        call's last kernel): (the kept counters, the kept count of routed tokens or None), which CTA (0, 0) zeroes
        for the next call on the stream once GEMM2, their last reader, has completed (its programmatic wait)."""

        @cute.struct
        class SharedStorage:
            offsets: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, NUM_LOCAL_EXPERTS], 16]

        self.kernel(counts, slot_expert, slot_rank, slot_weight, expert_out, output, SharedStorage, release).launch(
            grid=[output.shape[0], COMBINE_CTAS_PER_TOKEN, 1],
            block=[NUM_THREADS, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            use_pdl=self.link.waits,
        )

    @cute.kernel
    def kernel(
        self,
        counts: cute.Tensor,
        slot_expert: cute.Tensor,
        slot_rank: cute.Tensor,
        slot_weight: cute.Tensor,
        expert_out: cute.Tensor,
        output: cute.Tensor,
        SharedStorage: cutlass.Constexpr,
        release,
    ):
        enter(self.link)
        tidx, _, _ = cute.arch.thread_idx()
        token, column_block, _ = cute.arch.block_idx()
        release_counters(release, token + column_block, tidx)
        if cutlass.const_expr(self.loads_first):
            # The token's slots do not depend on the offsets: their loads go out with the counts'.
            experts = cute.make_rmem_tensor((TOP_K,), cutlass.Int32)
            ranks = cute.make_rmem_tensor((TOP_K,), cutlass.Int32)
            weights = cute.make_rmem_tensor((TOP_K,), cutlass.Float32)
            cute.autovec_copy(slot_expert[token, None], experts)
            cute.autovec_copy(slot_rank[token, None], ranks)
            cute.autovec_copy(slot_weight[token, None], weights)
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        offsets = storage.offsets.get_tensor(cute.make_layout(NUM_LOCAL_EXPERTS))
        if tidx < NUM_LOCAL_EXPERTS:
            # Exclusive prefix sum of the counts over warp 0: offsets[e] = rows of experts < e.
            count = counts[tidx]
            inclusive = count
            for shift in cutlass.range_constexpr(5):
                neighbour = cute.arch.shuffle_sync_up(inclusive, offset=1 << shift)
                if tidx >= (1 << shift):
                    inclusive = inclusive + neighbour
            offsets[tidx] = inclusive - count
        cute.arch.sync_threads()

        column_chunk = column_block * NUM_THREADS + tidx  # in units of COMBINE_COLS_PER_THREAD columns
        total = cute.make_rmem_tensor((COMBINE_COLS_PER_THREAD,), cutlass.Float32)
        total.fill(0.0)
        if cutlass.const_expr(self.loads_first):
            # All of the token's rows in flight at once, then the sum in slot order (the same FMAs as below).
            rows = cute.make_rmem_tensor((COMBINE_COLS_PER_THREAD, TOP_K), cutlass.Float32)
            for k in cutlass.range_constexpr(TOP_K):
                if experts[k] >= 0:
                    packed_row = offsets[experts[k]] + ranks[k]
                    source = cute.local_tile(expert_out[packed_row, None], (COMBINE_COLS_PER_THREAD,), (column_chunk,))
                    cute.autovec_copy(source, rows[None, k])
            for k in cutlass.range_constexpr(TOP_K):
                if experts[k] >= 0:
                    for j in cutlass.range_constexpr(COMBINE_COLS_PER_THREAD):
                        total[j] = total[j] + weights[k] * rows[j, k]
        else:
            row = cute.make_rmem_tensor((COMBINE_COLS_PER_THREAD,), cutlass.Float32)
            for k in cutlass.range_constexpr(TOP_K):
                local = slot_expert[token, k]
                if local >= 0:
                    packed_row = offsets[local] + slot_rank[token, k]
                    weight = slot_weight[token, k]
                    source = cute.local_tile(
                        expert_out[packed_row, None], (COMBINE_COLS_PER_THREAD,), (column_chunk,)
                    )
                    cute.autovec_copy(source, row)
                    for j in cutlass.range_constexpr(COMBINE_COLS_PER_THREAD):
                        total[j] = total[j] + weight * row[j]
        result = cute.make_rmem_tensor((COMBINE_COLS_PER_THREAD,), cutlass.BFloat16)
        result.store(total.load().to(cutlass.BFloat16))
        cute.autovec_copy(
            result, cute.local_tile(output[token, None], (COMBINE_COLS_PER_THREAD,), (column_chunk,))
        )


