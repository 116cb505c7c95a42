"""MoE threshold candidate v2.8 (kernels/moe/candidate_wgmma_from_14.py): kernel.py's FEW_TOKENS from 14 tokens.
CPU: the dispatch. GPU (marked `gpu`): at 14-32 tokens, where it runs FEW_TOKENS in place of TINY_T, the routing
lists, C and O of the call against torch on the dequantised operands (test_moe_streaming.check_each_gemm), and
the output against the reference under the contest rule and the 1e-2 relative L2 bound.
"""

from __future__ import annotations

import pytest

from tests.kernels.test_moe_kernel import _run_case, cases, kernel, needs_cuda, reference, solution_module
from tests.kernels.test_moe_streaming import check_each_gemm

candidate = solution_module("candidate_wgmma_from_14")

CASES = (
    cases.CheckCase("t14", 14, 0),
    cases.CheckCase("t16_all_local", 16, 32, "all_local"),
    cases.CheckCase("t32_one_expert", 32, 96, "one_expert"),
)


def test_only_14_to_32_tokens_change():
    for num_tokens in (1, 7, 13, 33, 80, 192, 901, 14107, kernel.MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (candidate.MIN_TOKENS, 16, kernel.WGMMA_GEMM1_MIN_TOKENS - 1):
        assert kernel.variant_for(num_tokens) is kernel.TINY_T
        assert candidate.variant_for(num_tokens) is kernel.FEW_TOKENS
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)
    assert candidate.compile_only("sm_90a") == kernel.compile_only("sm_90a")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_each_gemm_and_the_output(case):
    check_each_gemm(case, candidate.variant_for)
    inputs, output = _run_case(candidate, case, seed=43)
    stats = cases.compare(output, reference.run(*inputs.values()))
    assert stats.nan_count == 0 and stats.passed, stats
