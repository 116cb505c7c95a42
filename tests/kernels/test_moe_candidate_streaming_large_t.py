"""MoE candidate v1.8 (kernels/moe/candidate_streaming_large_t.py): kernel.py's MEDIUM_T streaming
variant above 2048 tokens instead of v0's grouped pipeline. CPU: the dispatch. GPU (marked `gpu`): the
per-GEMM check of test_moe_streaming.py above 2048 tokens, and the output against the reference at the
official 11948 tokens (test_moe_kernel.py's check cases run it too: it is in SOLUTIONS).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, reference, solution_module
from tests.kernels.test_moe_streaming import check_each_gemm

candidate = solution_module("candidate_streaming_large_t")


def test_above_2048_tokens_it_streams_with_medium_t_and_below_it_is_kernel_py():
    for num_tokens in (1, 33, 192, 193, 2048):
        assert candidate.variant_for(num_tokens) == kernel.variant_for(num_tokens)
    for num_tokens in (2049, 11948, 14107, kernel.MAX_TOKENS):
        assert kernel.variant_for(num_tokens) is None and candidate.variant_for(num_tokens) is kernel.MEDIUM_T
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)
    assert candidate.compile_only("sm_90a") == kernel.compile_only("sm_90a")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [cases.CheckCase("large_t2049", 2049, 96), cases.CheckCase("large_t4096_one_expert", 4096, 0, "one_expert")],
    ids=lambda c: c.name,
)
def test_each_gemm_matches_torch_above_2048_tokens(case):
    check_each_gemm(case, candidate.variant_for)


@pytest.mark.gpu
@needs_cuda
def test_official_large_batch_passes(case=cases.CheckCase("large_t11948", 11948, 128)):
    inputs = cases.make_inputs(case, "cuda", seed=29)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    candidate.run(*inputs.values(), output)
    torch.cuda.synchronize()
    stats = cases.compare(output, reference.run(*inputs.values()))
    assert stats.passed and stats.relative_l2 < 1e-2, stats
