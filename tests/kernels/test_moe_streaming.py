"""The weight-streaming GEMMs of the MoE kernel (kernels/moe/kernel.py with streaming_gemm.py, and the
variants' choice of WGMMA GEMMs).

CPU: the T -> variant heuristic; the
shared-memory budget and persistent grid of every configuration. Transcriptions
of the kernel's index maps against the PTX ISA's mma.m16n8k16 fragment layouts: every MMA pairs
weight k with activation k, each k of the warp's K block once (fp8 and bf16 activations); the
accumulator coordinates; item rows, SwiGLU pairing and block-scale rows; the persistent schedule
(every item once, every expert row once at combine's packed row), the slot draw of the walk by SM id and the GEMM2
claims (correct for any placement or order of the CTAs); the cp.async group accounting.
GPU (marked `gpu`, skipped without CUDA): the end-to-end checks are test_moe_kernel.py's (every
check case, zero rows, bitwise-repeatable calls, graph replay); here, a per-GEMM check of the
workspaces that says which GEMM and which column tiles are wrong when the end-to-end check fails
(7-901 tokens, and GROUPED_T at 1025-4097), the early-W2 variant and the fused GEMMs forced on any T below 33
bit for bit the chained `mma.sync` GEMMs', and the contest rule and relative L2 at the official 11948 tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from tests.kernels.test_moe_kernel import CHAINED_MMA_SYNC, cases, kernel, needs_cuda, reference, solution_module

streaming = solution_module("streaming_gemm")


# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "block_tokens"),
    [(1, 16), (6, 8), (7, 8), (8, 8), (9, 8), (16, 8), (32, 8), (80, 16), (192, 16), (193, 32), (901, 32), (1024, 32), (1025, 128), (2048, 128), (32768, 128)],
)
def test_every_batch_streams_with_row_tiles_by_its_size(num_tokens, block_tokens):
    assert kernel.variant_for(num_tokens).block_tokens == block_tokens


def test_variant_for_rejects_an_empty_batch():
    with pytest.raises(kernel.MoeShapeError, match="seq_len"):
        kernel.variant_for(0)


@pytest.mark.parametrize(
    "variant",
    kernel.VARIANTS,
    ids=lambda v: f"bt{v.block_tokens}x{v.num_stages}_{v.gemm2_block_tokens}x{v.gemm2_num_stages}",
)
def test_every_configuration_fits_shared_memory_and_fills_every_sm(variant):
    for config in (variant.gemm1(), variant.gemm2()):
        per_cta = config.smem_bytes() + streaming.SMEM_RESERVED_PER_CTA
        assert config.ctas_per_sm() * per_cta <= streaming.SMEM_PER_SM
        assert config.grid(132) == 132 * config.ctas_per_sm()
    # The small-T GEMM1 (the 2/3 of the weight bytes at T <= 192) keeps two CTAs per SM.
    if variant.block_tokens == 16:
        assert variant.gemm1().ctas_per_sm() == 2


@pytest.mark.parametrize(
    ("num_tokens", "gemm2_shape"),
    [(1, (8, 4, 2)), (64, (8, 4, 2)), (65, (8, 4, 2)), (192, (8, 4, 2)), (193, (32, 2, 3)), (1024, (32, 2, 3))],
)  # fmt: skip
def test_the_streaming_gemm2_keeps_at_least_two_ctas_per_sm_at_every_size(num_tokens, gemm2_shape):
    """With few tokens per expert GEMM2's weight stream is bound by the stages in flight, so its
    bf16 activation stages are cut until two CTAs fit an SM: 8 (or 6) weight stages in flight per SM
    where 16-token tiles with 4 stages allow one CTA, 4. At ~28 tokens per expert (T ~ 900) the
    second CTA hides the latency of each warp's conversions and MMAs (32-token tiles with 4 stages fit
    one CTA and were 1.29x slower at T = 901). The WGMMA GEMM2's 8-token tiles with 4 stages up to
    192 tokens keep two CTAs (1.06x at 80 over the `mma.sync` GEMM2's 16 x 3); above 192 tokens the f16
    GEMM2's 32-token tiles with 2 stages (~66 KB) run at three CTAs per SM (1.047x at 901 over two CTAs
    of 3 stages). Above MEDIUM_T_MAX_TOKENS GEMM2 is the grouped one, bound by its MMAs at one CTA per SM
    (test_moe_kernel.py)."""
    variant = kernel.variant_for(num_tokens)
    gemm2 = variant.gemm2()
    assert (gemm2.block_tokens, gemm2.num_stages, gemm2.ctas_per_sm()) == gemm2_shape
    assert gemm2.num_stages * gemm2.ctas_per_sm() >= 6
    for one_cta_per_sm in ((16, 4), (32, 4)):
        assert streaming.StreamingGemmConfig(False, *one_cta_per_sm).ctas_per_sm() == 1


def test_one_item_per_sm_at_one_active_expert():
    # T = 1, one active expert: GEMM1 has 128 items of 32 weight rows and GEMM2 224, i.e. every
    # SM of an H200 (132) streams weights in GEMM1 and GEMM2 needs under two rounds.
    config1, config2 = kernel.TINY_T_EARLY_W2.gemm1(), kernel.TINY_T_EARLY_W2.gemm2()
    assert config1.items_per_row_tile * streaming.ITEM_ROWS == 4096
    assert config2.items_per_row_tile * streaming.ITEM_ROWS == 7168
    assert 120 <= config1.items_per_row_tile <= 132


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"block_tokens": 64}, "block_tokens"), ({"block_tokens": 16, "num_stages": 1}, "num_stages")],
)
def test_config_rejects_unsupported_shapes(kwargs, message):
    with pytest.raises(streaming.StreamingConfigError, match=message):
        streaming.StreamingGemmConfig(gemm1=True, **({"num_stages": 4} | kwargs))


def test_the_mma_sync_gemms_keep_two_ctas_per_sm():
    # A variant cannot ask for the three-CTA walk of the `mma.sync` GEMM1 (its guard refuses the WGMMA feed).
    for variant in (kernel.TINY_T_EARLY_W2, kernel.FUSED_T):
        for config in (variant.gemm1(), variant.gemm2()):
            assert config.max_ctas_per_sm == 2 and config.ctas_per_sm() == 2 and not config.partition_walk
    with pytest.raises(ValueError, match="WGMMA"):
        dataclasses.replace(kernel.FUSED_T, num_stages=3, gemm1_feed=kernel.Gemm1Feed.PRODUCER_WARP)


def test_config_rejects_a_pipeline_that_does_not_fit_an_sm():
    with pytest.raises(streaming.StreamingConfigError, match="shared memory"):
        streaming.StreamingGemmConfig(gemm1=False, block_tokens=32, num_stages=5)


def test_config_rejects_a_pipeline_deeper_than_an_item():
    # The computed item takes its valid rows from the load side, which must still be on that item.
    with pytest.raises(streaming.StreamingConfigError, match="num_stages <= 4"):
        streaming.StreamingGemmConfig(gemm1=False, block_tokens=8, num_stages=5)


# ---- CPU transcriptions of the kernel's index maps ----------------------------------------------
#
# The register layouts below are the PTX ISA's ("Matrix Fragments for mma.m16n8k16 with floating
# point type", .f16/.bf16), written independently of the kernel. The kernel side calls the index
# helpers of streaming_gemm.py (the very functions the kernel traces) and transcribes the loops of
# `load_stage` and `compute_block`. Shared memory holds labels instead of numbers: a weight byte is
# ("w", weight row, k), an activation element ("x", token slot, k).

GROUP_SIZE = 4  # threads per MMA row group (threadID_in_group = lane % 4)


def _isa_a_coords(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of element a_i (0..7) held by `lane`; register r holds a_2r (low), a_2r+1 (high)."""
    group, tig = lane // GROUP_SIZE, lane % GROUP_SIZE
    row = group if (i < 2 or 4 <= i < 6) else group + 8
    col = tig * 2 + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def _isa_b_coords(lane: int, i: int) -> tuple[int, int]:
    """(row k, col n) of element b_i (0..3) held by `lane`; register r holds b_2r, b_2r+1."""
    group, tig = lane // GROUP_SIZE, lane % GROUP_SIZE
    return tig * 2 + (i & 1) + (8 if i >= 2 else 0), group


def _isa_c_coords(lane: int, i: int) -> tuple[int, int]:
    group, tig = lane // GROUP_SIZE, lane % GROUP_SIZE
    return group + (8 if i >= 2 else 0), tig * 2 + (i & 1)


def _cvt_e4m3x2(two_bytes: list, high: bool) -> tuple:
    """cvt.rn.f16x2.e4m3x2 of the low or high 16 bits of a word: PTX ISA, the lower 8 bits go to
    the lower half of d (the first element), the upper 8 bits to the upper half."""
    return tuple(two_bytes[2:4]) if high else tuple(two_bytes[0:2])


def _weight_smem(config, n_tile: int, k_stage: int) -> list:
    """Transcription of `load_stage`'s weight copies: [K block][row][byte] labels."""
    smem = [[[None] * streaming.BLOCK for _ in range(streaming.ITEM_ROWS)] for _ in range(streaming.BLOCKS_PER_STAGE)]
    chunks_per_row = streaming.STAGE_K // streaming.CHUNK
    for tidx in range(streaming.NUM_THREADS):
        for i in range(streaming.ITEM_ROWS * chunks_per_row // streaming.NUM_THREADS):
            linear = i * streaming.NUM_THREADS + tidx
            row, chunk = linear // chunks_per_row, linear % chunks_per_row
            k_block, in_block = chunk // streaming.FP8_CHUNKS_PER_BLOCK_ROW, chunk % streaming.FP8_CHUNKS_PER_BLOCK_ROW
            slot = streaming.fp8_chunk_slot(in_block, row)
            w_row = streaming.item_weight_row(config.gemm1, n_tile, row)
            for b in range(streaming.CHUNK):
                position = slot * streaming.CHUNK + b
                assert smem[k_block][row][position] is None, "two copies write one shared-memory byte"
                smem[k_block][row][position] = ("w", w_row, k_stage * streaming.STAGE_K + chunk * streaming.CHUNK + b)
    assert all(label is not None for block in smem for row in block for label in row)
    return smem


def _activation_smem(config, k_stage: int) -> list:
    """Transcription of `load_stage`'s activation copies (all token slots valid): [K block][token
    slot][element] labels (fp8 bytes for GEMM1, bf16 elements for GEMM2)."""
    bt, tpt = config.block_tokens, config.threads_per_token
    elements = streaming.CHUNK if config.gemm1 else streaming.CHUNK // 2  # per 16-B chunk
    chunks_per_block = streaming.BLOCK // elements
    smem = [[[None] * streaming.BLOCK for _ in range(bt)] for _ in range(streaming.BLOCKS_PER_STAGE)]
    for tidx in range(streaming.NUM_THREADS):
        token_slot, sub = tidx // tpt, tidx % tpt
        for i in range(streaming.STAGE_K // elements // tpt):
            x_chunk = sub + i * tpt
            k_block, in_block = x_chunk // chunks_per_block, x_chunk % chunks_per_block
            if config.gemm1:
                slot = streaming.fp8_chunk_slot(in_block, token_slot)
            else:
                slot = streaming.bf16_chunk_slot(in_block, token_slot)
            for e in range(elements):
                position = slot * elements + e
                assert smem[k_block][token_slot][position] is None, "two copies write one element"
                k = k_stage * streaming.STAGE_K + x_chunk * elements + e
                smem[k_block][token_slot][position] = ("x", token_slot, k)
    assert all(label is not None for block in smem for row in block for label in row)
    return smem


def _warp_fragments(config, w_smem, x_smem, warp: int, half: int):
    """Transcription of `compute_block` for one warp and 64-wide K chunk: per lane, the A registers
    [m tile][MMA j][r] and B registers [n tile][MMA j][r], each a (low, high) pair of labels."""
    a_regs, b_regs = {}, {}
    for lane in range(32):
        group, quad = lane // GROUP_SIZE, lane % GROUP_SIZE
        for mt in range(streaming.M_TILES):
            words = {}
            for row_offset in (0, 8):
                row = mt * 16 + group + row_offset
                slot = streaming.fp8_chunk_slot(streaming.fp8_thread_chunk(half, quad), row)
                data = w_smem[warp][row][slot * streaming.CHUNK : (slot + 1) * streaming.CHUNK]
                words[row_offset] = [data[4 * j : 4 * j + 4] for j in range(4)]
            for j in range(4):
                for r, (row_offset, high) in enumerate(streaming.A_REGISTER_SOURCES):
                    a_regs[lane, mt, j, r] = _cvt_e4m3x2(words[row_offset][j], high)
        for nt in range(config.n_tiles):
            token_slot = nt * 8 + group
            if config.gemm1:
                slot = streaming.fp8_chunk_slot(streaming.fp8_thread_chunk(half, quad), token_slot)
                data = x_smem[warp][token_slot][slot * streaming.CHUNK : (slot + 1) * streaming.CHUNK]
                for j in range(4):
                    for r in range(2):
                        b_regs[lane, nt, j, r] = _cvt_e4m3x2(data[4 * j : 4 * j + 4], streaming.B_REGISTER_HIGH_HALF[r])
            else:
                b_words = []
                for c in range(2):
                    slot = streaming.bf16_chunk_slot(streaming.bf16_thread_chunk(half, quad, c), token_slot)
                    data = x_smem[warp][token_slot][slot * 8 : slot * 8 + 8]
                    b_words += [tuple(data[2 * w : 2 * w + 2]) for w in range(4)]  # low element first
                for j in range(4):
                    for r in range(2):
                        b_regs[lane, nt, j, r] = b_words[2 * j + r]
    return a_regs, b_regs


def _isa_operands(a_regs, b_regs, mt: int, nt: int, j: int):
    """A[m][k] and B[k][n] of MMA j of tile (mt, nt), read through the ISA's fragment layout."""
    a, b = {}, {}
    for lane in range(32):
        for i in range(8):
            coords = _isa_a_coords(lane, i)
            assert coords not in a
            a[coords] = a_regs[lane, mt, j, i // 2][i % 2]
        for i in range(4):
            coords = _isa_b_coords(lane, i)
            assert coords not in b
            b[coords] = b_regs[lane, nt, j, i // 2][i % 2]
    assert len(a) == 16 * 16 and len(b) == 16 * 8
    return a, b


@pytest.mark.parametrize("gemm1", [True, False], ids=["gemm1_fp8_x", "gemm2_bf16_x"])
@pytest.mark.parametrize("block_tokens", [8, 16, 32])
def test_mma_pairs_weight_k_with_activation_k_exactly_once(gemm1, block_tokens):
    config = streaming.StreamingGemmConfig(gemm1=gemm1, block_tokens=block_tokens, num_stages=4)
    n_tile, k_stage = 3, 1
    w_smem, x_smem = _weight_smem(config, n_tile, k_stage), _activation_smem(config, k_stage)
    for warp in range(streaming.NUM_WARPS):
        # The K block whose scales this warp's promotion uses: element `warp` of the 4 scales that
        # load_stage copies from K block 4 k_stage (local_tile(..., (4,), (k_stage,))).
        k_block = k_stage * streaming.BLOCKS_PER_STAGE + warp
        products = {}  # (mt, nt, m, n) -> weight k of every product
        for half in range(2):
            a_regs, b_regs = _warp_fragments(config, w_smem, x_smem, warp, half)
            for mt in range(streaming.M_TILES):
                for nt in range(config.n_tiles):
                    for j in range(4):
                        a, b = _isa_operands(a_regs, b_regs, mt, nt, j)
                        for m in range(16):
                            for n in range(8):
                                for k in range(16):
                                    _, w_row, w_k = a[m, k]
                                    _, token_slot, x_k = b[k, n]
                                    assert w_k == x_k, (mt, nt, j, m, n, k)
                                    assert w_row == streaming.item_weight_row(gemm1, n_tile, mt * 16 + m)
                                    assert token_slot == nt * 8 + n
                                    products.setdefault((mt, nt, m, n), []).append(w_k)
        block_ks = list(range(k_block * streaming.BLOCK, (k_block + 1) * streaming.BLOCK))
        assert len(products) == streaming.M_TILES * config.n_tiles * 16 * 8
        assert all(sorted(ks) == block_ks for ks in products.values())


@pytest.mark.parametrize("gemm1", [True, False])
def test_item_bases_and_copy_offsets_address_the_transcribed_weight_rows(gemm1):
    # load_stage adds item_weight_row(.., 0, 4 i) rows to the row item_bases took for the thread's first
    # copy; _weight_smem transcribes the rows each copy must read.
    config = streaming.StreamingGemmConfig(gemm1=gemm1, block_tokens=16, num_stages=4)
    chunks_per_row = streaming.STAGE_K // streaming.CHUNK
    rows_per_pass = streaming.NUM_THREADS // chunks_per_row
    for n_tile in range(config.items_per_row_tile):
        for tidx in range(streaming.NUM_THREADS):
            first = streaming.item_weight_row(gemm1, n_tile, tidx // chunks_per_row)
            for i in range(streaming.ITEM_ROWS * chunks_per_row // streaming.NUM_THREADS):
                row = (i * streaming.NUM_THREADS + tidx) // chunks_per_row
                assert first + streaming.item_weight_row(gemm1, 0, i * rows_per_pass) == streaming.item_weight_row(
                    gemm1, n_tile, row
                )


def test_accumulator_coordinates_follow_the_isa():
    for lane in range(32):
        group, quad = lane // GROUP_SIZE, lane % GROUP_SIZE
        for mt in range(streaming.M_TILES):
            for nt in range(4):
                for i in range(4):
                    row, col = _isa_c_coords(lane, i)
                    assert streaming.accumulator_coords(mt, nt, i, group, quad) == (mt * 16 + row, nt * 8 + col)


@pytest.mark.parametrize("gemm1", [True, False], ids=["gemm1", "gemm2"])
def test_items_cover_every_weight_row_once_with_its_block_scale(gemm1):
    config = streaming.StreamingGemmConfig(gemm1=gemm1, block_tokens=16, num_stages=4)
    seen = []
    for n_tile in range(config.items_per_row_tile):
        rows = [streaming.item_weight_row(gemm1, n_tile, r) for r in range(streaming.ITEM_ROWS)]
        seen += rows
        for mt in range(streaming.M_TILES):
            scale_row = streaming.item_weight_scale_row(gemm1, n_tile, mt)
            assert all(row // streaming.BLOCK == scale_row for row in rows[mt * 16 : mt * 16 + 16])
        if gemm1:
            # SwiGLU pairs C column 16 n_tile + c: up row c (first half of W13), gate row 16 + c
            # (second half), as in hopperbench/tracks/moe/reference.py
            columns = range(n_tile * streaming.GEMM1_ITEM_COLUMNS, (n_tile + 1) * streaming.GEMM1_ITEM_COLUMNS)
            assert rows[: streaming.GEMM1_ITEM_COLUMNS] == list(columns)
            assert rows[streaming.GEMM1_ITEM_COLUMNS :] == [streaming.INTERMEDIATE + c for c in columns]
    assert sorted(seen) == list(range(config.weight_rows))


def _locate(row_tile: int, tile_end: list[int], counts: list[int], offsets: list[int], block_tokens: int):
    """Transcription of StreamingGemm.locate (binary lifting over the inclusive tile ends)."""
    expert = 0
    for step in (16, 8, 4, 2, 1):
        assert expert + step - 1 <= 30  # never reads past tile_end[31]
        if tile_end[expert + step - 1] <= row_tile:
            expert += step
    count = counts[expert]
    first_row = (row_tile - (tile_end[expert] - (count + block_tokens - 1) // block_tokens)) * block_tokens
    return expert, first_row, min(count - first_row, block_tokens), offsets[expert] + first_row


def _schedule_counts(num_tokens: int) -> list[list[int]]:
    rng = random.Random(num_tokens)
    shapes = [
        [0] * 32,  # no local expert
        [num_tokens] + [0] * 31,  # every token on expert 0
        [0] * 31 + [num_tokens],  # every token on the last expert
        [0] * 5 + [num_tokens] + [0] * 26,
        [num_tokens] * 8 + [0] * 24,  # all 8 choices local, on the same 8 experts
        [0, num_tokens] * 4 + [0] * 24,
    ]
    for _ in range(20):
        counts = [0] * 32
        for _ in range(num_tokens):
            for e in rng.sample(range(32), rng.randint(0, 8)):
                counts[e] += 1
        shapes.append(counts)
    if 8 * num_tokens >= 32 * 17:
        shapes.append([17] * 32)  # one row past a 16-row tile everywhere
    return shapes


@pytest.mark.parametrize("num_tokens", [1, 7, 33, 64, 65, 192, 901])
def test_persistent_schedule_covers_every_row_and_column_tile_once(num_tokens):
    # The mma.sync GEMMs' schedule at each variant's tiles (the WGMMA GEMMs walk their own items:
    # test_moe_wgmma_gemm1.py).
    variant = kernel.variant_for(num_tokens)
    configs = (
        streaming.StreamingGemmConfig(True, variant.block_tokens, variant.num_stages),
        streaming.StreamingGemmConfig(False, variant.gemm2_block_tokens, variant.gemm2_num_stages),
    )
    for config in configs:
        bt = config.block_tokens
        for counts in _schedule_counts(num_tokens):
            assert sum(counts) <= 8 * num_tokens and max(counts) <= num_tokens  # workspace bounds
            tiles = [(c + bt - 1) // bt for c in counts]
            tile_end = [sum(tiles[: e + 1]) for e in range(32)]
            offsets = [sum(counts[:e]) for e in range(32)]  # combine.py's exclusive prefix
            total_items = tile_end[31] * config.items_per_row_tile
            # every item (row tile x column tile) exactly once over the persistent CTAs; the item
            # of flat stage s is the kernel's cta + (s // k_stages) * grid
            for grid in (config.grid(132), 7):
                visited = []
                for cta in range(grid):
                    my_items = (total_items - cta + grid - 1) // grid if cta < total_items else 0
                    for s in range(0, my_items * config.k_stages, config.k_stages):
                        visited.append(cta + (s // config.k_stages) * grid)
                assert sorted(visited) == list(range(total_items))
            # every row tile to its expert's rows, each row once, at the packed row combine reads
            rows = {}
            for row_tile in range(tile_end[31]):
                expert, first_row, valid_rows, packed_row0 = _locate(row_tile, tile_end, counts, offsets, bt)
                assert 1 <= valid_rows <= bt and first_row + valid_rows <= counts[expert]
                for token_slot in range(valid_rows):
                    assert (expert, first_row + token_slot) not in rows
                    rows[expert, first_row + token_slot] = packed_row0 + token_slot
            assert rows == {(e, r): offsets[e] + r for e in range(32) for r in range(counts[e])}
            assert max(rows.values(), default=-1) < 8 * num_tokens  # rows of the packed workspaces


def slots_drawn(start: int, choices: tuple[int, ...]) -> tuple[list[int], int]:
    """Transcription of `take_walk_slot` on one SM's int32 word for its three CTAs: a CTA's slot is the word before an
    add of 1, mod WALK_SLOT_ROUND, and a CTA that drew WALK_SLOT_ROUND - 1 takes its second draw, whatever it is. Each
    atomic goes to the pending CTA that `choices` picks (an index into the pending ones). Returns (the slots by CTA,
    the word after)."""
    word, round_ = start, streaming.WALK_SLOT_ROUND
    slots, draws = [-1, -1, -1], [0, 0, 0]
    for choice in choices:
        pending = [cta for cta in range(3) if slots[cta] < 0 or slots[cta] == round_ - 1 and draws[cta] == 1]
        if not pending:
            break
        cta = pending[choice % len(pending)]
        slots[cta], draws[cta] = word & (round_ - 1), draws[cta] + 1
        word = (word + 1 + 2**31) % 2**32 - 2**31
    return slots, word


def test_the_slot_draw_gives_each_sms_ctas_every_slot_once_from_any_word_in_any_order():
    # Every interleaving of the CTAs' atomics (at most four on an SM), from words of every residue, around zero and at
    # the int32 wrap: one redraw suffices, since between a CTA's two draws the other two take at most two values.
    for start in (*range(-4, 9), 2**31 - 4, 2**31 - 3, 2**31 - 2, 2**31 - 1):
        start = (start + 2**31) % 2**32 - 2**31
        for choices in itertools.product(range(3), repeat=5):
            slots, after = slots_drawn(start, choices)
            assert sorted(slots) == [0, 1, 2], (start, choices)
            # A word at 0 mod 4 ends at 3 (the next call's first draw skips it); every other word advances by 4.
            assert (after - start) % 2**32 == (3 if start % 4 == 0 else 4), (start, choices)


def test_the_walk_by_partition_rank_needs_a_cooperative_three_cta_gemm1():
    with pytest.raises(ValueError, match="cooperative"):
        dataclasses.replace(kernel.MEDIUM_T, routing=kernel.Routing.ROUTING_GRID)
    # The WGMMA GEMM1's: its draw gives the slots 0-2, so it needs exactly three CTAs on every SM.
    wgmma_gemm1 = solution_module("wgmma_gemm1")
    with pytest.raises(streaming.StreamingConfigError, match="three CTAs"):  # ~110 KB a CTA: two fit
        wgmma_gemm1.WgmmaGemm1Config(32, 4, scratch_in_stage=True, feed=wgmma_gemm1.Gemm1Feed.PRODUCER_WARP)
    medium = kernel.MEDIUM_T.gemm1()
    assert medium.partition_walk and "walk_slot" in medium.fields() and medium.ctas_per_sm() == 3


def test_gemm2_claims_its_items_in_the_fused_gemms_from_5_to_32_tokens_only():
    # The `mma.sync` GEMM2 after the early-W2 variant (whose round robin is known before its wait): the fused GEMMs'
    # GEMM2 phase, whose shared memory holds the word of its claims.
    fused_gemms = solution_module("fused_gemms")
    for num_tokens in range(1, 200):
        variant = kernel.variant_for(num_tokens)
        assert (variant.handover is kernel.Handover.FUSED) == (5 <= num_tokens < kernel.WGMMA_GEMM1_MIN_TOKENS)
        assert "claimed_item" not in variant.gemm2().fields()
    fused = kernel.FUSED_T.make_host().gemms.cfg
    assert isinstance(fused, fused_gemms.FusedGemmsConfig) and "claimed_item" in fused.fields()
    assert fused.ctas_per_sm() == 2


def claims_transcribed(total_items: int, grid: int, order: random.Random, start: int = 0) -> tuple[list[int], int]:
    """The claims of `claim_item` / `release_claims` as the loop makes them: CTA c's first item is c; each CTA claims
    (counter += 1, item grid + claim) until a claim is past the last item; the CTA whose failing claim is the launch's
    final one subtracts final + 1. The CTAs' atomics interleave in `order`. Returns (items computed, counter after)."""
    counter, computed, last_claims = start, [c for c in range(min(grid, total_items))], {}
    claiming = list(range(grid))  # every CTA makes its first claim at its start, item or not
    while claiming:
        cta = order.choice(claiming)
        claim, counter = counter, counter + 1
        if grid + claim < total_items:
            computed.append(grid + claim)
        else:
            claiming.remove(cta)
            last_claims[cta] = claim
    final = max(total_items - grid, 0) + grid - 1
    for claim in last_claims.values():
        if claim == final:
            counter -= final + 1
    return computed, counter


@pytest.mark.parametrize("grid", [1, 2, 264])
def test_every_item_is_computed_once_and_the_counter_ends_at_zero(grid):
    order = random.Random(grid)
    for total_items in (0, 1, grid - 1, grid, grid + 1, 3 * grid + 7, 1120):
        for _ in range(5):
            computed, counter = claims_transcribed(total_items, grid, order)
            assert sorted(computed) == list(range(total_items))
            assert counter == 0


def test_pipeline_waits_for_each_stage_and_never_overwrites_a_slot_in_use():
    # Transcription of the flat cp.async pipeline: the prologue commits ns - 1 groups (stages
    # 0..ns-2, some possibly empty), iteration s waits until <= ns - 2 groups are pending, syncs,
    # loads stage s + ns - 1 into slot (s + ns - 1) % ns, commits, then reads slot s % ns.
    for ns in (2, 3, 4):
        for total in (0, 1, 2, 3, 5, 14, 29):
            committed = [p if p < total else None for p in range(ns - 1)]  # group -> stage
            for s in range(total):
                landed = {stage for stage in committed[: len(committed) - (ns - 2)] if stage is not None}
                assert s in landed
                # every warp has finished stage s - 1 (the barrier); stages s .. s + ns - 2 are
                # still to be read and must keep their slots
                next_stage = s + ns - 1
                live_slots = {t % ns for t in range(s, min(next_stage, total))}
                if next_stage < total:
                    assert next_stage % ns not in live_slots
                committed.append(next_stage if next_stage < total else None)
            assert len(committed) == ns - 1 + total


def test_per_item_copy_offsets_fit_32_bits():
    # item_bases (streaming, WGMMA) add 32-bit element offsets to the tensors' base pointers: the largest is
    # the last expert's last weight row plus a stage, and the last token's (or packed C row's) last chunk.
    assert streaming.NUM_LOCAL_EXPERTS * streaming.GEMM1_OUT * streaming.HIDDEN < 2**31
    assert streaming.NUM_LOCAL_EXPERTS * streaming.HIDDEN * streaming.INTERMEDIATE < 2**31
    assert kernel.MAX_TOKENS * streaming.HIDDEN < 2**31
    assert 8 * kernel.MAX_TOKENS * streaming.INTERMEDIATE < 2**31


def test_packed_workspace_element_offsets_fit_32_bits_at_the_token_limit():
    # all 8 choices of every token local: 8 T packed rows of 7168 fp32 in expert_out, indexed with
    # 32-bit element offsets (the byte addresses are 64-bit: test_largest_batch_with_every_choice_local)
    rows = 8 * kernel.MAX_TOKENS
    assert rows * streaming.HIDDEN < 2**31 <= rows * streaming.HIDDEN * 4


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


def _relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected).clamp_min(1e-30))


def _bad_column_tiles(actual: torch.Tensor, expected: torch.Tensor, tile: int, bound: float) -> list[int]:
    """Column tiles (work item column tiles) whose relative L2 exceeds `bound`: a wrong tile
    points at one n_tile of the item map."""
    tiles = expected.shape[1] // tile
    return [
        n
        for n in range(tiles)
        if _relative_l2(actual[:, n * tile : (n + 1) * tile], expected[:, n * tile : (n + 1) * tile]) > bound
    ]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("stages_t7", 7, 96),
        cases.CheckCase("stages_t80_one_expert", 80, 0, "one_expert"),
        cases.CheckCase("stages_t58", 58, 96),  # FEW_TOKENS: WGMMA GEMM2 with 8-token tiles
        cases.CheckCase("stages_t192_all_local", 192, 96, "all_local"),  # FEW_TOKENS' largest T
        cases.CheckCase("stages_t193", 193, 32),
        cases.CheckCase("stages_t300_one_expert", 300, 96, "one_expert"),
        cases.CheckCase("stages_t901", 901, 224),
    ],
    ids=lambda c: c.name,
)
def test_each_gemm_matches_torch_on_its_packed_rows(case):
    check_each_gemm(case, kernel.variant_for)


def always_early_w2(num_tokens: int):
    """TINY_T_EARLY_W2 at any T below 33, so that the GPU tests exercise it beyond its dispatch range."""
    assert num_tokens < kernel.WGMMA_GEMM1_MIN_TOKENS
    return kernel.TINY_T_EARLY_W2


EARLY_W2_CASES = [
    cases.CheckCase("early_t1", 1, 0),
    cases.CheckCase("early_t1_one_expert", 1, 64, "one_expert"),
    cases.CheckCase("early_t3_all_local", 3, 160, "all_local"),
    cases.CheckCase("early_t7", 7, 224),
    cases.CheckCase("early_t13_all_local", 13, 32, "all_local"),
    cases.CheckCase("early_t16_one_expert", 16, 96, "one_expert"),
    cases.CheckCase("early_t32", 32, 128),
    cases.CheckCase("early_t32_all_local", 32, 0, "all_local"),
    cases.CheckCase("early_t5_no_local", 5, 160, "no_local"),
]


def always_fused(num_tokens: int):
    """FUSED_T at any T below 33, so that the GPU tests run the fused GEMMs beyond their dispatch range (its grid
    meets after the routing at 1-4 tokens too, where `kernel.py` routes in every CTA)."""
    assert num_tokens < kernel.WGMMA_GEMM1_MIN_TOKENS
    return kernel.FUSED_T


FUSED_CASES = [
    cases.CheckCase("fused_t1_one_expert", 1, 64, "one_expert"),
    cases.CheckCase("fused_t3_all_local", 3, 160, "all_local"),
    cases.CheckCase("fused_t4", 4, 32),
    cases.CheckCase("fused_t7_no_local", 7, 96, "no_local"),
    cases.CheckCase("fused_t8_one_expert", 8, 128, "one_expert"),
    cases.CheckCase("fused_t24_all_local", 24, 32, "all_local"),
]


# Variants forced beyond their dispatch range, each with its cases: the chained `mma.sync` GEMMs with another routing or
# hand-over, so each must give their output bit for bit (the same products per token in the same order).
FORCED_VARIANTS = [(always_early_w2, case) for case in EARLY_W2_CASES] + [(always_fused, case) for case in FUSED_CASES]


def forced_id(value) -> str:
    return value.__name__ if callable(value) else value.name


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("choose", "case"), [(f, c) for f, c in FORCED_VARIANTS if c.pattern != "no_local"], ids=forced_id
)
def test_each_gemm_of_a_forced_variant_matches_torch(choose, case):
    check_each_gemm(case, choose)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("choose", "case"), FORCED_VARIANTS, ids=forced_id)
def test_a_forced_variant_is_tiny_t_bit_for_bit_call_after_call(choose, case):
    # The early-W2 GEMM2's weights issued before its wait and the fused GEMMs (8-token GEMM1 tiles, GEMM2
    # items started per expert) change no output bit, and each call leaves the kept count of routed tokens (which the
    # early-W2 GEMM2 polls before its wait, and whose second word holds the fused GEMM2's claims) at zero for the next.
    inputs = cases.make_inputs(case, "cuda", seed=43)
    counters = solution_module("counters")
    outputs = []
    for run in (kernel.make_run(lambda _: CHAINED_MMA_SYNC), *[kernel.make_run(choose)] * 3):
        output = cases.poisoned_output(case.num_tokens, "cuda")
        run(*inputs.values(), output)
        torch.cuda.synchronize()
        routed = counters.kept_routed(torch.device("cuda"), kernel.GPU_ARCH)
        assert int(routed.abs().sum()) == 0, "the combine leaves the kept count at zero"
        outputs.append(output)
    theirs, *ours = outputs
    for output in ours:
        assert not torch.isnan(output).any()
        assert torch.equal(output, theirs)


# The GEMM1 that walks by partition rank (slots drawn by SM id): the WGMMA one at 193-1024 tokens.
SMID_WALK_CASES = [
    cases.CheckCase("smid_walk_t193", 193, 224),
    cases.CheckCase("smid_walk_t500_one_expert", 500, 32, "one_expert"),
    cases.CheckCase("smid_walk_t901", 901, 96),
    cases.CheckCase("smid_walk_t1000_no_local", 1000, 64, "no_local"),
    cases.CheckCase("smid_walk_t1024_all_local", 1024, 160, "all_local"),
]


def walk_by_cta_index(num_tokens: int) -> kernel.StreamingVariant:
    """`kernel.py`'s variant with GEMM1 fed by its warpgroup, walking over its CTA index (the same items and MMAs)."""
    return dataclasses.replace(kernel.variant_for(num_tokens), gemm1_feed=kernel.Gemm1Feed.WARPGROUP)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", SMID_WALK_CASES, ids=lambda c: c.name)
def test_the_producer_warps_walk_is_the_walk_by_cta_bit_for_bit_from_any_slot_words(case):
    # The three-CTA GEMM1 draws its slots from kept per-SM words that no call zeroes: from words of every
    # residue (the int32 wrap included) each call gives every SM's CTAs every slot once, so the outputs stay those of
    # the warpgroup-fed GEMM1's walk over the CTA index bit for bit, and each word advances by 3 from 0 mod 4 and by 4
    # otherwise. The H200's SM ids are dense (`kernels/moe/probes/cta_placement.py`), so no SM takes the fallback walk.
    # The walk buffer keeps the counters before the partition ranks.
    variant = kernel.variant_for(case.num_tokens)
    assert variant.gemm1_feed is kernel.Gemm1Feed.PRODUCER_WARP
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    counters = solution_module("counters")
    buffer = counters.kept_walk_slots(device, kernel.GPU_ARCH)
    words = buffer[: solution_module("streaming_gemm").WALK_SLOT_WORDS]  # a view: the slot counters
    start = torch.tensor([-2**31, 2**31 - 1, -1, 0, 1, 2, 3, 5] * 32, dtype=torch.int32, device=device)[: words.numel()]
    words.copy_(start)
    theirs, *ours = outputs_of((kernel.make_run(walk_by_cta_index), *[kernel.run] * 2), case, seed=59)
    assert torch.isfinite(theirs).all()
    if case.pattern != "no_local":
        assert bool((theirs != 0).any())
    for output in ours:
        assert torch.equal(output, theirs)
    advanced = (words.long() - start.long()) % 2**32
    first = torch.where(start.long() % 4 == 0, 3, 4)
    assert torch.equal(advanced[:sms], first[:sms] + 4)
    assert torch.equal(advanced[sms:], torch.zeros_like(advanced[sms:]))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("claimed_w2_t7_all_local", 7, 0, "all_local"),
        cases.CheckCase("claimed_w2_t7_no_local", 7, 96, "no_local"),
        cases.CheckCase("claimed_w2_t8_one_expert", 8, 128, "one_expert"),
        cases.CheckCase("claimed_w2_t14", 14, 32),
        cases.CheckCase("claimed_w2_t32_one_expert", 32, 160, "one_expert"),
    ],
    ids=lambda c: c.name,
)
def test_claimed_gemm2_items_are_the_fixed_walks_bit_for_bit_and_the_claims_end_at_zero(case):
    # Which CTA computes an item changes no output bit, and each call leaves the kept buffer (the routed count,
    # which the combine zeroes, and the claim counter, which GEMM2 brings back itself) at zero; the claims
    # are the fused GEMMs' (whose chained counterpart walks GEMM2 over the CTA index).
    def fixed_walk(num_tokens: int):
        return dataclasses.replace(kernel.variant_for(num_tokens), handover=kernel.Handover.CHAINED)

    routed = solution_module("counters").kept_routed(torch.device("cuda"), kernel.GPU_ARCH)
    theirs, *ours = outputs_of((kernel.make_run(fixed_walk), *[kernel.run] * 3), case, seed=71)
    assert torch.isfinite(theirs).all()
    for output in ours:
        assert torch.equal(output, theirs)
    assert int(routed.abs().sum()) == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("grouped_t1025_one_expert", 1025, 96, "one_expert"),  # GROUPED_T's smallest T
        cases.CheckCase("grouped_t2048_all_local", 2048, 0, "all_local"),
        cases.CheckCase("grouped_t2049", 2049, 96),
        cases.CheckCase("grouped_t3000_eight_local", 3000, 224, "eight_local"),
        cases.CheckCase("grouped_t4097_one_expert", 4097, 0, "one_expert"),
    ],
    ids=lambda c: c.name,
)
def test_each_gemm_of_the_grouped_variant_matches_torch(case):
    # GROUPED_T (kernel.py's variant at each of them): the routing lists, C of the grouped GEMM1 on the gathered rows
    # (in GEMM2's column order) and O of the grouped GEMM2 on it.
    assert kernel.variant_for(case.num_tokens) is kernel.GROUPED_T
    check_each_gemm(case, kernel.variant_for)


@pytest.mark.gpu
@needs_cuda
def test_largest_batch_with_every_choice_local(case=cases.CheckCase("t16384_all_local", 16384, 64, "all_local")):
    # The largest T with all 8 T assignments local: expert_out holds 131072 packed rows, 3.8 GB,
    # so its byte offsets pass 2**31 (element offsets do not).
    inputs = cases.make_inputs(case, "cuda", seed=31)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    workspaces = kernel.run_keeping_workspaces(*inputs.values(), output)
    torch.cuda.synchronize()
    assert int(workspaces.counts.sum()) * streaming.HIDDEN * 4 > 2**31
    stats = cases.compare(output, reference.run(*inputs.values()))
    assert stats.passed and stats.relative_l2 < 1e-2, stats


@pytest.mark.gpu
@needs_cuda
def test_official_large_batch_passes(case=cases.CheckCase("large_t11948", 11948, 128)):
    inputs = cases.make_inputs(case, "cuda", seed=29)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    kernel.run(*inputs.values(), output)
    torch.cuda.synchronize()
    stats = cases.compare(output, reference.run(*inputs.values()))
    assert stats.passed and stats.relative_l2 < 1e-2, stats


def on_mma_sync(variant):
    """`variant` (a streaming one: up to MEDIUM_T_MAX_TOKENS) with both GEMMs on `mma.sync`, chained (itself where it
    is on `mma.sync`): its routing, GEMM1's row tiles up to 32 tokens and its stages, GEMM2's row tiles up to 16 tokens
    with at least 3 stages (two CTAs per SM), C bf16 in natural column order."""
    if variant.engine is kernel.Engine.MMA_SYNC:
        return variant
    return kernel.StreamingVariant(
        kernel.Engine.MMA_SYNC,
        variant.routing,
        block_tokens=min(variant.block_tokens, 32),
        num_stages=variant.num_stages,
        gemm2_block_tokens=min(variant.gemm2_block_tokens, 16),
        gemm2_num_stages=max(variant.gemm2_num_stages, 3),
        combine_loads_first=variant.combine_loads_first,
    )


def test_every_mma_sync_counterpart_is_a_valid_variant():
    # On the CPU what the GPU tests build for each T (a variant that raises there would fail a full run).
    for num_tokens in (*range(1, 200), 193, 901, kernel.MEDIUM_T_MAX_TOKENS):
        counterpart = on_mma_sync(kernel.variant_for(num_tokens))
        assert counterpart.engine is kernel.Engine.MMA_SYNC and counterpart.gemm2().ctas_per_sm() == 2
        assert counterpart.gemm1().ctas_per_sm() >= 1


def natural_intermediate(stored: torch.Tensor, variant) -> torch.Tensor:
    """C in natural column order: the WGMMA GEMM2 variants store each 32-column group permuted
    (kernels/moe/intermediate_order.py)."""
    if variant.engine is not kernel.Engine.WGMMA:
        return stored
    order = solution_module("intermediate_order")
    columns = torch.arange(stored.shape[1], device=stored.device)
    stored_columns = columns - columns % order.GROUP + torch.tensor(
        [order.stored_position(c) for c in range(order.GROUP)], device=stored.device
    )[columns % order.GROUP]
    return stored[:, stored_columns]


def outputs_of(runs, case, seed: int) -> list[torch.Tensor]:
    """Each of `runs` (destination-passing `run`s) on the same fresh inputs of `case`, into NaN-poisoned
    outputs: for the bitwise comparisons of candidates with kernel.py."""
    inputs = cases.make_inputs(case, "cuda", seed=seed)
    outputs = []
    for run in runs:
        output = cases.poisoned_output(case.num_tokens, "cuda")
        run(*inputs.values(), output)
        torch.cuda.synchronize()
        outputs.append(output)
    return outputs


# MEDIUM_T's tokens (193-1024) in every routing pattern: the cases where a change to MEDIUM_T's kernels must keep every
# bit (the producer warp, candidates of MEDIUM_T's GEMM1).
MEDIUM_T_BITWISE_CASES = (
    cases.CheckCase("t193", 193, 224),
    cases.CheckCase("t512", 512, 0),
    cases.CheckCase("t901", 901, 96),
    cases.CheckCase("t901_one_expert", 901, 224, "one_expert"),
    cases.CheckCase("t1000_no_local", 1000, 64, "no_local"),
    cases.CheckCase("t1024_all_local", 1024, 160, "all_local"),
)


def assert_bit_for_bit(runs, case, seed: int) -> None:
    """`runs` (the first the reference point, e.g. kernel.py's `run`) give finite outputs, non-zero unless no token
    has a local expert, and all of them the same bits."""
    outputs = outputs_of(runs, case, seed)
    assert torch.isfinite(outputs[0]).all()
    if case.pattern != "no_local":
        assert bool((outputs[0] != 0).any())
    assert all(torch.equal(outputs[0], output) for output in outputs[1:])


def check_each_gemm(case, choose) -> None:
    """Localises a failure of test_matches_reference for the streaming variants `choose` picks: the
    routing lists against the reference's routing, C (GEMM1 + SwiGLU, bf16) against torch on the
    dequantised operands, and O (GEMM2) against torch on our own C (so a GEMM1 error does not show
    up as a GEMM2 one)."""
    inputs = cases.make_inputs(case, "cuda", seed=5)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    workspaces = kernel.run_keeping_workspaces(*inputs.values(), output, choose=choose)
    torch.cuda.synchronize()
    assert workspaces is not None
    experts, _ = reference._route(
        inputs["routing_logits"], inputs["routing_bias"], float(inputs["routed_scaling_factor"])
    )
    local = experts - int(inputs["local_expert_offset"])
    counts = workspaces.counts.tolist()
    x = reference._dequantize_activations(inputs["hidden_states"], inputs["hidden_states_scale"])
    intermediate = streaming.INTERMEDIATE
    offset = 0
    for expert, count in enumerate(counts):
        expected_tokens = torch.nonzero((local == expert).any(dim=1)).flatten()
        tokens = workspaces.expert_tokens[expert, :count].long()
        assert torch.equal(tokens.sort().values, expected_tokens), f"routing list of expert {expert}"
        if count == 0:
            continue
        rows = slice(offset, offset + count)
        offset += count
        w13 = reference._dequantize_weight(inputs["gemm1_weights"][expert], inputs["gemm1_weights_scale"][expert])
        projected = x[tokens] @ w13.T
        del w13
        c_expected = torch.nn.functional.silu(projected[:, intermediate:]) * projected[:, :intermediate]
        stored = workspaces.intermediate[rows]
        if choose(case.num_tokens).f16_c:  # rewritten in place as f16 times the row's power of two (c_to_f16.py)
            stored = stored.view(torch.float16).float() * workspaces.c_scale[rows, None]
        c = natural_intermediate(stored, choose(case.num_tokens)).float()
        assert not torch.isnan(c).any(), f"GEMM1 expert {expert}: NaN"
        bad = _bad_column_tiles(c, c_expected, streaming.GEMM1_ITEM_COLUMNS, 1e-2)
        assert not bad, f"GEMM1 expert {expert}: column tiles {bad[:8]} (rel L2 {_relative_l2(c, c_expected):.2e})"
        w2 = reference._dequantize_weight(inputs["gemm2_weights"][expert], inputs["gemm2_weights_scale"][expert])
        o_expected = c @ w2.T
        del w2
        o = workspaces.expert_out[rows]
        assert not torch.isnan(o).any(), f"GEMM2 expert {expert}: NaN"
        bad = _bad_column_tiles(o, o_expected, streaming.ITEM_ROWS, 1e-3)
        assert not bad, f"GEMM2 expert {expert}: column tiles {bad[:8]} (rel L2 {_relative_l2(o, o_expected):.2e})"
