"""MoE candidate v2.38 (kernels/moe/candidate_claimed_early_w2.py): the early-weights GEMM2 of 1-6 tokens claims its
items after the first. CPU: the dispatch, the configuration, the compile. GPU (marked `gpu`): the output bit for bit
kernel.py's at 1-6 tokens in every routing pattern, call after call, with the kept buffer (the routed count, which the
combine zeroes, and the claim counter, which GEMM2 brings back itself) at zero after each call. The end-to-end checks
against the reference (graph capture and replay included) are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_claimed_early_w2")


def test_claims_wherever_gemm2_issues_its_first_weights_before_its_wait():
    for num_tokens in range(1, kernel.EARLY_W2_MAX_TOKENS + 1):
        ours, theirs = candidate.variant_for(num_tokens), kernel.variant_for(num_tokens)
        assert theirs == kernel.TINY_T_EARLY_W2 and not theirs.gemm2().dynamic_items
        assert ours.gemm2().dynamic_items and ours.gemm2().weights_before_wait
        assert {**vars(ours.gemm2()), "dynamic_items": False, "_smem_bytes": None} == {
            **vars(theirs.gemm2()),
            "_smem_bytes": None,
        }
        assert vars(ours.gemm1()) == vars(theirs.gemm1())
    for num_tokens in (7, 8, 32, 33, 901):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_the_claiming_gemm2_still_fits_two_ctas_per_sm():
    assert candidate.TINY_T_EARLY_W2_CLAIMED.gemm2().ctas_per_sm() == 2


def test_compiles_its_configuration_beside_kernel_pys():
    compiled = candidate.compile_only("sm_90a")
    assert compiled[: len(kernel.compile_only("sm_90a"))] == kernel.compile_only("sm_90a")
    assert len(set(map(id, compiled))) == len(kernel.compile_only("sm_90a")) + 1


CASES = [
    cases.CheckCase("claimed_early_w2_t1", 1, 0),
    cases.CheckCase("claimed_early_w2_t1_all_local", 1, 96, "all_local"),
    cases.CheckCase("claimed_early_w2_t2_one_expert", 2, 128, "one_expert"),
    cases.CheckCase("claimed_early_w2_t3_no_local", 3, 160, "no_local"),
    cases.CheckCase("claimed_early_w2_t4", 4, 224),
    cases.CheckCase("claimed_early_w2_t6_all_local", 6, 32, "all_local"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_outputs_are_kernel_py_bit_for_bit_and_the_kept_buffer_ends_at_zero_call_after_call(case):
    routed = solution_module("counters").kept_routed(torch.device("cuda"), kernel.GPU_ARCH)
    theirs, *ours = outputs_of((kernel.run, *[candidate.run] * 3), case, seed=89)
    assert torch.isfinite(theirs).all()
    for output in ours:
        assert torch.equal(output, theirs)
    assert int(routed.abs().sum()) == 0
