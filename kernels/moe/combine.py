"""The last kernel of the MoE: the deterministic per-token combine of the weighted expert outputs into bf16, which
also leaves the kept counters at zero for the next call (v2.22: no release kernel of its own)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .chain import NO_CHAIN, ChainLink, Linked, enter
from .shapes import HIDDEN, NUM_LOCAL_EXPERTS, NUM_THREADS, TOP_K

COMBINE_COLS_PER_THREAD = 8
COMBINE_COLS_PER_CTA = NUM_THREADS * COMBINE_COLS_PER_THREAD  # 1024
COMBINE_CTAS_PER_TOKEN = HIDDEN // COMBINE_COLS_PER_CTA  # 7

assert HIDDEN % COMBINE_COLS_PER_CTA == 0

# The combine inside GEMM2 (candidate v2.27): a block is one GEMM2 item's 32 output columns; `counters.kept_combine`
# holds an arrival count per block, then the exit count of GEMM2's CTAs.
COMBINE_BLOCK_COLUMNS = 32
COMBINE_BLOCKS = HIDDEN // COMBINE_BLOCK_COLUMNS  # 224
EXIT_WORD = COMBINE_BLOCKS
COMBINE_WORDS = 256  # the kept buffer: the arrival counts and the exit count, padded to whole warps
assert EXIT_WORD < COMBINE_WORDS and COMBINE_WORDS % 32 == 0
CHUNKS_PER_BLOCK = COMBINE_BLOCK_COLUMNS // COMBINE_COLS_PER_THREAD  # threads per token in a block


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
        """`loads_first` (v2.25, up to FEW_TOKENS_MAX tokens): every load of a thread is issued before the first one is
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
        """`counts`: the call's final counts per local expert (GEMM1's copy). `release` (v2.22: the combine is the
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
            slots = load_slots(slot_expert, slot_rank, slot_weight, token)
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
        if cutlass.const_expr(self.loads_first):
            combine_columns(slots, offsets, expert_out, output, token, column_chunk)
        else:
            total = cute.make_rmem_tensor((COMBINE_COLS_PER_THREAD,), cutlass.Float32)
            total.fill(0.0)
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
            store_bf16(total, output, token, column_chunk)


@cute.jit
def load_slots(slot_expert: cute.Tensor, slot_rank: cute.Tensor, slot_weight: cute.Tensor, token: cutlass.Int32):
    """The token's eight slots (local expert or -1, rank, weight) in registers, as three vector loads."""
    experts = cute.make_rmem_tensor((TOP_K,), cutlass.Int32)
    ranks = cute.make_rmem_tensor((TOP_K,), cutlass.Int32)
    weights = cute.make_rmem_tensor((TOP_K,), cutlass.Float32)
    cute.autovec_copy(slot_expert[token, None], experts)
    cute.autovec_copy(slot_rank[token, None], ranks)
    cute.autovec_copy(slot_weight[token, None], weights)
    return experts, ranks, weights


@cute.jit
def combine_columns(
    slots, offsets: cute.Tensor, expert_out: cute.Tensor, output: cute.Tensor, token: cutlass.Int32, column_chunk
):
    """output[token, COMBINE_COLS_PER_THREAD columns of chunk `column_chunk`] = the weighted sum of the token's
    expert rows there (`slots`: `load_slots`'; `offsets[e]`: the first packed row of local expert e): all of the
    rows in flight at once, then the sum in slot order (v2.25; the same FMAs as the slot chain)."""
    experts, ranks, weights = slots
    total = cute.make_rmem_tensor((COMBINE_COLS_PER_THREAD,), cutlass.Float32)
    total.fill(0.0)
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
    store_bf16(total, output, token, column_chunk)


@cute.jit
def store_bf16(total: cute.Tensor, output: cute.Tensor, token: cutlass.Int32, column_chunk):
    result = cute.make_rmem_tensor((COMBINE_COLS_PER_THREAD,), cutlass.BFloat16)
    result.store(total.load().to(cutlass.BFloat16))
    cute.autovec_copy(result, cute.local_tile(output[token, None], (COMBINE_COLS_PER_THREAD,), (column_chunk,)))


# ------------------------------------------------------------------------------------------------
# the combine inside GEMM2 (candidate v2.27)
# ------------------------------------------------------------------------------------------------


@cute.jit
def combine_block_if_last(
    combine, flag: cute.Tensor, block, row_tiles, offsets: cute.Tensor, expert_out: cute.Tensor, tidx: cutlass.Int32
):
    """Called by every CTA of GEMM2 right after it stored an item's O tile of column block `block`: the CTA releases
    its stores and counts its arrival at the block; the arrival that completes the block (one per row tile,
    `row_tiles` of them) acquires every other's stores, sums the block's 32 columns for every token in the combine
    kernel's order (`combine_columns`: bit for bit its output) and zeroes the block's count for the next call.
    `combine`: (slot_expert, slot_rank, slot_weight, output, the kept combine counts, routed); `flag`: one word of the
    CTA's shared memory; `offsets`: GEMM2's first packed row per local expert."""
    slot_expert, slot_rank, slot_weight, output, arrivals, _ = combine
    cute.arch.sync_threads()
    if tidx == 0:
        if _last_arrival(arrivals, block, row_tiles):
            flag[0] = cutlass.Int32(1)
        else:
            flag[0] = cutlass.Int32(0)
    cute.arch.sync_threads()
    if flag[0] != 0:
        column_chunk = block * CHUNKS_PER_BLOCK + tidx % CHUNKS_PER_BLOCK
        for token in cutlass.range(tidx // CHUNKS_PER_BLOCK, output.shape[0], NUM_THREADS // CHUNKS_PER_BLOCK, unroll=1):
            slots = load_slots(slot_expert, slot_rank, slot_weight, token)
            combine_columns(slots, offsets, expert_out, output, token, column_chunk)


@cute.jit
def release_if_last_exit(combine, flag: cute.Tensor, kept_counts: cute.Tensor, grid, tidx: cutlass.Int32):
    """GEMM2's last statements with the combine inside it: the CTA counts its exit, and the last CTA to exit (every
    other has read the counts and the routed count by then) zeroes them for the next call, as the combine kernel's
    CTA 0 does otherwise, and the exit count."""
    _, _, _, _, arrivals, routed = combine
    cute.arch.sync_threads()
    if tidx == 0:
        if _last_arrival(arrivals, EXIT_WORD, grid):
            flag[0] = cutlass.Int32(1)
        else:
            flag[0] = cutlass.Int32(0)
    cute.arch.sync_threads()
    if flag[0] != 0:
        release_counters((kept_counts, routed), 0, tidx)


@cute.jit
def _last_arrival(counts: cute.Tensor, index, expected) -> cutlass.Boolean:
    """One thread, after a CTA barrier: release the CTA's writes, add one to counts[index]; True for the arrival that
    makes it `expected`, which acquires every other arrival's writes and zeroes the count for the next call."""
    cute.arch.fence_acq_rel_gpu()
    arrived = cute.arch.atomic_add((counts.iterator + index).llvm_ptr, cutlass.Int32(1), scope="gpu")
    last = arrived == expected - 1
    if last:
        cute.arch.fence_acq_rel_gpu()
        counts[index] = cutlass.Int32(0)
    return last


@cute.jit
def zero_output(output: cute.Tensor, cta: cutlass.Int32, grid, tidx: cutlass.Int32):
    """GEMM2 with the combine inside, when no token chose a local expert (no item, no arrival): the output is zero,
    as the combine kernel's sum of no slot is."""
    zeros = cute.make_rmem_tensor((COMBINE_COLS_PER_THREAD,), cutlass.Float32)
    zeros.fill(0.0)
    chunks_per_token = HIDDEN // COMBINE_COLS_PER_THREAD
    for linear in cutlass.range(cta * NUM_THREADS + tidx, output.shape[0] * chunks_per_token, grid * NUM_THREADS, unroll=1):
        store_bf16(zeros, output, linear // chunks_per_token, linear % chunks_per_token)

