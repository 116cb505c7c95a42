"""MoE candidate v2.58 (kernels/moe/candidate_fused_early_w2.py): the fused GEMMs with a CTA's first GEMM2 weights
before its readiness check, from 1 token on (every CTA routing up to 4 tokens, the readiness words kept and zeroed by
the combine). CPU: the dispatch, the guard, the compile. GPU (marked `gpu`): the output bit for bit kernel.py's at
1-32 tokens in every routing pattern, call after call, with the kept readiness words back at zero after each call, and
a CUDA-graph replay against the reference. The end-to-end checks are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hopperbench.devcheck import replay_on_fresh_inputs
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, reference, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_fused_early_w2")
counters = solution_module("counters")
fused_gemms = solution_module("fused_gemms")


def test_fused_with_early_weights_below_33_tokens():
    for num_tokens in range(1, 5):
        assert candidate.variant_for(num_tokens) is candidate.FUSED_ROUTING_PER_CTA
    for num_tokens in (5, 7, 16, 32):
        assert candidate.variant_for(num_tokens) is candidate.FUSED_EARLY_W2
    for num_tokens in (33, 192, 901, 11948):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    assert candidate.FUSED_ROUTING_PER_CTA.gemm1().routing_per_cta
    with pytest.raises(ValueError, match="fused_weights_before_ready"):
        dataclasses.replace(kernel.TINY_T, fused_weights_before_ready=True)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 3


BITWISE_CASES = (
    cases.CheckCase("t1_all_local", 1, 0, "all_local"),  # a random token has no local expert about a third of draws
    cases.CheckCase("t1_one_expert", 1, 64, "one_expert"),
    cases.CheckCase("t1_no_local", 1, 96, "no_local"),
    cases.CheckCase("t2_one_expert", 2, 224, "one_expert"),
    cases.CheckCase("t4_all_local", 4, 160, "all_local"),
    cases.CheckCase("t5_one_expert", 5, 32, "one_expert"),
    cases.CheckCase("t7", 7, 192),
    cases.CheckCase("t16", 16, 32),
    cases.CheckCase("t32_all_local", 32, 0, "all_local"),
)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit_and_the_kept_words_end_at_zero(case):
    theirs, *ours = outputs_of((kernel.run, candidate.run, candidate.run, candidate.run), case, seed=163)
    assert torch.isfinite(theirs).all()
    if case.pattern != "no_local":
        assert bool((theirs != 0).any())
    for output in ours:
        assert torch.equal(output, theirs)
    ready = counters.kept_ready(torch.device("cuda"), kernel.GPU_ARCH, fused_gemms.READY_WORDS)
    routed = counters.kept_routed(torch.device("cuda"), kernel.GPU_ARCH)
    assert int(ready.abs().sum()) == 0 and int(routed.abs().sum()) == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_cuda_graph_replay_follows_new_inputs(num_tokens):
    case = cases.CheckCase("graph", num_tokens, 192)
    static = cases.make_inputs(case, "cuda", seed=1)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    fresh = cases.make_inputs(case, "cuda", seed=2)
    replay_on_fresh_inputs(lambda: candidate.run(*static.values(), output), static, fresh, (output,))
    stats = cases.compare(output, reference.run(*fresh.values()))
    assert stats.passed, stats
