"""MoE threshold candidate (kernels/moe/candidate_wide_from_193.py): kernel.py's LARGE_T from 193 tokens.
CPU: the dispatch. GPU (marked `gpu`): its output equal to kernel.py's bit for bit at 901 tokens (below
the threshold, where the two run different GEMM1 tiles). Per-GEMM checks of LARGE_T are
test_moe_streaming.py's (kernel.py runs it above 1024); the end-to-end checks are test_moe_kernel.py's
(the module is in SOLUTIONS).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_wide_from_193")


def test_only_193_to_1024_tokens_change():
    for num_tokens in (1, 32, 33, 192, kernel.MEDIUM_T_MAX_TOKENS + 1, 14107, kernel.MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (193, 901, kernel.MEDIUM_T_MAX_TOKENS):
        assert kernel.variant_for(num_tokens) is kernel.MEDIUM_T
        assert candidate.variant_for(num_tokens) is kernel.LARGE_T
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)
    assert candidate.compile_only("sm_90a") == kernel.compile_only("sm_90a")


@pytest.mark.gpu
@needs_cuda
def test_outputs_are_kernel_py_bit_for_bit(num_tokens=901):
    # Each token's products and promotions do not depend on the tile it sits in: the tensor core sums a
    # block's products per output element, whatever N is.
    outputs = outputs_of((kernel.run, candidate.run), cases.CheckCase("wide_vs_kernel", num_tokens, 96), seed=37)
    assert torch.isfinite(outputs[0]).all() and torch.equal(outputs[0], outputs[1])
