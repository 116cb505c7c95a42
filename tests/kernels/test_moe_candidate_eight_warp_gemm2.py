"""MoE candidate v2.12 (kernels/moe/candidate_eight_warp_gemm2.py): below 33 tokens the `mma.sync` GEMM2 runs 8 warps
per CTA, two per K block of a stage. CPU: the dispatch, the configuration (256 threads, still two CTAs per SM) and
the compile. GPU (marked `gpu`): the output within fp32 rounding of kernel.py's (its partial sums are added in
another order) at 1-32 tokens for every routing pattern, and bit for bit equal between two calls. The end-to-end
checks against the reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_eight_warp_gemm2")
streaming = solution_module("streaming_gemm")

CASES = (
    cases.CheckCase("t1", 1, 0),
    cases.CheckCase("t7", 7, 192),
    cases.CheckCase("t14", 14, 224),
    cases.CheckCase("t16_all_local", 16, 32, "all_local"),
    cases.CheckCase("t32_one_expert", 32, 96, "one_expert"),
    cases.CheckCase("t20_no_local", 20, 96, "no_local"),
    cases.CheckCase("t32", 32, 32),
)


def test_only_tiny_t_changes():
    for num_tokens in (1, 14, 32):
        assert candidate.variant_for(num_tokens) == dataclasses.replace(kernel.TINY_T, gemm2_warps_per_block=2)
    for num_tokens in (33, 192, 193, 1025, kernel.MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_the_gemm2_has_eight_warps_and_still_two_ctas_per_sm():
    gemm2 = candidate.TINY_T_EIGHT_WARP_GEMM2.gemm2()
    assert (gemm2.num_warps, gemm2.num_threads, gemm2.threads_per_token) == (8, 256, 32)
    assert gemm2.ctas_per_sm() == kernel.TINY_T.gemm2().ctas_per_sm() == 2
    assert candidate.TINY_T_EIGHT_WARP_GEMM2.gemm1().num_threads == 128  # GEMM1 unchanged
    with pytest.raises(streaming.StreamingConfigError):
        streaming.StreamingGemmConfig(gemm1=False, block_tokens=8, num_stages=4, warps_per_block=3)
    with pytest.raises(ValueError, match="mma.sync"):
        dataclasses.replace(kernel.FEW_TOKENS, gemm2_warps_per_block=2)


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_s_up_to_fp32_rounding_and_repeat_bit_for_bit(case):
    outputs = outputs_of((kernel.run, candidate.run, candidate.run), case, seed=59)
    assert torch.isfinite(outputs[1]).all() and torch.equal(outputs[1], outputs[2])
    ours, theirs = outputs[0].float(), outputs[1].float()
    # bf16 outputs: fp32 sums in another order move an element by about one bf16 ulp at most (more only where
    # the sum cancels to far below the row's scale)
    assert float((ours - theirs).norm()) <= 1e-3 * float(ours.norm())
    slack = 2**-7 * ours.abs() + 1e-4 * float(ours.abs().max())
    assert bool(((ours - theirs).abs() <= slack).all())
