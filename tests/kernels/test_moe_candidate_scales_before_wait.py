"""MoE candidate v2.45 (kernels/moe/candidate_scales_before_wait.py): every WGMMA GEMM1 reading a block's scales
between its MMAs' commit and their wait. CPU: the dispatch, the configuration and the compile. GPU (marked `gpu`): the
output bit for bit kernel.py's at 33-11948 tokens for every routing pattern. The end-to-end checks against the
reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import assert_bit_for_bit

candidate = solution_module("candidate_scales_before_wait")

BITWISE_CASES = (
    cases.CheckCase("t33", 33, 0),
    cases.CheckCase("t80_one_expert", 80, 96, "one_expert"),
    cases.CheckCase("t193", 193, 224),
    cases.CheckCase("t901", 901, 96),
    cases.CheckCase("t1000_no_local", 1000, 64, "no_local"),
    cases.CheckCase("t2100_all_local", 2100, 160, "all_local"),
    cases.CheckCase("t11948", 11948, 32),
)


def test_only_the_wgmma_gemm1_changes():
    for num_tokens in (1, 7, 8, 32):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (33, 192, 193, 901, kernel.MEDIUM_T_MAX_TOKENS, 14107, kernel.MAX_TOKENS):
        chosen = candidate.variant_for(num_tokens)
        assert chosen.gemm1().scales_before_wait
        assert dataclasses.replace(chosen, gemm1_scales_before_wait=False) == kernel.variant_for(num_tokens)
    assert len(candidate.SCALES_BEFORE_WAIT) == 3
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)
    with pytest.raises(ValueError, match="gemm1_scales_before_wait"):
        kernel.StreamingVariant(block_tokens=16, gemm1_scales_before_wait=True)  # the `mma.sync` GEMM1 has no such switch


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    assert_bit_for_bit((kernel.run, candidate.run, candidate.run), case, seed=89)
