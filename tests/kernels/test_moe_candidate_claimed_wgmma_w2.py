"""MoE candidate v2.44 (kernels/moe/candidate_claimed_wgmma_w2.py): MEDIUM_T's WGMMA GEMM2 claiming its items after the
first from the kept counter (v2.34's protocol). CPU: the dispatch, the configuration and the compile. GPU (marked
`gpu`): the output bit for bit kernel.py's at 193-1024 tokens for every routing pattern, call after call, with the kept
routed-count buffer (routed count and claim counter) at zero after each call. The end-to-end checks against the
reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_claimed_wgmma_w2")

BITWISE_CASES = (
    cases.CheckCase("t193", 193, 224),
    cases.CheckCase("t500_one_expert", 500, 32, "one_expert"),
    cases.CheckCase("t901", 901, 96),
    cases.CheckCase("t1000_no_local", 1000, 64, "no_local"),
    cases.CheckCase("t1024_all_local", 1024, 160, "all_local"),
)


def test_only_medium_t_changes():
    for num_tokens in (193, 901, kernel.MEDIUM_T_MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is candidate.MEDIUM_T_CLAIMED_W2
    for num_tokens in (1, 7, 32, 33, 192, kernel.MEDIUM_T_MAX_TOKENS + 1, kernel.MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_only_gemm2_claims_and_it_keeps_three_ctas_per_sm():
    variant = candidate.MEDIUM_T_CLAIMED_W2
    gemm2 = variant.gemm2()
    assert gemm2.dynamic_items and gemm2.f16_c and gemm2.ctas_per_sm() == 3 and variant.routing_in_gemm1
    assert dataclasses.replace(variant, gemm2_dynamic_items=False) == kernel.MEDIUM_T
    assert vars(variant.gemm1()) == vars(kernel.MEDIUM_T.gemm1())


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_claimed_items_are_kernel_pys_bit_for_bit_and_the_claims_end_at_zero(case):
    # Which CTA computes an item changes no output bit, and each call leaves the kept buffer (the routed count, which
    # the combine zeroes, and the claim counter, which GEMM2 brings back itself) at zero.
    routed = solution_module("counters").kept_routed(torch.device("cuda"), kernel.GPU_ARCH)
    theirs, *ours = outputs_of((kernel.run, *[candidate.run] * 3), case, seed=83)
    assert torch.isfinite(theirs).all()
    if case.pattern != "no_local":
        assert bool((theirs != 0).any())
    for output in ours:
        assert torch.equal(output, theirs)
    assert int(routed.abs().sum()) == 0
