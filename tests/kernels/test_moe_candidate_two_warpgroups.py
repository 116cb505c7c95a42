"""MoE candidate v2.54 (kernels/moe/candidate_two_warpgroups.py): MEDIUM_T's GEMM1 on 64-token row tiles whose two
32-token halves are two MMA warpgroups sharing each stage's weights. CPU: the dispatch, the configuration and its guards
(288 threads, one CTA per SM, six stages), the token sub-stages tiling the token stages, the compile. GPU (marked
`gpu`): the output bit for bit kernel.py's at 193-1024 tokens for every routing pattern, call after call. The
end-to-end checks against the reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.kernels.test_moe_kernel import kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import MEDIUM_T_BITWISE_CASES, assert_bit_for_bit

candidate = solution_module("candidate_two_warpgroups")
wgmma_gemm1 = solution_module("wgmma_gemm1")


def test_only_medium_t_changes():
    for num_tokens in (1, 7, 8, 32, 33, 192, kernel.MEDIUM_T_MAX_TOKENS + 1, 11948):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (193, 901, kernel.MEDIUM_T_MAX_TOKENS):
        chosen = candidate.variant_for(num_tokens)
        assert chosen is candidate.TWO_WARPGROUPS
        assert chosen.gemm2().block_tokens == kernel.MEDIUM_T.gemm2().block_tokens  # GEMM2 unchanged
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_configuration_and_its_guards():
    gemm1 = candidate.TWO_WARPGROUPS.gemm1()
    assert (gemm1.block_tokens, gemm1.mma_tokens, gemm1.warpgroups, gemm1.num_stages) == (64, 32, 2, 6)
    assert gemm1.num_threads == 288 and gemm1.producer_warp_id == 8 and gemm1.ctas_per_sm() == 1
    plain = kernel.MEDIUM_T.gemm1()
    assert (plain.mma_tokens, plain.warpgroups, plain.producer_warp_id) == (32, 1, 4)
    with pytest.raises(wgmma_gemm1.StreamingConfigError, match="two_warpgroups"):
        wgmma_gemm1.WgmmaGemm1Config(32, 3, scratch_in_stage=True, producer_warp=True, two_warpgroups=True)
    with pytest.raises(wgmma_gemm1.StreamingConfigError, match="two_warpgroups"):
        wgmma_gemm1.WgmmaGemm1Config(64, 6, scratch_in_stage=True, two_warpgroups=True)  # no producer warp
    with pytest.raises(wgmma_gemm1.StreamingConfigError, match="producer_warp"):
        wgmma_gemm1.WgmmaGemm1Config(64, 3, scratch_in_stage=True, producer_warp=True)  # 64 tokens, one warpgroup
    with pytest.raises(ValueError, match="gemm1_two_warpgroups"):
        dataclasses.replace(kernel.LARGE_T, gemm1_two_warpgroups=True)


def test_token_sub_stages_tile_the_token_stages():
    # Tile row r of slot s lands in row r % 32 of sub-stage 2 s + r // 32: the two warpgroups' 32-row operands, one
    # after the other, cover the slot's 64 x 256 bytes once (the epilogue's tile of warpgroup g is its sub-stage).
    gemm1 = candidate.TWO_WARPGROUPS.gemm1()
    mt, wgs, ns = gemm1.mma_tokens, gemm1.warpgroups, gemm1.num_stages
    offsets = [
        wgmma_gemm1.swizzled_offset(row % mt, chunk * wgmma_gemm1.CHUNK, slot * wgs + row // mt, mt)
        for slot in range(ns)
        for row in range(gemm1.block_tokens)
        for chunk in range(wgmma_gemm1.CHUNKS_PER_ROW)
    ]
    assert sorted(offsets) == list(range(0, ns * gemm1.block_tokens * wgmma_gemm1.STAGE_K, wgmma_gemm1.CHUNK))
    assert wgmma_gemm1.ITEM_ROWS * 4 * mt == mt * wgmma_gemm1.STAGE_K  # a warpgroup's fp32 tile fits its sub-stage


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", MEDIUM_T_BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    assert_bit_for_bit((kernel.run, candidate.run, candidate.run), case, seed=113)
