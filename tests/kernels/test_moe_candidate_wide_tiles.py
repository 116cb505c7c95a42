"""MoE candidate v2.2 (kernels/moe/candidate_wide_tiles.py): kernel.py v2.1 with 64-token row tiles above
192 tokens: GEMM1 only (one or two CTAs per SM) or both GEMMs. CPU: the dispatch and the configurations'
shared memory. GPU (marked `gpu`): the per-GEMM check of test_moe_streaming.py for every entry (C
un-permuted), and every entry's output equal to kernel.py's bit for bit. The end-to-end checks are test_moe_kernel.py's (the
module's `run_wide` is in SOLUTIONS through its alias `run`).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import check_each_gemm, outputs_of

candidate = solution_module("candidate_wide_tiles")
ENTRIES = {
    "wide_gemm1": candidate.variant_for_wide_gemm1,
    "wide": candidate.variant_for_wide,
    "wide_gemm1_two_ctas": candidate.variant_for_wide_gemm1_two_ctas,
}


def test_only_medium_t_changes_and_its_tiles_take_one_cta_per_sm():
    for choose in ENTRIES.values():
        for num_tokens in (1, 32, 33, 64, 65, 192):
            assert choose(num_tokens) is kernel.variant_for(num_tokens)
        with pytest.raises(kernel.MoeShapeError):
            choose(0)
    for num_tokens in (193, 901, 2048, 2049, 14107, kernel.MAX_TOKENS):
        gemm1_only, both = candidate.variant_for_wide_gemm1(num_tokens), candidate.variant_for_wide(num_tokens)
        assert gemm1_only is candidate.MEDIUM_T_WIDE_GEMM1 and both is candidate.MEDIUM_T_WIDE
        for variant in (gemm1_only, both):
            assert variant.gemm1().block_tokens == 64 and variant.gemm1().permuted_c
            assert variant.gemm1().ctas_per_sm() == 1
        assert gemm1_only.gemm2().block_tokens == 32 and gemm1_only.gemm2().ctas_per_sm() == 2  # v2.1's
        assert both.gemm2().block_tokens == 64 and both.gemm2().ctas_per_sm() == 1
        two_ctas = candidate.variant_for_wide_gemm1_two_ctas(num_tokens)
        assert two_ctas is candidate.MEDIUM_T_WIDE_GEMM1_TWO_CTAS and two_ctas.gemm1().scratch_in_stage
        assert (two_ctas.gemm1().block_tokens, two_ctas.gemm1().num_stages, two_ctas.gemm1().ctas_per_sm()) == (64, 3, 2)
        assert two_ctas.gemm2().block_tokens == 32 and two_ctas.gemm2().ctas_per_sm() == 2
    compiled = candidate.compile_only("sm_90a")
    expected = len(candidate.VARIANTS) + len(kernel.compile_only("sm_90a"))
    assert len({id(fn) for fn in compiled}) == len(compiled) == expected


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("wide_t193", 193, 32),
        cases.CheckCase("wide_t300_one_expert", 300, 0, "one_expert"),
        cases.CheckCase("wide_t901", 901, 224),
        cases.CheckCase("wide_t2048_all_local", 2048, 96, "all_local"),
        cases.CheckCase("wide_t4096_one_expert", 4096, 0, "one_expert"),
    ],
    ids=lambda c: c.name,
)
@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_each_gemm_matches_torch(case, entry):
    check_each_gemm(case, ENTRIES[entry])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [901, 2100])
def test_outputs_are_kernel_py_bit_for_bit(num_tokens):
    # Each token's products and promotions do not depend on the tile it sits in: the tensor core sums a
    # block's products per output element, whatever N is.
    runs = (kernel.run, candidate.run_wide_gemm1, candidate.run_wide, candidate.run_wide_gemm1_two_ctas)
    outputs = outputs_of(runs, cases.CheckCase("wide_vs_kernel", num_tokens, 96), seed=37)
    assert torch.isfinite(outputs[0]).all()
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])
