"""MoE candidate v2.27 (kernels/moe/candidate_combine_in_gemm2.py): below 33 tokens GEMM2 combines the output itself
(the last item of each 32-column block sums it) and no combine kernel runs.

CPU: the dispatch, the guards, the compile, the host's two launches. GPU (marked `gpu`): at 1-32 tokens in every
routing pattern the output bit for bit kernel.py's (signed zeros included), four calls in a row with every kept
buffer back at zero after each. The end-to-end checks against the reference and graph replay are
test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.compile_checks import assert_compiles_and_caches
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module

candidate = solution_module("candidate_combine_in_gemm2")
counters = solution_module("counters")
combine = solution_module("combine")
streaming = solution_module("streaming_gemm")
host = solution_module("host")


def test_the_combine_in_gemm2_below_33_tokens_only():
    for num_tokens in (1, kernel.EARLY_W2_MAX_TOKENS, kernel.EARLY_W2_MAX_TOKENS + 1, kernel.WGMMA_GEMM1_MIN_TOKENS - 1):
        chosen = candidate.variant_for(num_tokens)
        assert chosen.combine_in_gemm2 and chosen.gemm2().combine_in_gemm2
        assert dataclasses.replace(chosen, combine_in_gemm2=False) == kernel.variant_for(num_tokens)
    for num_tokens in (kernel.WGMMA_GEMM1_MIN_TOKENS, 901, 14107):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    assert not any(variant.combine_in_gemm2 for variant in kernel.VARIANTS)
    # A GEMM2 item's output columns are one block; the kept buffer holds every block's count and the exit count.
    assert streaming.ITEM_ROWS == combine.COMBINE_BLOCK_COLUMNS
    assert combine.COMBINE_BLOCKS * combine.COMBINE_BLOCK_COLUMNS == streaming.HIDDEN
    assert combine.EXIT_WORD < combine.COMBINE_WORDS


def test_the_combine_in_gemm2_needs_the_mma_sync_gemm2_of_a_routing_gemm1():
    with pytest.raises(ValueError, match="combine_in_gemm2"):
        dataclasses.replace(kernel.FEW_TOKENS, combine_in_gemm2=True)
    with pytest.raises(ValueError, match="combine_in_gemm2"):
        dataclasses.replace(kernel.TINY_T, routing_in_gemm1=False, combine_in_gemm2=True)
    with pytest.raises(streaming.StreamingConfigError, match="combine_in_gemm2"):
        streaming.StreamingGemmConfig(gemm1=True, block_tokens=16, num_stages=4, combine_in_gemm2=True)
    with pytest.raises(ValueError, match="combine_in_gemm2"):
        host.MoeHostSm90(kernel.TINY_T.make_gemm1(), kernel.TINY_T.make_gemm2(), True, combine_in_gemm2=True)


def test_two_launches_and_no_combine_kernel():
    variant = candidate.variant_for(1)
    moe_host = host.MoeHostSm90(
        variant.make_gemm1(), variant.make_gemm2(), routing_in_gemm1=True, combine_in_gemm2=True
    )
    assert not hasattr(moe_host, "combine")
    assert (moe_host.gemm1.link.waits, moe_host.gemm1.link.releases) == (False, True)
    assert (moe_host.gemm2.link.waits, moe_host.gemm2.link.releases) == (True, False)


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(candidate.compile_only, len(kernel.VARIANTS) + 2)


IN_GEMM2_CASES = [
    cases.CheckCase("in_gemm2_t1", 1, 0),
    cases.CheckCase("in_gemm2_t1_no_local", 1, 96, "no_local"),
    cases.CheckCase("in_gemm2_t3_all_local", 3, 32, "all_local"),
    cases.CheckCase("in_gemm2_t5", 5, 224),
    cases.CheckCase("in_gemm2_t7", 7, 128),
    cases.CheckCase("in_gemm2_t7_no_local", 7, 160, "no_local"),
    cases.CheckCase("in_gemm2_t16_one_expert", 16, 96, "one_expert"),
    cases.CheckCase("in_gemm2_t32_all_local", 32, 64, "all_local"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", IN_GEMM2_CASES, ids=lambda c: c.name)
def test_output_is_kernel_py_bit_for_bit_call_after_call(case):
    inputs = cases.make_inputs(case, "cuda", seed=49)
    device = torch.device("cuda")
    outputs = []
    for run in (kernel.run, candidate.run, candidate.run, candidate.run):
        output = cases.poisoned_output(case.num_tokens, "cuda")
        run(*inputs.values(), output)
        torch.cuda.synchronize()
        for kept in (counters.kept_counts, counters.kept_routed, counters.kept_combine):
            assert int(kept(device, kernel.GPU_ARCH).abs().sum()) == 0, f"{kept.__name__} left at zero"
        outputs.append(output)
    theirs, *ours = outputs
    for output in ours:
        assert not torch.isnan(output).any()
        assert torch.equal(output.view(torch.int16), theirs.view(torch.int16))
