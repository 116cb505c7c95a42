"""MoE candidate v2.30 (kernels/moe/candidate_early_w2_at_7.py): GEMM2's first weights before its wait at 7-8 tokens.
CPU: the dispatch of both sides, the configurations, the compile. GPU (marked `gpu`): both sides' output bit for bit
kernel.py's at 7-8 tokens in every routing pattern, call after call. The end-to-end checks against the reference are
test_moe_kernel.py's (the module is in SOLUTIONS, as `run`).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_early_w2_at_7")
streaming = solution_module("streaming_gemm")


def test_only_7_and_8_tokens_change():
    for choose in (candidate.variant_for, candidate.variant_for_shallow):
        for num_tokens in (1, 6, 9, 16, 32, 33, 901, 14107):
            assert choose(num_tokens) is kernel.variant_for(num_tokens)
        with pytest.raises(kernel.MoeShapeError):
            choose(0)
    for num_tokens in (7, 8):
        assert candidate.variant_for(num_tokens) is candidate.EARLY_W2_THREE_CTAS
        assert candidate.variant_for_shallow(num_tokens) is candidate.EARLY_W2_THREE_CTAS_SHALLOW


def test_the_shallow_gemm2_fits_beside_two_gemm1_ctas():
    for variant, stages in ((candidate.EARLY_W2_THREE_CTAS, 4), (candidate.EARLY_W2_THREE_CTAS_SHALLOW, 3)):
        gemm1, gemm2 = variant.gemm1(), variant.gemm2()
        assert vars(gemm1) == vars(kernel.TINY_T_THREE_CTAS.gemm1())
        assert gemm2.weights_before_wait and gemm2.num_stages == stages and gemm2.ctas_per_sm() == 2
    per_cta = lambda config: config.smem_bytes() + streaming.SMEM_RESERVED_PER_CTA  # noqa: E731
    shallow = candidate.EARLY_W2_THREE_CTAS_SHALLOW
    assert 2 * per_cta(shallow.gemm1()) + per_cta(shallow.gemm2()) <= streaming.SMEM_PER_SM
    assert 2 * per_cta(shallow.gemm1()) + per_cta(candidate.EARLY_W2_THREE_CTAS.gemm2()) > streaming.SMEM_PER_SM


def test_compiles_its_two_configurations_beside_kernel_pys():
    compiled = candidate.compile_only("sm_90a")
    assert compiled[: len(kernel.VARIANTS) + 1] == kernel.compile_only("sm_90a")
    assert len(set(map(id, compiled))) == len(kernel.VARIANTS) + 3


CASES = [
    cases.CheckCase("early7_t7", 7, 192),
    cases.CheckCase("early7_t7_all_local", 7, 0, "all_local"),
    cases.CheckCase("early7_t7_no_local", 7, 96, "no_local"),
    cases.CheckCase("early7_t8_one_expert", 8, 128, "one_expert"),
    cases.CheckCase("early7_t8_all_local", 8, 32, "all_local"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_both_sides_are_kernel_py_bit_for_bit_call_after_call(case):
    # Early weights change no output bit, and each call leaves the kept routed count at zero for the next.
    runs = (kernel.run, *[candidate.run] * 2, *[candidate.run_shallow] * 2)
    theirs, *ours = outputs_of(runs, case, seed=47)
    assert torch.isfinite(theirs).all()
    for output in ours:
        assert torch.equal(output, theirs)
