"""MoE candidate v1.6 (kernels/moe/candidate_medium_gemm2.py): GEMM2 of 193-2048 tokens at two CTAs
per SM. CPU: the dispatch and the shared-memory fit. GPU (marked `gpu`): the per-GEMM check of
test_moe_streaming.py on its MEDIUM_T, and outputs bitwise kernel.py's. The end-to-end checks are
test_moe_kernel.py's (the candidate is in its SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import check_each_gemm

candidate = solution_module("candidate_medium_gemm2")


def test_only_medium_t_changes_and_only_its_gemm2():
    for num_tokens in (1, 32, 33, 64, 65, 192, 2049):
        assert candidate.variant_for(num_tokens) == kernel.variant_for(num_tokens)
    for num_tokens in (193, 901, 2048):
        chosen = candidate.variant_for(num_tokens)
        assert chosen is candidate.MEDIUM_T
        assert dataclasses.replace(chosen, gemm2_block_tokens=None, gemm2_num_stages=None) == kernel.MEDIUM_T
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_medium_gemm2_fits_two_ctas_per_sm_where_kernel_py_fits_one():
    assert kernel.MEDIUM_T.gemm2().ctas_per_sm() == 1
    assert candidate.MEDIUM_T.gemm2().ctas_per_sm() == 2
    assert candidate.MEDIUM_T.gemm1().ctas_per_sm() == kernel.MEDIUM_T.gemm1().ctas_per_sm()


def test_compiles_for_sm90a_without_gpu():
    compiled = candidate.compile_only("sm_90a")
    assert len({id(fn) for fn in compiled}) == len(compiled) == 1 + len(kernel.compile_only("sm_90a"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("medium_t901", 901, 224),
        cases.CheckCase("medium_t300_one_expert", 300, 0, "one_expert"),
        cases.CheckCase("medium_t2048_all_local", 2048, 96, "all_local"),
    ],
    ids=lambda c: c.name,
)
def test_each_gemm_matches_torch(case):
    check_each_gemm(case, candidate.variant_for)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [193, 901])
def test_outputs_are_kernel_py_bit_for_bit(num_tokens):
    inputs = cases.make_inputs(cases.CheckCase("medium_bitwise", num_tokens, 96), "cuda", seed=13)
    ours = cases.poisoned_output(num_tokens, "cuda")
    theirs = cases.poisoned_output(num_tokens, "cuda")
    kernel.run(*inputs.values(), ours)
    candidate.run(*inputs.values(), theirs)
    torch.cuda.synchronize()
    assert torch.isfinite(ours).all() and torch.equal(ours, theirs)
