"""MoE candidate v2.50 (kernels/moe/candidate_tma_weights.py): MEDIUM_T's GEMM1 fetching its weight stages by TMA. CPU: the
dispatch, the configuration (one mbarrier per slot, three CTAs per SM), the compile. GPU (marked `gpu`): the output bit
for bit kernel.py's at 193-1024 tokens for every routing pattern, call after call (the mbarriers' phases restart with
each launch). The end-to-end checks against the reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import assert_bit_for_bit

candidate = solution_module("candidate_tma_weights")

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
        assert chosen is candidate.TMA_WEIGHTS
        assert dataclasses.replace(chosen, gemm1_tma_weights=False) == kernel.MEDIUM_T
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)
    with pytest.raises(ValueError, match="gemm1_tma_weights"):
        kernel.StreamingVariant(block_tokens=16, gemm1_tma_weights=True)  # the `mma.sync` GEMM1 has no such switch


def test_one_mbarrier_per_slot_and_three_ctas_per_sm():
    gemm1 = candidate.TMA_WEIGHTS.gemm1()
    assert gemm1.tma_weights and "w_full" in gemm1.fields() and "w_full" not in kernel.MEDIUM_T.gemm1().fields()
    assert gemm1.ctas_per_sm() == 3 and gemm1.smid_walk


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    assert_bit_for_bit((kernel.run, candidate.run, candidate.run), case, seed=109)
