"""MoE candidate v2.13 (kernels/moe/candidate_lean_issue.py): below 33 tokens the `mma.sync` GEMMs issue each K stage
from per-item bases. CPU: the dispatch, the configuration guard and the compile. GPU (marked `gpu`): the output bit
for bit kernel.py's at 1-32 tokens for every routing pattern (the same copies and arithmetic), including several
items per CTA. The end-to-end checks against the reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_lean_issue")
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
        assert candidate.variant_for(num_tokens) == dataclasses.replace(kernel.TINY_T, lean_issue=True)
    for num_tokens in (33, 192, 193, 1025, kernel.MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_both_gemms_of_the_variant_issue_lean_and_kernel_py_s_do_not():
    assert candidate.TINY_T_LEAN_ISSUE.gemm1().lean_issue and candidate.TINY_T_LEAN_ISSUE.gemm2().lean_issue
    assert not kernel.TINY_T.gemm1().lean_issue and not kernel.TINY_T.gemm2().lean_issue
    # The computed item's location comes from the load side: an item must span the pipeline.
    with pytest.raises(streaming.StreamingConfigError, match="lean_issue"):
        streaming.StreamingGemmConfig(gemm1=False, block_tokens=8, num_stages=5, lean_issue=True)


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_s_bit_for_bit(case):
    outputs = outputs_of((kernel.run, candidate.run), case, seed=61)
    assert torch.isfinite(outputs[1]).all()
    assert torch.equal(outputs[0], outputs[1])
