"""MoE candidate v1.7 (kernels/moe/candidate_routing_loads_first.py): the routing kernel's loads issued
before its first sigmoid. CPU: the dispatch and the compile. GPU (marked `gpu`): the routing lists,
slots, weights and the output are kernel.py's bit for bit (the same fp32 operations on the same
values). The end-to-end checks are test_moe_kernel.py's (the candidate is in its SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module

candidate = solution_module("candidate_routing_loads_first")


def test_every_streaming_variant_changes_only_its_routing():
    for num_tokens in (1, 32, 33, 64, 65, 192, 193, 901, 2048):
        chosen = candidate.variant_for(num_tokens)
        assert chosen.routing_loads_first
        assert dataclasses.replace(chosen, routing_loads_first=False) == kernel.variant_for(num_tokens)
    assert candidate.variant_for(2049) is None
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_compiles_for_sm90a_without_gpu():
    compiled = candidate.compile_only("sm_90a")
    assert len({id(fn) for fn in compiled}) == len(compiled) == len(candidate.VARIANTS) + len(kernel.compile_only("sm_90a"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("num_tokens", "offset"), [(1, 32), (7, 192), (58, 96), (901, 224), (2048, 0)])
def test_routing_and_output_are_kernel_py_bit_for_bit(num_tokens, offset):
    inputs = cases.make_inputs(cases.CheckCase("loads_first", num_tokens, offset), "cuda", seed=17)
    results = []
    for choose in (kernel.variant_for, candidate.variant_for):
        output = cases.poisoned_output(num_tokens, "cuda")
        workspaces = kernel.run_keeping_workspaces(*inputs.values(), output, choose=choose)
        torch.cuda.synchronize()
        assert torch.isfinite(output).all()
        results.append((output, workspaces))
    (ours, ours_ws), (theirs, theirs_ws) = results
    assert torch.equal(ours_ws.counts, theirs_ws.counts)
    assert torch.equal(ours_ws.slot_expert, theirs_ws.slot_expert)
    assert torch.equal(ours_ws.slot_weight, theirs_ws.slot_weight)
    # Ranks come from atomics, so the lists may be permuted within an expert; their sets are equal.
    for expert, count in enumerate(ours_ws.counts.tolist()):
        assert torch.equal(
            ours_ws.expert_tokens[expert, :count].sort().values, theirs_ws.expert_tokens[expert, :count].sort().values
        )
    assert torch.equal(ours, theirs)
