"""MoE candidate v2.21 (kernels/moe/candidate_early_w2.py): up to EARLY_W2_MAX_TOKENS tokens GEMM2 reads its schedule
once the kept count of routed tokens is complete and issues its first stages' weights before its programmatic wait.

CPU: the dispatch, the configuration guards and the compile. GPU (marked `gpu`): the early variant itself (forced, at
1-32 tokens, beyond the dispatch's range) with each GEMM against torch on its packed rows, and its output bit for bit
kernel.py's in every routing pattern, three calls in a row with the kept count of routed tokens back at zero after each
(GEMM2 polls it before its wait). The end-to-end checks against the reference are test_moe_kernel.py's (the module is
in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.compile_checks import assert_compiles_and_caches
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import check_each_gemm

candidate = solution_module("candidate_early_w2")
streaming = solution_module("streaming_gemm")
counters = solution_module("counters")


def test_early_weights_up_to_the_threshold_only():
    for num_tokens in range(1, candidate.EARLY_W2_MAX_TOKENS + 1):
        chosen = candidate.variant_for(num_tokens)
        assert chosen is candidate.TINY_T_EARLY_W2 and chosen.gemm2().weights_before_wait
        assert not chosen.gemm1().weights_before_wait
        assert dataclasses.replace(chosen, gemm2_weights_before_wait=False) == kernel.variant_for(num_tokens)
    for num_tokens in (candidate.EARLY_W2_MAX_TOKENS + 1, 16, 32, 33, 192, 901, 14107):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_early_weights_are_refused_where_nothing_completes_the_routed_count():
    with pytest.raises(ValueError, match="routing_in_gemm1"):
        dataclasses.replace(kernel.TINY_T, routing_in_gemm1=False, gemm2_weights_before_wait=True)
    with pytest.raises(ValueError, match="mma.sync"):
        dataclasses.replace(kernel.FEW_TOKENS, gemm2_weights_before_wait=True)
    with pytest.raises(streaming.StreamingConfigError, match="GEMM2"):
        streaming.StreamingGemmConfig(True, 16, 4, weights_before_wait=True)


def always_early(num_tokens: int):
    """The early variant at any T below 33 (the GPU tests exercise it beyond the dispatch's range)."""
    assert num_tokens < kernel.WGMMA_GEMM1_MIN_TOKENS
    return candidate.TINY_T_EARLY_W2


run_always_early = kernel.make_run(always_early)


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(candidate.compile_only, len(kernel.VARIANTS) + 2)


EARLY_CASES = [
    cases.CheckCase("early_t1", 1, 0),
    cases.CheckCase("early_t1_one_expert", 1, 64, "one_expert"),
    cases.CheckCase("early_t7", 7, 224),
    cases.CheckCase("early_t13_all_local", 13, 32, "all_local"),
    cases.CheckCase("early_t16_one_expert", 16, 96, "one_expert"),
    cases.CheckCase("early_t32", 32, 128),
    cases.CheckCase("early_t32_all_local", 32, 0, "all_local"),
    cases.CheckCase("early_t5_no_local", 5, 160, "no_local"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", [c for c in EARLY_CASES if c.pattern != "no_local"], ids=lambda c: c.name)
def test_each_gemm_matches_torch_on_its_packed_rows(case):
    check_each_gemm(case, always_early)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", EARLY_CASES, ids=lambda c: c.name)
def test_output_is_kernel_py_bit_for_bit_call_after_call(case):
    inputs = cases.make_inputs(case, "cuda", seed=43)
    outputs = []
    for run in (kernel.run, run_always_early, candidate.run, run_always_early):
        output = cases.poisoned_output(case.num_tokens, "cuda")
        run(*inputs.values(), output)
        torch.cuda.synchronize()
        routed = counters.kept_routed(torch.device("cuda"), kernel.GPU_ARCH)
        assert int(routed.abs().sum()) == 0, "the release kernel leaves the kept count at zero"
        outputs.append(output)
    theirs, *ours = outputs
    for output in ours:
        assert not torch.isnan(output).any()
        assert torch.equal(output, theirs)
