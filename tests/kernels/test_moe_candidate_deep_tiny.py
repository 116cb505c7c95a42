"""MoE candidate v2.18 (kernels/moe/candidate_deep_tiny.py): below 33 tokens both `mma.sync` GEMMs at one CTA per SM
with 8 pipeline stages.

CPU: the dispatch, the configurations (one CTA per SM, GEMM2's valid-rows ring because its pipeline is deeper than its
4-stage items, GEMM1 without) and the compile. GPU (marked `gpu`): each GEMM against torch on its packed rows, and the
output bit for bit kernel.py's at 1-32 tokens in every routing pattern (many items per CTA: up to 16 tokens all local
gives GEMM2 ~60 row tiles). The end-to-end checks against the reference are test_moe_kernel.py's (the module is in
SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.compile_checks import assert_compiles_and_caches
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import check_each_gemm, outputs_of

candidate = solution_module("candidate_deep_tiny")


def test_one_deep_cta_per_sm_below_33_tokens_only():
    for num_tokens in (1, 7, 16, 32):
        chosen = candidate.variant_for(num_tokens)
        assert chosen is candidate.TINY_T_DEEP
        assert dataclasses.replace(chosen, num_stages=4, gemm2_num_stages=4) == kernel.variant_for(num_tokens)
    for num_tokens in (33, 192, 901, 14107):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_both_gemms_hold_eight_stages_in_one_cta_per_sm():
    gemm1, gemm2 = candidate.TINY_T_DEEP.gemm1(), candidate.TINY_T_DEEP.gemm2()
    assert gemm1.num_stages == gemm2.num_stages == 8
    assert gemm1.ctas_per_sm() == gemm2.ctas_per_sm() == 1
    assert not gemm1.valid_rows_ring and gemm1.k_stages == 14  # GEMM1's items are deeper than its pipeline
    assert gemm2.valid_rows_ring and gemm2.k_stages == 4


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(candidate.compile_only, len(kernel.VARIANTS) + 1)


DEEP_CASES = [
    cases.CheckCase("deep_t1", 1, 0),
    cases.CheckCase("deep_t1_one_expert", 1, 64, "one_expert"),
    cases.CheckCase("deep_t7", 7, 224),
    cases.CheckCase("deep_t13_all_local", 13, 32, "all_local"),
    cases.CheckCase("deep_t16_one_expert", 16, 96, "one_expert"),
    cases.CheckCase("deep_t32", 32, 128),
    cases.CheckCase("deep_t32_all_local", 32, 0, "all_local"),
    cases.CheckCase("deep_t5_no_local", 5, 160, "no_local"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", [c for c in DEEP_CASES if c.pattern != "no_local"], ids=lambda c: c.name)
def test_each_gemm_matches_torch_on_its_packed_rows(case):
    check_each_gemm(case, candidate.variant_for)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", DEEP_CASES, ids=lambda c: c.name)
def test_output_is_kernel_py_bit_for_bit(case):
    ours, theirs = outputs_of((candidate.run, kernel.run), case, seed=37)
    assert not torch.isnan(ours).any()
    assert torch.equal(ours, theirs)
