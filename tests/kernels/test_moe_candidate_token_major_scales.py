"""MoE candidate v2.55 (kernels/moe/candidate_token_major_scales.py): MEDIUM_T's GEMM1 reading each stage's token
scales as one 8-B copy from a token-major copy of x_scale that its producer warps write before the grid meets. CPU:
the dispatch, the configuration's guards, the compile. GPU (marked `gpu`): the workspace is x_scale transposed after
a call, and the output bit for bit kernel.py's at 193-1024 tokens for every routing pattern, call after call. The
end-to-end checks against the reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import MEDIUM_T_BITWISE_CASES, assert_bit_for_bit

candidate = solution_module("candidate_token_major_scales")
wgmma_gemm1 = solution_module("wgmma_gemm1")
host = solution_module("host")


def test_only_medium_t_changes():
    for num_tokens in (1, 7, 8, 32, 33, 192, kernel.MEDIUM_T_MAX_TOKENS + 1, 11948):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (193, 901, kernel.MEDIUM_T_MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is candidate.TOKEN_MAJOR_SCALES
    assert candidate.TOKEN_MAJOR_SCALES.gemm1().token_major_scales
    assert not kernel.MEDIUM_T.gemm1().token_major_scales
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_guards():
    with pytest.raises(wgmma_gemm1.StreamingConfigError, match="token_major_scales"):
        wgmma_gemm1.WgmmaGemm1Config(32, 3, scratch_in_stage=True, token_major_scales=True)  # no producer warp
    with pytest.raises(ValueError, match="gemm1_token_major_scales"):
        dataclasses.replace(kernel.LARGE_T, gemm1_token_major_scales=True)
    with pytest.raises(ValueError, match="gemm1_token_major_scales"):
        dataclasses.replace(candidate.TOKEN_MAJOR_SCALES, gemm1_smid_walk=False, gemm1_ctas_per_sm=2)


def test_workspace_only_where_asked():
    assert host.Workspaces.allocate(4, torch.device("cpu")).token_scales is None
    token_scales = host.Workspaces.allocate(4, torch.device("cpu"), token_scales=True).token_scales
    assert token_scales.shape == (4, 56) and token_scales.dtype == torch.float32


def test_transpose_covers_every_element_once():
    # transpose_token_scales's index walk (plain arithmetic) over the grids and token counts it meets: lanes
    # first = cta * 32 + lane, step = grid * 32, batches of TRANSPOSE_BATCH.
    for num_tokens, grid in ((193, 396), (901, 396), (1024, 396), (1000, 7)):
        total, step = 56 * num_tokens, grid * 32
        seen = []
        for first in range(step):
            for base in range(first, total, step * wgmma_gemm1.TRANSPOSE_BATCH):
                seen += [i for i in (base + j * step for j in range(wgmma_gemm1.TRANSPOSE_BATCH)) if i < total]
        assert sorted(seen) == list(range(total))


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", (193, 901))
def test_workspace_is_x_scale_transposed(num_tokens):
    case = cases.CheckCase(f"t{num_tokens}", num_tokens, 96)
    inputs = cases.make_inputs(case, "cuda", seed=29)
    output = cases.poisoned_output(num_tokens, "cuda")
    workspaces = kernel.run_keeping_workspaces(*inputs.values(), output, choose=candidate.variant_for)
    torch.cuda.synchronize()
    assert workspaces is not None and workspaces.token_scales is not None
    assert torch.equal(workspaces.token_scales, inputs["hidden_states_scale"].t())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", MEDIUM_T_BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    assert_bit_for_bit((kernel.run, candidate.run, candidate.run), case, seed=113)
