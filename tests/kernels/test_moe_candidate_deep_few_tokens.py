"""MoE candidate v2.3 (kernels/moe/candidate_deep_few_tokens.py): kernel.py v2.1's 33-64-token variant up to
192 tokens, and with five stages in both WGMMA GEMMs. CPU: the dispatch and two CTAs per SM. GPU (marked
`gpu`): the per-GEMM check of test_moe_streaming.py for both entries at 33-192 tokens (C un-permuted), and
the deep variant's output equal to kernel.py's bit for bit at 58 tokens. The end-to-end checks are
test_moe_kernel.py's (`run` = `run_deep_few`).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import check_each_gemm, outputs_of

candidate = solution_module("candidate_deep_few_tokens")
ENTRIES = {"few_to_192": candidate.variant_for_few_to_192, "deep_few": candidate.variant_for_deep_few}


def test_only_33_to_192_tokens_change_and_keep_two_ctas_per_sm():
    for choose in ENTRIES.values():
        for num_tokens in (1, 32, 193, 901, 14107):
            assert choose(num_tokens) is kernel.variant_for(num_tokens)
        with pytest.raises(kernel.MoeShapeError):
            choose(0)
    for num_tokens in (33, 64):
        assert candidate.variant_for_few_to_192(num_tokens) is kernel.FEW_TOKENS
    for num_tokens in (65, 80, 192):
        assert candidate.variant_for_few_to_192(num_tokens) is kernel.FEW_TOKENS
    for num_tokens in (33, 58, 64, 65, 80, 192):
        deep = candidate.variant_for_deep_few(num_tokens)
        assert deep is candidate.DEEP_FEW_TOKENS and deep.wgmma_gemm1 and deep.wgmma_gemm2
        assert (deep.gemm1().block_tokens, deep.gemm1().num_stages, deep.gemm1().ctas_per_sm()) == (16, 5, 2)
        assert (deep.gemm2().block_tokens, deep.gemm2().num_stages, deep.gemm2().ctas_per_sm()) == (8, 5, 2)
    expected = len(candidate.VARIANTS) + len(kernel.compile_only("sm_90a"))
    compiled = candidate.compile_only("sm_90a")
    assert len({id(fn) for fn in compiled}) == len(compiled) == expected


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("deep_t33", 33, 224),
        cases.CheckCase("deep_t58", 58, 96),
        cases.CheckCase("deep_t80_one_expert", 80, 0, "one_expert"),
        cases.CheckCase("deep_t192_all_local", 192, 96, "all_local"),
    ],
    ids=lambda c: c.name,
)
@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_each_gemm_matches_torch(case, entry):
    check_each_gemm(case, ENTRIES[entry])


@pytest.mark.gpu
@needs_cuda
def test_deep_outputs_are_kernel_py_bit_for_bit(num_tokens=58):
    # Deeper pipelines move the same bytes earlier; every product and sum is the same.
    outputs = outputs_of((kernel.run, candidate.run_deep_few), cases.CheckCase("deep_vs_kernel", num_tokens, 96), seed=41)
    assert torch.isfinite(outputs[0]).all() and torch.equal(outputs[0], outputs[1])
