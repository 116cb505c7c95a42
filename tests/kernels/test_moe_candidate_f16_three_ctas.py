"""MoE candidate v2.40 (kernels/moe/candidate_f16_three_ctas.py): v2.39's f16 WGMMA GEMM2 above 192 tokens with two
stages and three CTAs per SM. CPU: the dispatch, the configurations (three CTAs' shared memory) and the compile. GPU
(marked `gpu`): the output bit for bit kernel.py's at 193-2049 tokens for every routing pattern. The end-to-end
checks against the reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_f16_three_ctas")

BITWISE_CASES = (
    cases.CheckCase("t193", 193, 224),
    cases.CheckCase("t901", 901, 96),
    cases.CheckCase("t1024_all_local", 1024, 32, "all_local"),
    cases.CheckCase("t1025_no_local", 1025, 64, "no_local"),
    cases.CheckCase("t2049_one_expert", 2049, 160, "one_expert"),
    cases.CheckCase("t3000", 3000, 0),
)


def test_only_the_variants_above_few_tokens_change():
    for num_tokens, base in ((193, kernel.MEDIUM_T), (901, kernel.MEDIUM_T), (1025, kernel.LARGE_T),
                             (kernel.MAX_TOKENS, kernel.LARGE_T)):  # fmt: skip
        assert candidate.variant_for(num_tokens) == dataclasses.replace(
            base, f16_c=True, gemm2_num_stages=2, gemm2_ctas_per_sm=3
        )
    for num_tokens in (1, 7, 16, 32, 33, 80, 192):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_the_gemm2_takes_three_ctas_per_sm_and_gemm1_is_kernel_pys():
    for base, variant in candidate.THREE_CTA_VARIANTS.items():
        assert variant.gemm2().ctas_per_sm() == 3 and variant.gemm2().num_stages == 2 and variant.gemm2().f16_c
        assert variant.gemm1().__dict__ == base.gemm1().__dict__
    with pytest.raises(ValueError, match="WGMMA GEMM2"):
        dataclasses.replace(kernel.TINY_T, gemm2_ctas_per_sm=3)


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    outputs = outputs_of((kernel.run, candidate.run, candidate.run), case, seed=59)
    assert torch.isfinite(outputs[0]).all()
    if case.pattern != "no_local":
        assert bool((outputs[0] != 0).any())
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
