"""MoE candidate v2.56 (kernels/moe/candidate_partition_walk.py): MEDIUM_T's GEMM1 walking its items partition by
partition (SM ranks from the measured L2 partition map, an expert's items weight tile by weight tile). CPU: the
dispatch, the configuration's guards, the item order's bijection (its formula), the compile. GPU (marked `gpu`): the
kept walk buffer holds a permutation of the SMs and the written mark after a call, the output bit for bit kernel.py's
at 193-1024 tokens for every routing pattern, call after call, and a CUDA-graph replay (whose captured buffer has no
ranks) against the reference. The end-to-end checks are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hopperbench.devcheck import replay_on_fresh_inputs
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, reference, solution_module
from tests.kernels.test_moe_streaming import MEDIUM_T_BITWISE_CASES, assert_bit_for_bit

candidate = solution_module("candidate_partition_walk")
wgmma_gemm1 = solution_module("wgmma_gemm1")
counters = solution_module("counters")
streaming_gemm = solution_module("streaming_gemm")


def test_only_medium_t_changes():
    for num_tokens in (1, 7, 8, 32, 33, 192, kernel.MEDIUM_T_MAX_TOKENS + 1, 11948):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (193, 901, kernel.MEDIUM_T_MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is candidate.PARTITION_WALK
    assert candidate.PARTITION_WALK.gemm1().partition_walk and not kernel.MEDIUM_T.gemm1().partition_walk
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_guards():
    with pytest.raises(wgmma_gemm1.StreamingConfigError, match="partition_walk"):
        wgmma_gemm1.WgmmaGemm1Config(32, 3, scratch_in_stage=True, producer_warp=True, partition_walk=True)
    with pytest.raises(ValueError, match="gemm1_partition_walk"):
        dataclasses.replace(kernel.LARGE_T, gemm1_partition_walk=True)


def _item_tile(item: int, first_tile: int, tiles: int) -> tuple[int, int]:
    # item_row_tile / item_n_tile with partition_walk, for an item of the expert whose tiles start at first_tile
    local = item - first_tile * wgmma_gemm1.ITEMS_PER_ROW_TILE
    return first_tile + local % tiles, local // tiles


@pytest.mark.parametrize("tiles_per_expert", [(1,), (3, 1, 6), (2, 2, 5, 1, 4)])
def test_the_expert_major_order_is_a_bijection_of_the_items(tiles_per_expert):
    per_tile = wgmma_gemm1.ITEMS_PER_ROW_TILE
    seen, first_tile = [], 0
    for tiles in tiles_per_expert:
        items = range(first_tile * per_tile, (first_tile + tiles) * per_tile)
        pairs = [_item_tile(item, first_tile, tiles) for item in items]
        # the expert's row tiles of one N tile are adjacent items
        assert [row for row, _ in pairs[:tiles]] == list(range(first_tile, first_tile + tiles))
        assert {n for _, n in pairs[:tiles]} == {0}
        seen += pairs
        first_tile += tiles
    assert sorted(seen) == [(row, n) for row in range(first_tile) for n in range(per_tile)]


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 4


@pytest.mark.gpu
@needs_cuda
def test_the_kept_walk_buffer_holds_the_ranks():
    case = cases.CheckCase("t512", 512, 96)
    inputs = cases.make_inputs(case, "cuda", seed=31)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    candidate.run(*inputs.values(), output)
    torch.cuda.synchronize()
    words = counters.kept_walk_slots(torch.device("cuda"), kernel.GPU_ARCH, ranked=True).cpu()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    slots = streaming_gemm.WALK_SLOT_WORDS
    assert sorted(words[slots : slots + sms].tolist()) == list(range(sms))
    assert int(words[-1]) == streaming_gemm.RANKS_WRITTEN
    assert cases.compare(output, reference.run(*inputs.values())).passed


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", MEDIUM_T_BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    assert_bit_for_bit((kernel.run, candidate.run, candidate.run), case, seed=113)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_without_ranks_follows_new_inputs():
    case = cases.CheckCase("graph", 512, 96)
    static = cases.make_inputs(case, "cuda", seed=1)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    fresh = cases.make_inputs(case, "cuda", seed=2)
    replay_on_fresh_inputs(lambda: candidate.run(*static.values(), output), static, fresh, (output,))
    stats = cases.compare(output, reference.run(*fresh.values()))
    assert stats.passed, stats
