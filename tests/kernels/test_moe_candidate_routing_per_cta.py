"""MoE candidate v2.26 (kernels/moe/candidate_routing_per_cta.py): up to 4 tokens every GEMM1 CTA routes the tokens
itself instead of meeting the others on CTA 0's routing.

CPU: the dispatch, the guards, the compile. GPU (marked `gpu`): at 1-6 tokens in every routing pattern the output
bit for bit kernel.py's, three calls in a row with the kept counters back at zero after each; the packed lists in
token order and consistent with the slots; each GEMM against torch (`check_each_gemm`). The end-to-end checks
against the reference and graph replay are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.compile_checks import assert_compiles_and_caches
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import check_each_gemm

candidate = solution_module("candidate_routing_per_cta")
counters = solution_module("counters")
routing = solution_module("routing")


def test_the_routing_in_every_cta_on_the_early_w2_variant_only():
    for num_tokens in range(1, kernel.EARLY_W2_MAX_TOKENS + 1):
        chosen = candidate.variant_for(num_tokens)
        assert chosen.routing_per_cta and chosen.gemm1().routing_per_cta
        assert dataclasses.replace(chosen, routing_per_cta=False) == kernel.variant_for(num_tokens)
    for num_tokens in (kernel.EARLY_W2_MAX_TOKENS + 1, 33, 901, 14107):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    assert not any(variant.routing_per_cta for variant in kernel.VARIANTS)
    # Its branch is taken up to one token per warp of GEMM1's CTA.
    assert routing.ROUTING_WARPS == 4 < kernel.EARLY_W2_MAX_TOKENS


def test_the_routing_in_every_cta_needs_a_routing_mma_sync_gemm1():
    streaming = solution_module("streaming_gemm")
    with pytest.raises(ValueError, match="routing_per_cta"):
        dataclasses.replace(kernel.TINY_T, routing_in_gemm1=False, routing_per_cta=True)
    with pytest.raises(ValueError, match="routing_per_cta"):
        dataclasses.replace(kernel.FEW_TOKENS, routing_per_cta=True)
    with pytest.raises(streaming.StreamingConfigError, match="routing_per_cta"):
        streaming.StreamingGemmConfig(gemm1=False, block_tokens=8, num_stages=4, routing_per_cta=True)


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(candidate.compile_only, len(kernel.VARIANTS) + 1)


PER_CTA_CASES = [
    cases.CheckCase("per_cta_t1", 1, 0),
    cases.CheckCase("per_cta_t1_all_local", 1, 64, "all_local"),
    cases.CheckCase("per_cta_t2_one_expert", 2, 96, "one_expert"),
    cases.CheckCase("per_cta_t3_all_local", 3, 32, "all_local"),
    cases.CheckCase("per_cta_t4", 4, 224),
    cases.CheckCase("per_cta_t4_no_local", 4, 160, "no_local"),
    cases.CheckCase("per_cta_t5_all_local", 5, 128, "all_local"),
    cases.CheckCase("per_cta_t6", 6, 192),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", PER_CTA_CASES, ids=lambda c: c.name)
def test_output_is_kernel_py_bit_for_bit(case):
    inputs = cases.make_inputs(case, "cuda", seed=47)
    device = torch.device("cuda")
    outputs = []
    for run in (kernel.run, candidate.run, candidate.run, candidate.run):
        output = cases.poisoned_output(case.num_tokens, "cuda")
        run(*inputs.values(), output)
        torch.cuda.synchronize()
        assert int(counters.kept_counts(device, kernel.GPU_ARCH).abs().sum()) == 0, "kept counters left at zero"
        assert int(counters.kept_routed(device, kernel.GPU_ARCH).abs().sum()) == 0, "kept routed count left at zero"
        outputs.append(output)
    theirs, *ours = outputs
    for output in ours:
        assert not torch.isnan(output).any()
        assert torch.equal(output.view(torch.int16), theirs.view(torch.int16))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", PER_CTA_CASES[:6], ids=lambda c: c.name)
def test_lists_in_token_order_and_each_gemm(case):
    inputs = cases.make_inputs(case, "cuda", seed=48)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    workspaces = kernel.run_keeping_workspaces(*inputs.values(), output, choose=candidate.variant_for)
    torch.cuda.synchronize()
    counts = workspaces.counts.tolist()
    assert sum(counts) == int((workspaces.slot_expert >= 0).sum())
    for expert, count in enumerate(counts):
        tokens = workspaces.expert_tokens[expert, :count].tolist()
        assert tokens == sorted(tokens), f"expert {expert}: ranks in token order"
    for token in range(case.num_tokens):
        for slot in range(8):
            expert = int(workspaces.slot_expert[token, slot])
            if expert >= 0:
                assert int(workspaces.expert_tokens[expert, int(workspaces.slot_rank[token, slot])]) == token
    check_each_gemm(case, candidate.variant_for)
