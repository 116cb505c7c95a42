"""MoE candidate v2.11 (kernels/moe/candidate_f16_c.py): below 33 tokens C is rewritten as f16 times a power of two
per packed row (kernels/moe/c_to_f16.py) and GEMM2 multiplies f16. CPU: the dispatch, the chain of six kernels,
the configuration and the compile. GPU (marked `gpu`): the rewritten C against the bf16 C it replaces (each
element times its row's power of two, the power in [2^14, 2^15) / amax), and the output bit for bit kernel.py's
at 1-32 tokens for every routing pattern. The end-to-end checks against the reference are test_moe_kernel.py's
(the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_f16_c")
host = solution_module("host")

BITWISE_CASES = (
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
        assert candidate.variant_for(num_tokens) == dataclasses.replace(kernel.TINY_T, f16_c=True)
    for num_tokens in (33, 192, 193, 1025, kernel.MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_f16_c_is_the_mma_sync_gemm2s():
    variant = candidate.TINY_T_F16_C
    assert variant.gemm2().f16_c and not variant.gemm1().f16_c
    assert variant.gemm2().ctas_per_sm() == kernel.TINY_T.gemm2().ctas_per_sm() == 2
    with pytest.raises(ValueError, match="mma.sync"):
        dataclasses.replace(kernel.FEW_TOKENS, f16_c=True)


def test_the_rewrite_of_c_is_a_sixth_kernel_between_the_gemms():
    variant = candidate.TINY_T_F16_C
    moe_host = host.MoeHostSm90(variant.make_gemm1(), variant.make_gemm2())
    assert moe_host.c_to_f16 is not None
    assert moe_host.c_to_f16.link.waits and moe_host.c_to_f16.link.releases
    assert moe_host.gemm2.link.waits and not moe_host.release_counts.link.releases
    plain = host.MoeHostSm90(kernel.TINY_T.make_gemm1(), kernel.TINY_T.make_gemm2())
    assert plain.c_to_f16 is None


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 1


@pytest.mark.gpu
@needs_cuda
def test_the_rewritten_c_is_the_bf16_c_times_a_power_of_two_per_row():
    case = cases.CheckCase("t14", 14, 224)
    inputs = cases.make_inputs(case, "cuda", seed=11)
    bf16_c = kernel.run_keeping_workspaces(*inputs.values(), cases.poisoned_output(case.num_tokens, "cuda"))
    f16_c = kernel.run_keeping_workspaces(
        *inputs.values(), cases.poisoned_output(case.num_tokens, "cuda"), choose=candidate.variant_for
    )
    torch.cuda.synchronize()
    rows = int(bf16_c.counts.sum())
    assert rows > 0 and torch.equal(bf16_c.counts, f16_c.counts)
    c = bf16_c.intermediate[:rows].float()
    scale = f16_c.c_scale[:rows]
    stored = f16_c.intermediate[:rows].view(torch.float16).float()
    amax = c.abs().amax(dim=1)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # powers of two
    scaled_amax = amax / scale
    assert bool(((scaled_amax >= 2**14) & (scaled_amax < 2**15)).all())
    assert torch.equal(stored * scale[:, None], c)  # every element kept


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    outputs = outputs_of((kernel.run, candidate.run, candidate.run), case, seed=53)
    assert torch.isfinite(outputs[0]).all()
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
