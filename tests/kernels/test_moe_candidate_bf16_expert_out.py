"""MoE candidate v2.49 (kernels/moe/candidate_bf16_expert_out.py): GEMM2's expert outputs stored as bf16 above
FEW_TOKENS_MAX. CPU: the dispatch, the configuration, the compile. GPU (marked `gpu`): against the reference by the
track's acceptance with relative L2 <= 3.5e-3 at 193-14107 tokens in every routing pattern, within bf16 rounding of
kernel.py's output, and the same bits call after call. test_moe_kernel.py's SOLUTIONS add the shared checks (every
check case, zero rows, graph replay).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, reference, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_bf16_expert_out")

RELATIVE_L2_BOUND = 3.5e-3  # the contract's: kernel.py measures ~2.6e-3
CASES = (
    cases.CheckCase("t193", 193, 224),
    cases.CheckCase("t901", 901, 96),
    cases.CheckCase("t901_one_expert", 901, 224, "one_expert"),
    cases.CheckCase("t1000_no_local", 1000, 64, "no_local"),
    cases.CheckCase("t1024_all_local", 1024, 160, "all_local"),
    cases.CheckCase("t2100", 2100, 32),
    cases.CheckCase("t11948", 11948, 32),
)


def test_only_the_wgmma_gemm2_variants_above_few_tokens_change():
    for num_tokens in (1, 7, 8, 32, 33, kernel.FEW_TOKENS_MAX):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (kernel.FEW_TOKENS_MAX + 1, 901, kernel.MEDIUM_T_MAX_TOKENS + 1, 14107):
        chosen = candidate.variant_for(num_tokens)
        assert chosen.gemm2().bf16_out
        assert dataclasses.replace(chosen, bf16_expert_out=False) == kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)
    with pytest.raises(ValueError, match="bf16_expert_out"):
        kernel.StreamingVariant(block_tokens=16, bf16_expert_out=True)  # the `mma.sync` GEMM2 has no such switch


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_matches_reference_near_kernel_py_and_repeats(case):
    inputs = cases.make_inputs(case, "cuda", seed=107)
    ours, first, second = outputs_of((kernel.run, candidate.run, candidate.run), case, seed=107)
    assert torch.equal(first, second)  # the combine still sums in slot order
    stats = cases.compare(first, reference.run(*inputs.values()))
    assert stats.nan_count == 0 and stats.passed, stats
    if case.pattern == "no_local":
        assert int(torch.count_nonzero(first)) == 0
        return
    assert stats.relative_l2 <= RELATIVE_L2_BOUND, stats
    # One more bf16 rounding of each expert output (2^-9 relative) before the weighted sum: some outputs' final bf16
    # rounding flips by one unit (2^-8 relative) against kernel.py's, nothing moves further.
    difference = (first.float() - ours.float()).norm() / ours.float().norm()
    assert 0 < difference < 8e-3, difference
