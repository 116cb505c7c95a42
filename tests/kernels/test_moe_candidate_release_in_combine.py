"""MoE candidate v2.22 (kernels/moe/candidate_release_in_combine.py): candidate v2.21 without the release kernel; GEMM1
copies the call's counts out, the combine reads them there and zeroes the kept counters.

CPU: the dispatch, the chain (the combine is the last kernel and releases nothing) and the compile. GPU (marked `gpu`):
the output bit for bit kernel.py's at 1-2049 tokens in every routing pattern (each variant, both routings), three calls
in a row with the kept counters and the kept count of routed tokens back at zero after each and each call's counts
copied out. The end-to-end checks against the reference and graph replay are test_moe_kernel.py's (the module is in
SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.compile_checks import assert_compiles_and_caches
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, reference, solution_module

candidate = solution_module("candidate_release_in_combine")
early = solution_module("candidate_early_w2")
counters = solution_module("counters")
host = solution_module("host")


def test_every_variant_is_candidate_v2_21s_with_the_release_in_the_combine():
    for num_tokens in (1, 6, 7, 32, 33, 192, 193, 1024, 1025, 14107):
        chosen = candidate.variant_for(num_tokens)
        assert chosen.release_in_combine
        assert dataclasses.replace(chosen, release_in_combine=False) == early.variant_for(num_tokens)


@pytest.mark.parametrize("routing_in_gemm1", [True, False])
def test_the_combine_ends_the_chain_and_no_release_kernel_is_launched(routing_in_gemm1):
    variant = kernel.TINY_T if routing_in_gemm1 else kernel.LARGE_T
    moe_host = host.MoeHostSm90(
        variant.make_gemm1(), variant.make_gemm2(), routing_in_gemm1=routing_in_gemm1, release_in_combine=True
    )
    assert not hasattr(moe_host, "release_counts")
    assert hasattr(moe_host, "routing") != routing_in_gemm1
    assert (moe_host.gemm1.link.waits, moe_host.gemm1.link.releases) == (not routing_in_gemm1, True)
    assert (moe_host.gemm2.link.waits, moe_host.gemm2.link.releases) == (True, True)
    assert (moe_host.combine.link.waits, moe_host.combine.link.releases) == (True, False)  # last: releases nothing


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(candidate.compile_only, len(kernel.VARIANTS) + 2)


RELEASE_CASES = [
    cases.CheckCase("release_t1", 1, 0),
    cases.CheckCase("release_t3_all_local", 3, 32, "all_local"),
    cases.CheckCase("release_t7", 7, 224),
    cases.CheckCase("release_t16_one_expert", 16, 96, "one_expert"),
    cases.CheckCase("release_t5_no_local", 5, 160, "no_local"),
    cases.CheckCase("release_t61", 61, 64),
    cases.CheckCase("release_t901", 901, 128),
    cases.CheckCase("release_t1025_all_local", 1025, 0, "all_local"),
    cases.CheckCase("release_t2049_one_expert", 2049, 192, "one_expert"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", RELEASE_CASES, ids=lambda c: c.name)
def test_output_is_kernel_py_bit_for_bit_and_the_counters_come_back_to_zero(case):
    inputs = cases.make_inputs(case, "cuda", seed=44)
    theirs = cases.poisoned_output(case.num_tokens, "cuda")
    their_workspaces = kernel.run_keeping_workspaces(*inputs.values(), theirs)
    experts, _ = reference._route(inputs["routing_logits"], inputs["routing_bias"], float(inputs["routed_scaling_factor"]))
    local = experts - int(inputs["local_expert_offset"])
    expected_counts = [int((local == e).any(dim=1).sum()) for e in range(32)]
    for _ in range(3):  # each call must start from the zeros the one before left
        ours = cases.poisoned_output(case.num_tokens, "cuda")
        workspaces = kernel.run_keeping_workspaces(*inputs.values(), ours, choose=candidate.variant_for)
        torch.cuda.synchronize()
        for purpose in (counters.kept_counts, counters.kept_routed):
            assert int(purpose(torch.device("cuda"), kernel.GPU_ARCH).abs().sum()) == 0
        assert workspaces.counts.tolist() == their_workspaces.counts.tolist() == expected_counts
        assert not torch.isnan(ours).any()
        assert torch.equal(ours, theirs)
