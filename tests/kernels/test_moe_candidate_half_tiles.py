"""MoE candidate v2.47 (kernels/moe/candidate_half_tiles.py): MEDIUM_T's GEMM1 in 64-token tiles of two stages at three
CTAs per SM, items of tiles of at most 32 tokens on the half-width MMA. CPU: the dispatch, the configuration and its
guards, the shared memory for three CTAs, the compile. GPU (marked `gpu`): the output bit for bit kernel.py's at
193-1024 tokens for every routing pattern, on routings that give both narrow (<= 32 tokens) and wide row tiles. The
end-to-end checks against the reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest

from hopperbench.floors import moe_local_expert_counts
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import assert_bit_for_bit, streaming

candidate = solution_module("candidate_half_tiles")
wgmma_gemm1 = solution_module("wgmma_gemm1")
SEED = 101

BITWISE_CASES = (
    cases.CheckCase("t193", 193, 224),
    cases.CheckCase("t512", 512, 0),
    cases.CheckCase("t901", 901, 96),
    cases.CheckCase("t901_one_expert", 901, 224, "one_expert"),  # one expert's 901 tokens: 14 wide tiles and 5 rows
    cases.CheckCase("t1000_no_local", 1000, 64, "no_local"),
    cases.CheckCase("t1024_all_local", 1024, 160, "all_local"),  # every expert ~256 tokens: wide tiles only
)


def test_only_medium_t_changes():
    for num_tokens in (1, 7, 8, 32, 33, 192, kernel.MEDIUM_T_MAX_TOKENS + 1, 11948):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (193, 901, kernel.MEDIUM_T_MAX_TOKENS):
        chosen = candidate.variant_for(num_tokens)
        assert chosen is candidate.HALF_TILES
        assert dataclasses.replace(chosen, block_tokens=32, num_stages=3, gemm1_half_tile_items=False) == kernel.MEDIUM_T
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_configuration_keeps_three_ctas_and_medium_t_gemm2():
    gemm1 = candidate.HALF_TILES.gemm1()
    assert gemm1.half_tile_items and gemm1.block_tokens == 64 and gemm1.num_stages == 2
    assert gemm1.ctas_per_sm() == 3 and gemm1.smid_walk  # the smid walk's slot draw needs exactly three
    gemm2, medium_t_gemm2 = candidate.HALF_TILES.gemm2(), kernel.MEDIUM_T.gemm2()
    shape = ("block_tokens", "num_stages", "f16_c", "max_ctas_per_sm")
    assert [getattr(gemm2, name) for name in shape] == [getattr(medium_t_gemm2, name) for name in shape]
    with pytest.raises(streaming.StreamingConfigError, match="half_tile_items"):
        wgmma_gemm1.WgmmaGemm1Config(block_tokens=8, num_stages=3, half_tile_items=True)
    with pytest.raises(streaming.StreamingConfigError, match="half_tile_items"):
        wgmma_gemm1.WgmmaGemm1Config(block_tokens=64, num_stages=2, half_tile_items=True, scales_before_wait=True)
    with pytest.raises(streaming.StreamingConfigError, match="num_stages"):
        wgmma_gemm1.WgmmaGemm1Config(block_tokens=32, num_stages=1)
    with pytest.raises(ValueError, match="gemm1_half_tile_items"):
        kernel.StreamingVariant(block_tokens=16, gemm1_half_tile_items=True)  # the `mma.sync` GEMM1 has no such switch


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 1


@pytest.mark.gpu
@needs_cuda
def test_random_cases_have_narrow_and_wide_tiles():
    """Both of the candidate's MMA widths run in the bitwise cases below, not only one of them."""
    widths = set()
    for case in BITWISE_CASES:
        if case.pattern != "random":
            continue
        inputs = cases.make_inputs(case, "cuda", seed=SEED)
        counts = moe_local_expert_counts(inputs["routing_logits"], inputs["routing_bias"], case.local_expert_offset)
        for count in counts.tolist():
            tiles, last = divmod(count, 64)
            widths.update(["wide"] * tiles + (["narrow" if last <= 32 else "wide"] if last else []))
    assert widths == {"narrow", "wide"}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    assert_bit_for_bit((kernel.run, candidate.run, candidate.run), case, seed=SEED)
