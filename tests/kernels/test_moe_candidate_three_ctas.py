"""MoE candidate v2.28 (kernels/moe/candidate_three_ctas.py): GEMM1 at three CTAs per SM up to 8 tokens.
CPU: the dispatch, the configurations (three GEMM1 CTAs fit an SM; kernel.py's keep two), the compile. GPU (marked
`gpu`): the output bit for bit kernel.py's at 1-8 tokens in every routing pattern, call after call (the kept counters
back at zero each time). The end-to-end checks against the reference are test_moe_kernel.py's (the module is in
SOLUTIONS).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_three_ctas")
streaming = solution_module("streaming_gemm")


def test_only_up_to_8_tokens_change():
    for num_tokens in (9, 16, 32, 33, 901, 14107, kernel.MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in range(1, candidate.MAX_TOKENS_THREE_CTAS + 1):
        early = num_tokens <= kernel.EARLY_W2_MAX_TOKENS
        assert kernel.variant_for(num_tokens) is (kernel.TINY_T_EARLY_W2 if early else kernel.TINY_T)
        assert candidate.variant_for(num_tokens) is (candidate.TINY_T_EARLY_W2 if early else candidate.TINY_T)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


@pytest.mark.parametrize("name", ["TINY_T_EARLY_W2", "TINY_T"])
def test_gemm1_fits_three_ctas_per_sm_and_only_gemm1_changes(name):
    ours, theirs = getattr(candidate, name), getattr(kernel, name)
    gemm1 = ours.gemm1()
    assert (gemm1.block_tokens, gemm1.num_stages, gemm1.ctas_per_sm()) == (8, 3, 3)
    assert 3 * (gemm1.smem_bytes() + streaming.SMEM_RESERVED_PER_CTA) <= streaming.SMEM_PER_SM
    assert kernel.persistent_ctas(gemm1, 132) == 396
    assert gemm1.routing_per_cta == theirs.gemm1().routing_per_cta
    assert vars(ours.gemm2()) == vars(theirs.gemm2())
    # kernel.py's own GEMM1 keeps two CTAs per SM (its 16-token tiles of 4 stages do not fit three).
    assert theirs.gemm1().ctas_per_sm() == 2


def test_three_ctas_are_the_mma_sync_gemm1s_only():
    with pytest.raises(ValueError, match="gemm1_ctas_per_sm"):
        kernel.StreamingVariant(block_tokens=32, wgmma_gemm1=True, gemm1_ctas_per_sm=3)
    with pytest.raises(streaming.StreamingConfigError, match="max_ctas_per_sm"):
        streaming.StreamingGemmConfig(gemm1=True, block_tokens=8, num_stages=3, max_ctas_per_sm=4)
    # Shared memory still binds: 16-token tiles of 4 stages fit two CTAs, whatever the cap.
    assert streaming.StreamingGemmConfig(gemm1=True, block_tokens=16, num_stages=4, max_ctas_per_sm=3).ctas_per_sm() == 2


def test_compiles_its_two_configurations_beside_kernel_pys():
    compiled = candidate.compile_only("sm_90a")
    assert compiled[: len(kernel.VARIANTS) + 1] == kernel.compile_only("sm_90a")
    assert len(set(map(id, compiled))) == len(kernel.VARIANTS) + 3


CASES = [
    cases.CheckCase("three_ctas_t1", 1, 32),
    cases.CheckCase("three_ctas_t1_one_expert", 1, 64, "one_expert"),
    cases.CheckCase("three_ctas_t2_all_local", 2, 160, "all_local"),
    cases.CheckCase("three_ctas_t4", 4, 0),
    cases.CheckCase("three_ctas_t5_all_local", 5, 224, "all_local"),
    cases.CheckCase("three_ctas_t6_no_local", 6, 96, "no_local"),
    cases.CheckCase("three_ctas_t7", 7, 192),
    cases.CheckCase("three_ctas_t7_all_local", 7, 0, "all_local"),
    cases.CheckCase("three_ctas_t8_one_expert", 8, 128, "one_expert"),
    cases.CheckCase("three_ctas_t8_all_local", 8, 32, "all_local"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_outputs_are_kernel_py_bit_for_bit_call_after_call(case):
    # An 8-token tile regroups no token's products, and three calls in a row find the kept counters zeroed.
    outputs = outputs_of((kernel.run, *[candidate.run] * 3), case, seed=41)
    theirs, *ours = outputs
    assert torch.isfinite(theirs).all()
    for output in ours:
        assert torch.equal(output, theirs)
