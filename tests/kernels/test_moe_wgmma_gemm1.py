"""MoE GEMM1 + SwiGLU on FP8 warpgroup MMA (kernels/moe/wgmma_gemm1.py; in kernel.py
from 33 to 1024 tokens).

CPU: the byte offsets the cp.async copies write equal the offsets of the swizzled K_SW128 layouts
the WGMMA reads (traced from CuTe's own layouts, for every token-tile width and three stages); item
rows, SwiGLU pairing and block-scale rows; the shared-memory budget.
CPU also: the producer warp's configuration and its guards; the partition walk's item order; a walk buffer's ranks
written only once measured.
GPU (marked `gpu`): the per-GEMM check of test_moe_streaming.py on the WGMMA GEMMs at 7-1024 tokens (FEW_TOKENS
where kernel.py runs `mma.sync`); their accuracy against the `mma.sync` GEMMs'. MEDIUM_T's output with the producer
warp and its walk by partition rank bit for bit the same variant's with the warpgroup's feed and walk over the CTA
index; after the start-up (`kernel.warm_up`) every kept walk buffer, made before or after it, holds a permutation of
the SMs. The end-to-end checks are test_moe_kernel.py's (its graph replay at 512 tokens covers a walk buffer made
inside a capture, which has no ranks).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, reference, solution_module
from tests.kernels.test_moe_streaming import MEDIUM_T_BITWISE_CASES, assert_bit_for_bit, check_each_gemm, on_mma_sync

wgmma = solution_module("wgmma_gemm1")
STAGES = 3


def on_wgmma(num_tokens: int):
    """kernel.py's variant for T on WGMMA: FEW_TOKENS where kernel.py runs `mma.sync` (below 33 tokens)."""
    variant = kernel.variant_for(num_tokens)
    return variant if variant.engine is kernel.Engine.WGMMA else kernel.FEW_TOKENS


def on_mma_sync_for(num_tokens: int):
    """kernel.py's variant for T with both GEMMs on `mma.sync` (`on_mma_sync`)."""
    return on_mma_sync(kernel.variant_for(num_tokens))


def _traced_offsets(block_tokens: int) -> list[tuple[int, int, int, int, int]]:
    """(rows, row, k, stage, offset) of both staged layouts at every 16-B chunk start, and of the
    bytes inside a few chunks, evaluated by CuTe while it traces (no GPU)."""
    seen: list[tuple[int, int, int, int, int]] = []

    @cute.jit
    def probe(unused: cute.Tensor):
        _, a_layout, b_layout = wgmma.wgmma_operands(block_tokens, STAGES)
        for layout, rows in ((a_layout, wgmma.ITEM_ROWS), (b_layout, block_tokens)):
            for row in cutlass.range_constexpr(rows):
                for k in cutlass.range_constexpr(0, wgmma.STAGE_K, wgmma.CHUNK):
                    for stage in cutlass.range_constexpr(STAGES):
                        seen.append((rows, row, k, stage, layout((row, k, stage))))
                for k in cutlass.range_constexpr(wgmma.CHUNK):  # inside the first chunks of row `row`
                    seen.append((rows, row, 112 + k, 1, layout((row, 112 + k, 1))))

    unused = make_fake_compact_tensor(cutlass.Float32, (4,), assumed_align=16)
    cute.compile(probe, unused, options="--gpu-arch sm_90a")
    return seen


@pytest.mark.parametrize("block_tokens", [8, 16, 32])
def test_copy_offsets_are_the_mma_layouts_byte_for_byte(block_tokens):
    seen = _traced_offsets(block_tokens)
    assert len(seen) > 1000 and all(isinstance(offset, int) for *_, offset in seen)
    wrong = [
        (rows, row, k, stage, offset)
        for rows, row, k, stage, offset in seen
        if offset != wgmma.swizzled_offset(row, k, stage, rows)
    ]
    assert not wrong, wrong[:5]


def test_a_chunk_is_contiguous_and_aligned_under_the_swizzle():
    # The copies write 16 contiguous bytes from a 16-B aligned offset: the swizzle only permutes
    # 16-B chunks within 128-B rows.
    for rows in (8, 16, 32, 64):
        for row in range(rows):
            for k in range(0, wgmma.STAGE_K, wgmma.CHUNK):
                start = wgmma.swizzled_offset(row, k, 2, rows)
                assert start % wgmma.CHUNK == 0
                assert [wgmma.swizzled_offset(row, k + j, 2, rows) for j in range(wgmma.CHUNK)] == list(
                    range(start, start + wgmma.CHUNK)
                )


def test_items_cover_every_w13_row_once_and_pair_up_with_gate_rows():
    rows = [wgmma.item_weight_row(n, r) for n in range(wgmma.ITEMS_PER_ROW_TILE) for r in range(wgmma.ITEM_ROWS)]
    assert sorted(rows) == list(range(2 * wgmma.INTERMEDIATE))
    for n in range(wgmma.ITEMS_PER_ROW_TILE):
        for r in range(wgmma.HALF_ROWS):
            up, gate = wgmma.item_weight_row(n, r), wgmma.item_weight_row(n, wgmma.HALF_ROWS + r)
            assert gate == up + wgmma.INTERMEDIATE and up == n * wgmma.HALF_ROWS + r  # C column = up row
        for half in (0, 1):
            block_rows = {wgmma.item_weight_row(n, half * wgmma.HALF_ROWS + r) // wgmma.BLOCK for r in range(32)}
            assert block_rows == {wgmma.item_weight_scale_row(n, half)}  # one scale per half and K block


def test_item_bases_and_copy_offsets_address_the_item_rows():
    # WgmmaGemm1.item_bases takes the thread's first row; copy i adds item_weight_row(0, 8 i) rows. GEMM2's
    # item rows are consecutive, so its copy i simply adds 8 i rows.
    for n_tile in range(wgmma.ITEMS_PER_ROW_TILE):
        for tidx in range(wgmma.NUM_THREADS):
            first = wgmma.item_weight_row(n_tile, tidx // wgmma.CHUNKS_PER_ROW)
            for i in range(wgmma.ITEM_ROWS * wgmma.CHUNKS_PER_ROW // wgmma.NUM_THREADS):
                row = (i * wgmma.NUM_THREADS + tidx) // wgmma.CHUNKS_PER_ROW
                delta = wgmma.item_weight_row(0, i * wgmma.ROWS_PER_PASS)
                assert first + delta == wgmma.item_weight_row(n_tile, row)


def test_configurations_fit_two_ctas_per_sm_and_reject_bad_shapes():
    for block_tokens in (8, 16, 32):
        config = wgmma.WgmmaGemm1Config(block_tokens, 4)
        assert config.ctas_per_sm() == 2, config.smem_bytes()
    # The epilogue tile in a token stage has no region of its own: a tile's bytes fewer
    apart, in_stage = wgmma.WgmmaGemm1Config(32, 3), wgmma.WgmmaGemm1Config(32, 3, scratch_in_stage=True)
    assert "scratch" in apart.fields() and "scratch" not in in_stage.fields()
    assert apart.smem_bytes() - in_stage.smem_bytes() >= 32 * wgmma.ITEM_ROWS * 4
    for block_tokens in (24, 64):  # WGMMA N sizes that no variant runs
        with pytest.raises(wgmma.StreamingConfigError, match="block_tokens"):
            wgmma.WgmmaGemm1Config(block_tokens, 4)
    with pytest.raises(wgmma.StreamingConfigError):
        wgmma.WgmmaGemm1Config(32, 2)
    with pytest.raises(wgmma.StreamingConfigError, match="do not fit"):
        wgmma.WgmmaGemm1Config(32, 16)


@pytest.mark.parametrize("num_stages", [3, 4])
def test_the_epilogue_tile_takes_a_token_stage_no_copy_in_flight_targets(num_stages):
    """scratch_in_stage: at the epilogue of flat stage s (after the load of stage s + ns - 1 was issued),
    the copies in flight are those of stages s + 1 .. s + ns - 1, whose slots are not s's; and a token's
    fp32 row of the tile (64 values) is exactly its row of a token stage (256 e4m3)."""
    assert wgmma.ITEM_ROWS * 4 == wgmma.STAGE_K
    for s in range(3 * num_stages):
        in_flight = {t % num_stages for t in range(s + 1, s + num_stages)}
        assert s % num_stages not in in_flight


def test_producer_warp_configuration_and_its_guards():
    # MEDIUM_T's GEMM1 has a fifth (producer) warp and a full and an empty mbarrier per slot, at three CTAs
    # per SM walking by partition rank; FEW_TOKENS' warpgroup issues its own stages.
    gemm1 = kernel.MEDIUM_T.gemm1()
    without = on_warpgroup_feed(kernel.MEDIUM_T_MAX_TOKENS).gemm1()
    assert gemm1.producer_warp and gemm1.num_threads == 160 and without.num_threads == 128
    assert {"stage_full", "stage_empty"} <= set(gemm1.fields()) and gemm1.ctas_per_sm() == 3 and gemm1.partition_walk
    assert "stage_full" not in without.fields() and not without.partition_walk and without.ctas_per_sm() == 2
    assert not kernel.FEW_TOKENS.gemm1().producer_warp and not kernel.FEW_TOKENS.gemm1().partition_walk
    producer = wgmma.Gemm1Feed.PRODUCER_WARP
    with pytest.raises(wgmma.StreamingConfigError, match="producer warp"):
        wgmma.WgmmaGemm1Config(16, 3, scratch_in_stage=True, feed=producer)  # a lane per token slot
    with pytest.raises(wgmma.StreamingConfigError, match="producer warp"):
        wgmma.WgmmaGemm1Config(32, 3, feed=producer)  # the tile's slot is released after the epilogue
    with pytest.raises(ValueError, match="cooperative"):
        dataclasses.replace(kernel.MEDIUM_T, routing=kernel.Routing.ROUTING_GRID)  # not a cooperative launch
    assert wgmma.ROWS_PER_PRODUCER_COPY * wgmma.CHUNKS_PER_ROW == 32  # a producer copy spans whole token rows


def on_warpgroup_feed(num_tokens: int):
    """kernel.py's variant for T with GEMM1's stages issued by its warpgroup and ending on the CTA-wide barrier,
    two CTAs per SM walking over the CTA index, instead of the producer warp and its walk by partition rank."""
    return dataclasses.replace(kernel.variant_for(num_tokens), gemm1_feed=wgmma.Gemm1Feed.WARPGROUP)


def _partition_walk_item(item: int, first_tile: int, tiles: int) -> tuple[int, int]:
    # (row tile, N tile) of `item_row_tile` / `item_n_tile` with partition_walk, for an item of the expert whose
    # `tiles` row tiles start at first_tile
    local = item - first_tile * wgmma.ITEMS_PER_ROW_TILE
    return first_tile + local % tiles, local // tiles


@pytest.mark.parametrize("tiles_per_expert", [(1,), (3, 1, 6), (2, 2, 5, 1, 4)])
def test_the_partition_walks_item_order_is_a_bijection(tiles_per_expert):
    per_tile = wgmma.ITEMS_PER_ROW_TILE
    seen, first_tile = [], 0
    for tiles in tiles_per_expert:
        items = range(first_tile * per_tile, (first_tile + tiles) * per_tile)
        pairs = [_partition_walk_item(item, first_tile, tiles) for item in items]
        # the expert's row tiles of one N tile are adjacent items
        assert pairs[:tiles] == [(row, 0) for row in range(first_tile, first_tile + tiles)]
        seen += pairs
        first_tile += tiles
    assert sorted(seen) == [(row, n) for row in range(first_tile) for n in range(per_tile)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", MEDIUM_T_BITWISE_CASES, ids=lambda case: case.name)
def test_the_producer_warp_and_its_walk_change_no_bit(case):
    # The same bytes into the same swizzled slots and the same MMAs: only who issues the copies, how the stages
    # synchronise, and which CTA takes an item, and when, differ. kernel.run twice: call after call, walking by
    # partition rank (after the start-up).
    kernel.warm_up()
    assert_bit_for_bit((kernel.make_run(on_warpgroup_feed), kernel.run, kernel.run), case, seed=113)


def test_a_walk_buffer_gets_ranks_only_once_they_are_measured():
    counters, streaming_gemm = solution_module("counters"), solution_module("streaming_gemm")
    slots = streaming_gemm.WALK_SLOT_WORDS
    buffer = torch.zeros(2 * slots, dtype=torch.int32)
    counters.write_ranks(buffer, None)  # before `kernel.warm_up`: the last word stays 0, GEMM1 walks by %smid
    assert not bool(buffer.any())
    counters.write_ranks(buffer, [2, 0, 1])
    assert buffer[slots : slots + 3].tolist() == [2, 0, 1] and int(buffer[-1]) == streaming_gemm.RANKS_WRITTEN
    assert not bool(buffer[:slots].any()) and not bool(buffer[slots + 3 : -1].any())


@pytest.mark.gpu
@needs_cuda
def test_the_start_up_writes_the_partition_ranks_into_every_kept_walk_buffer():
    # A buffer made before `warm_up` (here another stream's) gets the ranks too, and so does one made after it.
    case = cases.CheckCase("t512", 512, 96)
    inputs = cases.make_inputs(case, "cuda", seed=31)
    counters, streaming_gemm = solution_module("counters"), solution_module("streaming_gemm")
    device = torch.device("cuda")
    side_stream = torch.cuda.Stream()
    with torch.cuda.stream(side_stream):
        kernel.run(*inputs.values(), cases.poisoned_output(case.num_tokens, "cuda"))
        earlier = counters.kept_walk_slots(device, kernel.GPU_ARCH)
    torch.cuda.synchronize()
    kernel.warm_up()
    output = cases.poisoned_output(case.num_tokens, "cuda")
    kernel.run(*inputs.values(), output)
    torch.cuda.synchronize()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    slots = streaming_gemm.WALK_SLOT_WORDS
    for buffer in (earlier, counters.kept_walk_slots(device, kernel.GPU_ARCH)):
        words = buffer.cpu()
        assert sorted(words[slots : slots + sms].tolist()) == list(range(sms))
        assert int(words[-1]) == streaming_gemm.RANKS_WRITTEN
    assert cases.compare(output, reference.run(*inputs.values())).passed


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("wgmma_t7", 7, 96),
        cases.CheckCase("wgmma_t80", 80, 0),
        cases.CheckCase("wgmma_t901", 901, 224),
        cases.CheckCase("wgmma_t300_one_expert", 300, 0, "one_expert"),
        cases.CheckCase("wgmma_t1024_all_local", 1024, 96, "all_local"),
    ],
    ids=lambda c: c.name,
)
def test_each_wgmma_gemm_matches_torch(case):
    check_each_gemm(case, on_wgmma)


@pytest.mark.gpu
@needs_cuda
def test_wgmma_gemm1_is_as_accurate_as_mma_sync(case=cases.CheckCase("wgmma_vs_mma_sync", 901, 96)):
    # The tensor core's FP8 accumulation inside a 128-K block flips bf16 roundings of the intermediate
    # and the output (1.8e-3 relative L2 between the two outputs at 901 tokens), so the WGMMA path is held
    # to the mma.sync path's distance from the reference, not to its bits.
    inputs = cases.make_inputs(case, "cuda", seed=11)
    expected = cases.reference_run(cases.load_reference())(*inputs.values()).float()
    errors = {}
    for name, choose in (("mma.sync", on_mma_sync_for), ("wgmma", on_wgmma)):
        output = cases.poisoned_output(case.num_tokens, "cuda")
        kernel.run_keeping_workspaces(*inputs.values(), output, choose=choose)
        torch.cuda.synchronize()
        assert torch.isfinite(output).all(), name
        errors[name] = float((output.float() - expected).norm() / expected.norm())
    assert errors["wgmma"] < 1.1 * errors["mma.sync"] and errors["wgmma"] < 1e-2, errors
