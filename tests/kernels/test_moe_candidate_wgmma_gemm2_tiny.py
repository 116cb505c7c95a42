"""MoE candidate v2.6 (kernels/moe/candidate_wgmma_gemm2_tiny.py): below 33 tokens the `mma.sync` GEMM1 with
the WGMMA GEMM2. CPU: the dispatch and that the variant compiles. GPU (marked `gpu`): each GEMM against torch
on its packed rows (test_moe_streaming.py's per-GEMM check: the routing lists, C, O) at 1-32 tokens for random,
one-expert and all-local routing; C equal to `kernel.py`'s bit for bit (only its column order differs). The
end-to-end checks against the reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import check_each_gemm, natural_intermediate

candidate = solution_module("candidate_wgmma_gemm2_tiny")

CASES = [
    cases.CheckCase("t1_off0", 1, 0),
    cases.CheckCase("t7_off224", 7, 224),
    cases.CheckCase("t16_off32", 16, 32),
    cases.CheckCase("t32_off0_one_expert", 32, 0, "one_expert"),
    cases.CheckCase("t5_off96_all_local", 5, 96, "all_local"),
]


def test_only_tiny_batches_change():
    for num_tokens in (33, 80, 192, 901, 14107, kernel.MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (1, 7, 16, 32):
        assert kernel.variant_for(num_tokens) is kernel.TINY_T
        chosen = candidate.variant_for(num_tokens)
        assert chosen.wgmma_gemm2 and not chosen.wgmma_gemm1
        ours, few = chosen.gemm2(), kernel.FEW_TOKENS.gemm2()  # FEW_TOKENS' WGMMA GEMM2 configuration
        assert type(ours) is type(few) and (ours.block_tokens, ours.num_stages) == (few.block_tokens, few.num_stages)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_compiles_without_gpu():
    compiled = candidate.compile_only("sm_90a")
    assert len(compiled) == len(kernel.VARIANTS) + 2 and all(callable(fn) for fn in compiled)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_each_gemm_matches_torch_on_its_packed_rows(case):
    check_each_gemm(case, candidate.variant_for)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES[:3], ids=lambda case: case.name)
def test_c_is_kernel_py_bit_for_bit_in_its_own_column_order(case):
    inputs = cases.make_inputs(case, "cuda", seed=43)
    stored = []
    for choose in (kernel.variant_for, candidate.variant_for):
        output = cases.poisoned_output(case.num_tokens, "cuda")
        workspaces = kernel.run_keeping_workspaces(*inputs.values(), output, choose=choose)
        torch.cuda.synchronize()
        rows = int(workspaces.counts.sum())
        assert rows > 0
        stored.append(natural_intermediate(workspaces.intermediate[:rows], choose(case.num_tokens)))
    assert torch.equal(stored[0], stored[1])
