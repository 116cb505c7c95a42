"""MoE candidate v2.52 (kernels/moe/candidate_producer_warp.py): MEDIUM_T's GEMM1 fed by a producer warp on per-slot
mbarriers. CPU: the dispatch, the configuration and its guards (160 threads, two mbarriers per slot, three CTAs per SM),
the compile. GPU (marked `gpu`): the output bit for bit kernel.py's at 193-1024 tokens for every routing pattern, call
after call. The end-to-end checks against the reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import assert_bit_for_bit

candidate = solution_module("candidate_producer_warp")
wgmma_gemm1 = solution_module("wgmma_gemm1")

BITWISE_CASES = (
    cases.CheckCase("t193", 193, 224),
    cases.CheckCase("t512", 512, 0),
    cases.CheckCase("t901", 901, 96),
    cases.CheckCase("t901_one_expert", 901, 224, "one_expert"),
    cases.CheckCase("t1000_no_local", 1000, 64, "no_local"),
    cases.CheckCase("t1024_all_local", 1024, 160, "all_local"),
)


def test_only_medium_t_changes():
    for num_tokens in (1, 7, 8, 32, 33, 192, kernel.MEDIUM_T_MAX_TOKENS + 1, 11948):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (193, 901, kernel.MEDIUM_T_MAX_TOKENS):
        chosen = candidate.variant_for(num_tokens)
        assert chosen is candidate.PRODUCER_WARP
        assert dataclasses.replace(chosen, gemm1_producer_warp=False) == kernel.MEDIUM_T
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_configuration_and_its_guards():
    gemm1 = candidate.PRODUCER_WARP.gemm1()
    assert gemm1.producer_warp and gemm1.num_threads == 160 and kernel.MEDIUM_T.gemm1().num_threads == 128
    assert {"stage_full", "stage_empty"} <= set(gemm1.fields()) and gemm1.ctas_per_sm() == 3 and gemm1.smid_walk
    assert "stage_full" not in kernel.MEDIUM_T.gemm1().fields()
    with pytest.raises(wgmma_gemm1.StreamingConfigError, match="producer_warp"):
        wgmma_gemm1.WgmmaGemm1Config(64, 3, scratch_in_stage=True, producer_warp=True)  # a lane per token slot
    with pytest.raises(wgmma_gemm1.StreamingConfigError, match="producer_warp"):
        wgmma_gemm1.WgmmaGemm1Config(32, 3, producer_warp=True)  # the tile's slot is released after the epilogue
    with pytest.raises(ValueError, match="gemm1_producer_warp"):
        kernel.StreamingVariant(block_tokens=16, gemm1_producer_warp=True)  # the `mma.sync` GEMM1 has no such switch
    with pytest.raises(ValueError, match="gemm1_producer_warp"):
        dataclasses.replace(kernel.LARGE_T, block_tokens=32, gemm1_producer_warp=True)  # no routing grid


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    assert_bit_for_bit((kernel.run, candidate.run, candidate.run), case, seed=113)
