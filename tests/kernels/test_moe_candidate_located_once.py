"""MoE candidate v2.7 (kernels/moe/candidate_located_once.py): each streaming GEMM locates a work item once.
CPU: the dispatch (kernel.py's variants with the flags), the configurations compile. GPU (marked `gpu`): both
entries' outputs equal kernel.py's bit for bit in every variant, for random, skewed, all-local and no-local
routing (the same MMAs and promotions in the same order). The end-to-end checks against the reference are
test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_located_once")

# Every variant, its edges, items that cross experts and row tiles, and tiles of one expert.
BITWISE_CASES = (
    cases.CheckCase("t1", 1, 0),
    cases.CheckCase("t7_off224", 7, 224),
    cases.CheckCase("t16_all_local", 16, 32, "all_local"),
    cases.CheckCase("t32_one_expert", 32, 96, "one_expert"),
    cases.CheckCase("t33", 33, 0),
    cases.CheckCase("t80_one_expert", 80, 0, "one_expert"),
    cases.CheckCase("t192_all_local", 192, 160, "all_local"),
    cases.CheckCase("t193", 193, 64),
    cases.CheckCase("t901", 901, 96),
    cases.CheckCase("t901_one_expert", 901, 224, "one_expert"),
    cases.CheckCase("t1025_all_local", 1025, 96, "all_local"),
    cases.CheckCase("t2048", 2048, 32),
    cases.CheckCase("t80_no_local", 80, 96, "no_local"),
)


def test_dispatch_is_kernel_py_with_the_flags():
    for num_tokens in (1, 32, 33, 192, 193, 1024, 1025, 14107, kernel.MAX_TOKENS):
        base = kernel.variant_for(num_tokens)
        assert candidate.variant_for(num_tokens) == dataclasses.replace(base, located_once=True)
        overlapped = candidate.variant_for_overlapped(num_tokens)
        assert overlapped.located_once and overlapped.gemm1_overlapped == base.wgmma_gemm1
        assert dataclasses.replace(overlapped, located_once=False, gemm1_overlapped=False) == base
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_overlapped_promotion_needs_the_wgmma_gemm1():
    with pytest.raises(ValueError, match="wgmma_gemm1"):
        dataclasses.replace(kernel.TINY_T, gemm1_overlapped=True)


def test_compiles_without_gpu():
    compiled = candidate.compile_only("sm_90a")
    assert len(compiled) == 7  # TINY_T once (no WGMMA GEMM1), the three WGMMA variants twice
    assert all(callable(fn) for fn in compiled)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    outputs = outputs_of((kernel.run, candidate.run, candidate.run_overlapped), case, seed=41)
    assert torch.isfinite(outputs[0]).all()
    assert torch.equal(outputs[0], outputs[1]), "located_once differs from kernel.py"
    assert torch.equal(outputs[0], outputs[2]), "located_once + overlapped differs from kernel.py"
