"""MoE candidate v2.15 (kernels/moe/candidate_routing_by_lanes.py): the routing warp holds 8 experts per lane.
CPU: the dispatch and the compile. GPU (marked `gpu`): the routing workspaces and the output equal to
kernel.py's, bit for bit, on random logits and on logits built for ties (equal biased scores within and
across groups), at T on and off the workload list. The end-to-end checks against the reference are
test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.compile_checks import assert_compiles_and_caches
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module

candidate = solution_module("candidate_routing_by_lanes")


def test_only_the_routing_changes():
    for num_tokens in (1, 32, 33, 192, 193, 901, 1024, 1025, 14107, kernel.MAX_TOKENS):
        chosen = candidate.variant_for(num_tokens)
        assert chosen.routing_by_lanes
        assert dataclasses.replace(chosen, routing_by_lanes=False) == kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(candidate.compile_only, len(kernel.VARIANTS))


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
    # each local choice's rank points back at its token
    tokens = torch.arange(ours.slot_expert.shape[0], device="cuda")[:, None].expand_as(ours.slot_expert)
    local = ours.slot_expert >= 0
    assert torch.equal(ours.expert_tokens[ours.slot_expert[local], ours.slot_rank[local]], tokens[local].int())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tied", [False, True], ids=["random", "tied"])
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("lanes_t1", 1, 0),
        cases.CheckCase("lanes_t5", 5, 224),
        cases.CheckCase("lanes_t16", 16, 96),
        cases.CheckCase("lanes_t61", 61, 32),
        cases.CheckCase("lanes_t901", 901, 96),
        cases.CheckCase("lanes_t2049_one_expert", 2049, 224, "one_expert"),
        cases.CheckCase("lanes_t3000_all_local", 3000, 0, "all_local"),
    ],
    ids=lambda c: c.name,
)
def test_routing_and_output_are_kernel_py_bit_for_bit(case, tied):
    inputs = cases.make_inputs(case, "cuda", seed=23)
    if tied:
        inputs = _tied(inputs, case, seed=case.num_tokens)
    results = []
    for choose in (kernel.variant_for, candidate.variant_for):
        output = cases.poisoned_output(case.num_tokens, "cuda")
        workspaces = kernel.run_keeping_workspaces(*inputs.values(), output, choose=choose)
        torch.cuda.synchronize()
        results.append((workspaces, output))
    (theirs, their_output), (ours, our_output) = results
    _assert_same_routing(ours, theirs)
    assert not torch.isnan(our_output).any()
    assert torch.equal(our_output, their_output)
