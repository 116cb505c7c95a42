"""MoE candidate v2.4 (kernels/moe/candidate_wgmma_below_33.py): kernel.py's FEW_TOKENS variant below 33 tokens
too. CPU: the dispatch. GPU (marked `gpu`): test_moe_streaming.py's per-GEMM check at 1-32 tokens (one expert,
all local, an offset); the end-to-end checks are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import pytest

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import check_each_gemm

candidate = solution_module("candidate_wgmma_below_33")


def test_only_1_to_32_tokens_change():
    for num_tokens in (33, 192, 193, 2049, kernel.MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (1, 7, 16, kernel.WGMMA_GEMM1_MIN_TOKENS - 1):
        assert kernel.variant_for(num_tokens) is kernel.TINY_T
        assert candidate.variant_for(num_tokens) is kernel.FEW_TOKENS
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)
    assert candidate.compile_only("sm_90a") == kernel.compile_only("sm_90a")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("below33_t1", 1, 96),
        cases.CheckCase("below33_t7_one_expert", 7, 0, "one_expert"),
        cases.CheckCase("below33_t16_all_local", 16, 224, "all_local"),
        cases.CheckCase("below33_t32", 32, 32),
    ],
    ids=lambda c: c.name,
)
def test_each_gemm_matches_torch(case):
    check_each_gemm(case, candidate.variant_for)
