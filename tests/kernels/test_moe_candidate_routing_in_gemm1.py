"""MoE candidate v2.16 (kernels/moe/candidate_routing_in_gemm1.py): up to 1024 tokens GEMM1's cooperative grid
routes the tokens (no routing kernel). CPU: the dispatch, the host's chain and the compile. GPU (marked `gpu`):
the routing workspaces and the output equal to kernel.py's, bit for bit, on random logits, on logits built for
ties and in every routing pattern, at T on and off the workload list, and the kept count of routed tokens back at
zero after every call. The end-to-end checks against the reference are test_moe_kernel.py's (the module is in
SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.compile_checks import assert_compiles_and_caches
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module

candidate = solution_module("candidate_routing_in_gemm1")
host = solution_module("host")
counters = solution_module("counters")


def test_routes_in_gemm1_up_to_1024_tokens_only():
    for num_tokens in (1, 32, 33, 192, 193, 901, kernel.MEDIUM_T_MAX_TOKENS):
        chosen = candidate.variant_for(num_tokens)
        assert chosen.routing_in_gemm1
        assert dataclasses.replace(chosen, routing_in_gemm1=False) == kernel.variant_for(num_tokens)
    for num_tokens in (kernel.MEDIUM_T_MAX_TOKENS + 1, 14107, kernel.MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_the_host_has_no_routing_kernel_and_gemm1_leads_the_chain():
    variant = candidate.variant_for(7)
    moe_host = host.MoeHostSm90(variant.make_gemm1(), variant.make_gemm2(), routing_in_gemm1=True)
    assert not hasattr(moe_host, "routing")
    assert not moe_host.gemm1.link.waits and moe_host.gemm1.link.releases
    assert moe_host.gemm2.link.waits and not moe_host.release_counts.link.releases


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(candidate.compile_only, len(candidate.VARIANTS) + 1)


def _tied(inputs: dict, case, seed: int) -> dict:
    """Logits in {-2, ..., 2} and a bias in {0, 0.25, 0.5} (then the case's routing pattern): most biased scores
    equal several others, so the group ranking and the picks are decided by the tie rules."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    logits = inputs["routing_logits"]
    logits.copy_(torch.randint(-2, 3, logits.shape, generator=generator, device="cuda").to(logits.dtype))
    bias = inputs["routing_bias"]
    bias.copy_((torch.randint(0, 3, bias.shape, generator=generator, device="cuda") * 0.25).to(bias.dtype))
    cases.apply_routing_pattern(logits, case.local_expert_offset, case.pattern)
    return inputs


def _assert_same_routing(ours, theirs) -> None:
    assert torch.equal(ours.counts, theirs.counts)
    assert torch.equal(ours.slot_expert, theirs.slot_expert)
    assert torch.equal(ours.slot_weight, theirs.slot_weight)  # bits: the same float arithmetic
    for expert, count in enumerate(ours.counts.tolist()):  # ranks come from atomics: compare the sets
        assert torch.equal(
            ours.expert_tokens[expert, :count].sort().values, theirs.expert_tokens[expert, :count].sort().values
        )
    tokens = torch.arange(ours.slot_expert.shape[0], device="cuda")[:, None].expand_as(ours.slot_expert)
    local = ours.slot_expert >= 0
    assert torch.equal(ours.expert_tokens[ours.slot_expert[local], ours.slot_rank[local]], tokens[local].int())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tied", [False, True], ids=["random", "tied"])
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("in_gemm1_t1", 1, 0),
        cases.CheckCase("in_gemm1_t5", 5, 224),
        cases.CheckCase("in_gemm1_t16_one_expert", 16, 96, "one_expert"),
        cases.CheckCase("in_gemm1_t33", 33, 32),
        cases.CheckCase("in_gemm1_t61_no_local", 61, 32, "no_local"),
        cases.CheckCase("in_gemm1_t192", 192, 160),
        cases.CheckCase("in_gemm1_t193_all_local", 193, 0, "all_local"),
        cases.CheckCase("in_gemm1_t901", 901, 96),
        cases.CheckCase("in_gemm1_t1024_all_local", 1024, 64, "all_local"),
    ],
    ids=lambda c: c.name,
)
def test_routing_and_output_are_kernel_py_bit_for_bit(case, tied):
    inputs = cases.make_inputs(case, "cuda", seed=29)
    if tied:
        inputs = _tied(inputs, case, seed=case.num_tokens)
    results = []
    for choose in (kernel.variant_for, candidate.variant_for, candidate.variant_for):  # the second call too
        output = cases.poisoned_output(case.num_tokens, "cuda")
        workspaces = kernel.run_keeping_workspaces(*inputs.values(), output, choose=choose)
        torch.cuda.synchronize()
        results.append((workspaces, output))
        if choose is candidate.variant_for:
            routed = counters.kept_routed(torch.device("cuda"), kernel.GPU_ARCH)
            assert int(routed.abs().sum()) == 0, "the release kernel leaves the kept count at zero"
    (theirs, their_output), *ours_calls = results
    for ours, our_output in ours_calls:
        _assert_same_routing(ours, theirs)
        assert not torch.isnan(our_output).any()
        assert torch.equal(our_output, their_output)
