"""MoE candidate v2.48 (kernels/moe/candidate_narrow_stages.py): MEDIUM_T's GEMM1 in six 128-wide stages instead of three
256-wide ones. CPU: the dispatch, the configuration (the same shared memory, three CTAs per SM, GEMM2 unchanged), the
compile. GPU (marked `gpu`): the output bit for bit kernel.py's at 193-1024 tokens for every routing pattern. The
layouts and copy maps of a 128-wide stage are test_moe_wgmma_gemm1.py's; the end-to-end checks against the reference
are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import assert_bit_for_bit

candidate = solution_module("candidate_narrow_stages")

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
        assert chosen is candidate.NARROW_STAGES
        assert dataclasses.replace(chosen, num_stages=3, gemm1_stage_k=None) == kernel.MEDIUM_T
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)
    with pytest.raises(ValueError, match="gemm1_stage_k"):
        kernel.StreamingVariant(block_tokens=16, gemm1_stage_k=128)  # the `mma.sync` GEMM1 has no such switch


def test_same_shared_memory_and_three_ctas_per_sm():
    gemm1, medium_t = candidate.NARROW_STAGES.gemm1(), kernel.MEDIUM_T.gemm1()
    assert (gemm1.stage_k, gemm1.num_stages, gemm1.k_stages) == (128, 6, 56)
    assert gemm1.smem_bytes() == medium_t.smem_bytes() and gemm1.ctas_per_sm() == 3 and gemm1.smid_walk
    assert gemm1.scratch_in_stage and gemm1.block_tokens == medium_t.block_tokens == 32
    assert candidate.NARROW_STAGES.gemm2().num_stages == kernel.MEDIUM_T.gemm2().num_stages == 2


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    assert_bit_for_bit((kernel.run, candidate.run, candidate.run), case, seed=103)
