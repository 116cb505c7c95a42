"""MoE candidate v2.33 (kernels/moe/candidate_route_eight.py): every GEMM1 CTA routes up to 8 tokens itself.
CPU: the dispatch, the configurations (the choice words, three CTAs per SM kept), the guard, the compile. GPU (marked
`gpu`): each expert's packed list holds exactly the tokens that chose it, in token order (the ranks of the unrolled
loops), and the output is kernel.py's bit for bit at 1-8 tokens in every routing pattern, call after call. The
end-to-end checks against the reference (graph capture and replay included) are test_moe_kernel.py's (the module is in
SOLUTIONS).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, reference, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_route_eight")
streaming = solution_module("streaming_gemm")


def test_routes_in_every_cta_up_to_8_tokens_and_changes_nothing_else():
    for num_tokens in (1, 6):
        assert candidate.variant_for(num_tokens) is candidate.TINY_T_EARLY_W2_ROUTE_EIGHT
    for num_tokens in (7, 8):
        assert candidate.variant_for(num_tokens) is candidate.TINY_T_THREE_CTAS_ROUTE_EIGHT
    for num_tokens in (9, 32, 33, 901, 14107):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)
    for ours, theirs in (
        (candidate.TINY_T_EARLY_W2_ROUTE_EIGHT, kernel.TINY_T_EARLY_W2),
        (candidate.TINY_T_THREE_CTAS_ROUTE_EIGHT, kernel.TINY_T_THREE_CTAS),
    ):
        mine, base = ours.gemm1(), theirs.gemm1()
        assert mine.routing_per_cta and mine.routing_tokens_per_warp == 2 and mine.routing_choice_words() == 64
        assert mine.ctas_per_sm() == base.ctas_per_sm()
        assert vars(ours.gemm2()) == vars(theirs.gemm2())
    assert kernel.TINY_T_EARLY_W2.gemm1().routing_choice_words() == 32  # kernel.py's: 4 tokens


def test_two_tokens_per_warp_need_routing_in_every_cta():
    with pytest.raises(streaming.StreamingConfigError, match="routing_tokens_per_warp"):
        streaming.StreamingGemmConfig(gemm1=True, block_tokens=8, num_stages=3, routing_tokens_per_warp=2)
    with pytest.raises(streaming.StreamingConfigError, match="routing_tokens_per_warp"):
        streaming.StreamingGemmConfig(
            gemm1=True, block_tokens=8, num_stages=3, routing_per_cta=True, routing_tokens_per_warp=3
        )


def test_compiles_its_two_configurations_beside_kernel_pys():
    compiled = candidate.compile_only("sm_90a")
    assert compiled[: len(kernel.compile_only("sm_90a"))] == kernel.compile_only("sm_90a")
    assert len(set(map(id, compiled))) == len(kernel.compile_only("sm_90a")) + 2


CASES = [
    cases.CheckCase("route_eight_t1", 1, 0),
    cases.CheckCase("route_eight_t4_all_local", 4, 64, "all_local"),
    cases.CheckCase("route_eight_t5", 5, 32),
    cases.CheckCase("route_eight_t6_one_expert", 6, 96, "one_expert"),
    cases.CheckCase("route_eight_t6_no_local", 6, 160, "no_local"),
    cases.CheckCase("route_eight_t7", 7, 192),
    cases.CheckCase("route_eight_t7_all_local", 7, 0, "all_local"),
    cases.CheckCase("route_eight_t8", 8, 224),
    cases.CheckCase("route_eight_t8_one_expert", 8, 128, "one_expert"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_experts_list_holds_its_tokens_in_token_order(case):
    inputs = cases.make_inputs(case, "cuda", seed=61)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    workspaces = kernel.run_keeping_workspaces(*inputs.values(), output, choose=candidate.variant_for)
    torch.cuda.synchronize()
    experts, _ = reference._route(
        inputs["routing_logits"], inputs["routing_bias"], float(inputs["routed_scaling_factor"])
    )
    local = experts - int(inputs["local_expert_offset"])
    for expert, count in enumerate(workspaces.counts.tolist()):
        expected = torch.nonzero((local == expert).any(dim=1)).flatten()
        assert count == expected.numel(), f"count of expert {expert}"
        assert torch.equal(workspaces.expert_tokens[expert, :count].long(), expected), f"list of expert {expert}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_outputs_are_kernel_py_bit_for_bit_call_after_call(case):
    theirs, *ours = outputs_of((kernel.run, *[candidate.run] * 3), case, seed=67)
    assert torch.isfinite(theirs).all()
    for output in ours:
        assert torch.equal(output, theirs)
