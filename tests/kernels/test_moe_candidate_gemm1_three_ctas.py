"""MoE candidate v2.41 (kernels/moe/candidate_gemm1_three_ctas.py): MEDIUM_T's GEMM1 in 3 stages at three CTAs per
SM, its epilogue tile in a stage. CPU: the dispatch, the configuration (three CTAs' shared memory, the cooperative
grid) and the compile. GPU (marked `gpu`): the output bit for bit kernel.py's at 193-1024 tokens for every routing
pattern. The end-to-end checks against the reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import pytest

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import assert_bit_for_bit

candidate = solution_module("candidate_gemm1_three_ctas")

BITWISE_CASES = (
    cases.CheckCase("t193", 193, 224),
    cases.CheckCase("t500_one_expert", 500, 32, "one_expert"),
    cases.CheckCase("t901", 901, 96),
    cases.CheckCase("t1000_no_local", 1000, 64, "no_local"),
    cases.CheckCase("t1024_all_local", 1024, 160, "all_local"),
)


def test_only_medium_t_changes():
    for num_tokens in (193, 901, kernel.MEDIUM_T_MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is candidate.MEDIUM_T_GEMM1_THREE_CTAS
    for num_tokens in (1, 7, 32, 33, 192, kernel.MEDIUM_T_MAX_TOKENS + 1, kernel.MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_gemm1_takes_three_ctas_per_sm_and_gemm2_is_kernel_pys():
    variant = candidate.MEDIUM_T_GEMM1_THREE_CTAS
    gemm1 = variant.gemm1()
    assert (gemm1.block_tokens, gemm1.num_stages, gemm1.scratch_in_stage, gemm1.ctas_per_sm()) == (32, 3, True, 3)
    assert kernel.persistent_ctas(gemm1, 132) == 396 and variant.routing_in_gemm1  # cooperative: all resident
    assert vars(variant.gemm2()) == vars(kernel.MEDIUM_T.gemm2())


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    assert_bit_for_bit((kernel.run, candidate.run, candidate.run), case, seed=61)
