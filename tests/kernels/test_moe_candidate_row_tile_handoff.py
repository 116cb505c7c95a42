"""MoE candidate v2.23 (kernels/moe/candidate_row_tile_handoff.py): below 33 tokens GEMM2 polls GEMM1's finished row
tiles instead of waiting for GEMM1's grid.

CPU: the dispatch, the configuration guards, the row-tile arithmetic against GEMM1's own walk, the counters' capacity
and the compile. GPU (marked `gpu`): each GEMM against torch on its packed rows, and the output bit for bit kernel.py's
at 1-32 tokens in every routing pattern, three calls in a row with the kept counters back at zero after each. The
end-to-end checks against the reference and graph replay are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from tests.kernels.compile_checks import assert_compiles_and_caches
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import check_each_gemm

candidate = solution_module("candidate_row_tile_handoff")
streaming = solution_module("streaming_gemm")
counters = solution_module("counters")


def test_the_hand_over_below_33_tokens_only():
    for num_tokens in (1, 6, 7, 16, 32):
        chosen = candidate.variant_for(num_tokens)
        assert chosen is candidate.TINY_T_HANDOFF
        assert chosen.gemm1().handoff is not None and chosen.gemm2().handoff is not None
        assert chosen.gemm2().weights_before_wait
    for num_tokens in (33, 192, 901, 14107):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    assert all(variant.gemm1().handoff is None for variant in kernel.VARIANTS if not variant.wgmma_gemm1)


def test_the_hand_over_is_refused_where_gemm2_cannot_poll():
    with pytest.raises(ValueError, match="gemm2_weights_before_wait"):
        dataclasses.replace(kernel.TINY_T, row_tile_handoff=True)
    with pytest.raises(ValueError, match="mma.sync GEMM1"):
        dataclasses.replace(kernel.FEW_TOKENS, row_tile_handoff=True)
    handoff = streaming.RowTileHandoff(16)
    with pytest.raises(streaming.StreamingConfigError, match="own row tiles"):
        streaming.StreamingGemmConfig(True, 8, 4, handoff=handoff)
    with pytest.raises(streaming.StreamingConfigError, match="weights_before_wait"):
        streaming.StreamingGemmConfig(False, 8, 4, handoff=handoff)
    with pytest.raises(streaming.StreamingConfigError, match="one GEMM1 row tile"):
        streaming.StreamingGemmConfig(False, 32, 4, weights_before_wait=True, handoff=handoff)


def gemm1_walk(counts: list[int], block_tokens: int) -> dict[tuple[int, int], int]:
    """(expert, packed row within the expert) -> GEMM1's global row tile, as its walk numbers them."""
    tiles, row_tile = {}, 0
    for expert, count in enumerate(counts):
        for first in range(0, count, block_tokens):
            for row in range(first, min(first + block_tokens, count)):
                tiles[expert, row] = row_tile
            row_tile += 1
    return tiles


def test_gemm2_finds_the_gemm1_row_tile_of_each_of_its_rows():
    rng = random.Random(3)
    for _ in range(200):
        counts = [rng.choice((0, 0, 1, 5, 8, 16, 17, 31, 32)) for _ in range(32)]
        walk = gemm1_walk(counts, 16)
        tile_end = list(itertools.accumulate((c + 15) // 16 for c in counts))
        for (expert, row), tile in walk.items():
            first_row = row - row % 8  # a GEMM2 row tile of 8 tokens starts there
            assert streaming.gemm1_row_tile(tile_end[expert], counts[expert], first_row, 16) == tile


def test_the_counters_hold_every_row_tile_of_a_call():
    rng = random.Random(4)
    for num_tokens in (1, 2, 7, 16, 32):
        for _ in range(200):
            counts = [0] * 32
            for _ in range(8 * num_tokens):  # at most one choice per token and expert: each count <= T
                expert = rng.randrange(32)
                counts[expert] = min(counts[expert] + 1, num_tokens)
            assert sum((c + 15) // 16 for c in counts) <= streaming.row_tile_capacity(num_tokens)
        # the worst case: one token in as many experts as possible, then whole tiles of 16 from the rest
        singles = min(32, 8 * num_tokens)
        assert singles + (8 * num_tokens - singles) // 16 <= streaming.row_tile_capacity(num_tokens)


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(candidate.compile_only, len(kernel.VARIANTS))


HANDOFF_CASES = [
    cases.CheckCase("handoff_t1", 1, 0),
    cases.CheckCase("handoff_t3_all_local", 3, 160, "all_local"),
    cases.CheckCase("handoff_t7", 7, 224),
    cases.CheckCase("handoff_t13_all_local", 13, 32, "all_local"),
    cases.CheckCase("handoff_t16_one_expert", 16, 96, "one_expert"),
    cases.CheckCase("handoff_t32", 32, 128),
    cases.CheckCase("handoff_t32_all_local", 32, 0, "all_local"),
    cases.CheckCase("handoff_t5_no_local", 5, 160, "no_local"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", [c for c in HANDOFF_CASES if c.pattern != "no_local"], ids=lambda c: c.name)
def test_each_gemm_matches_torch_on_its_packed_rows(case):
    check_each_gemm(case, candidate.variant_for)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", HANDOFF_CASES, ids=lambda c: c.name)
def test_output_is_kernel_py_bit_for_bit_call_after_call(case):
    inputs = cases.make_inputs(case, "cuda", seed=45)
    outputs = []
    for run in (kernel.run, candidate.run, candidate.run, candidate.run):
        output = cases.poisoned_output(case.num_tokens, "cuda")
        run(*inputs.values(), output)
        torch.cuda.synchronize()
        for kept in (counters.kept_counts, counters.kept_routed):
            assert int(kept(torch.device("cuda"), kernel.GPU_ARCH).abs().sum()) == 0
        outputs.append(output)
    theirs, *ours = outputs
    for output in ours:
        assert not torch.isnan(output).any()
        assert torch.equal(output, theirs)
