"""MoE candidate v2.46 (kernels/moe/candidate_large_t_scales_first.py): LARGE_T's GEMM1 reading a block's scales
between its MMAs' commit and their wait. CPU: the dispatch, the configuration and the compile. GPU (marked `gpu`): the
output bit for bit kernel.py's above MEDIUM_T_MAX_TOKENS for every routing pattern, and below it (the same kernels).
The end-to-end checks against the reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import assert_bit_for_bit

candidate = solution_module("candidate_large_t_scales_first")

BITWISE_CASES = (
    cases.CheckCase("t901", 901, 96),
    cases.CheckCase("t1025", 1025, 0),
    cases.CheckCase("t2100_all_local", 2100, 160, "all_local"),
    cases.CheckCase("t3000_one_expert", 3000, 64, "one_expert"),
    cases.CheckCase("t5000_no_local", 5000, 224, "no_local"),
    cases.CheckCase("t11948", 11948, 32),
)


def test_only_large_t_changes():
    for num_tokens in (1, 7, 8, 32, 33, 192, 193, 901, kernel.MEDIUM_T_MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (kernel.MEDIUM_T_MAX_TOKENS + 1, 11948, 14107, kernel.MAX_TOKENS):
        chosen = candidate.variant_for(num_tokens)
        assert chosen.gemm1().scales_before_wait
        assert dataclasses.replace(chosen, gemm1_scales_before_wait=False) == kernel.LARGE_T
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)
    with pytest.raises(ValueError, match="gemm1_scales_before_wait"):
        kernel.StreamingVariant(block_tokens=16, gemm1_scales_before_wait=True)  # the `mma.sync` GEMM1 has no such switch


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    assert_bit_for_bit((kernel.run, candidate.run, candidate.run), case, seed=97)
