"""MoE candidate v2.31 (kernels/moe/candidate_dispatch_order_walk.py): the paired walk in the H200's dispatch order.
CPU: the dispatch, the configuration, the compile (the walk's bijection and placement: test_moe_streaming.py). GPU
(marked `gpu`): the output bit for bit kernel.py's at 7-8 tokens in every routing pattern, call after call. The
end-to-end checks against the reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_dispatch_order_walk")
streaming = solution_module("streaming_gemm")


def test_only_the_three_cta_variant_changes_its_walk():
    for num_tokens in (1, 6, 9, 32, 33, 901, 14107):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (7, 8):
        assert candidate.variant_for(num_tokens) is candidate.TINY_T_DISPATCH_ORDER
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)
    ours, theirs = candidate.TINY_T_DISPATCH_ORDER.gemm1(), kernel.TINY_T_THREE_CTAS.gemm1()
    assert ours.front_sms == 8 and theirs.front_sms == 0
    assert {**vars(ours), "front_sms": 0} == vars(theirs)
    with pytest.raises(streaming.StreamingConfigError, match="front_sms"):
        streaming.StreamingGemmConfig(gemm1=True, block_tokens=8, num_stages=3, front_sms=8)
    with pytest.raises(ValueError, match="gemm1_front_sms"):
        kernel.StreamingVariant(block_tokens=32, wgmma_gemm1=True, gemm1_front_sms=8)


def test_compiles_its_configuration_beside_kernel_pys():
    compiled = candidate.compile_only("sm_90a")
    assert compiled[: len(kernel.VARIANTS) + 1] == kernel.compile_only("sm_90a")
    assert len(set(map(id, compiled))) == len(kernel.VARIANTS) + 2


CASES = [
    cases.CheckCase("dispatch_t7", 7, 192),
    cases.CheckCase("dispatch_t7_all_local", 7, 0, "all_local"),
    cases.CheckCase("dispatch_t7_no_local", 7, 96, "no_local"),
    cases.CheckCase("dispatch_t8_one_expert", 8, 128, "one_expert"),
    cases.CheckCase("dispatch_t8_all_local", 8, 32, "all_local"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_outputs_are_kernel_py_bit_for_bit_call_after_call(case):
    theirs, *ours = outputs_of((kernel.run, *[candidate.run] * 3), case, seed=53)
    assert torch.isfinite(theirs).all()
    for output in ours:
        assert torch.equal(output, theirs)
