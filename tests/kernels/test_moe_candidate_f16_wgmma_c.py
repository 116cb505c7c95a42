"""MoE candidate v2.39 (kernels/moe/candidate_f16_wgmma_c.py): from 33 tokens C is rewritten as f16 times a power of
two per packed row (kernels/moe/c_to_f16.py) and the WGMMA GEMM2 multiplies f16. CPU: the dispatch, the chain with
the rewrite between the GEMMs, the configurations and the compile. GPU (marked `gpu`): the rewritten C against the
bf16 C it replaces (each element times its row's power of two, the row's amax put in [2^14, 2^15)), and the output
bit for bit kernel.py's at 33-2049 tokens for every routing pattern. The end-to-end checks against the reference
are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_f16_wgmma_c")
host = solution_module("host")

BITWISE_CASES = (
    cases.CheckCase("t33", 33, 0),
    cases.CheckCase("t80", 80, 192),
    cases.CheckCase("t192_all_local", 192, 32, "all_local"),
    cases.CheckCase("t193", 193, 224),
    cases.CheckCase("t901", 901, 96),
    cases.CheckCase("t1024_no_local", 1024, 64, "no_local"),
    cases.CheckCase("t1025", 1025, 128),
    cases.CheckCase("t2049_one_expert", 2049, 160, "one_expert"),
)


def test_only_the_wgmma_gemm2_variants_change():
    for num_tokens, base in ((33, kernel.FEW_TOKENS), (192, kernel.FEW_TOKENS), (193, kernel.MEDIUM_T),
                             (901, kernel.MEDIUM_T), (1025, kernel.LARGE_T), (kernel.MAX_TOKENS, kernel.LARGE_T)):  # fmt: skip
        assert candidate.variant_for(num_tokens) == dataclasses.replace(base, f16_c=True)
    for num_tokens in (1, 6, 7, 8, 16, 32):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_f16_c_is_the_wgmma_gemm2s_and_keeps_two_ctas_per_sm():
    for base, variant in candidate.F16_C_VARIANTS.items():
        assert variant.gemm2().f16_c and not base.gemm2().f16_c
        assert variant.gemm2().smem_bytes() == base.gemm2().smem_bytes()
        assert variant.gemm2().ctas_per_sm() == base.gemm2().ctas_per_sm() == 2
    with pytest.raises(ValueError, match="WGMMA GEMM2"):
        dataclasses.replace(kernel.TINY_T, f16_c=True)


@pytest.mark.parametrize("routing_in_gemm1", (True, False))
def test_the_rewrite_of_c_is_a_kernel_between_the_gemms(routing_in_gemm1):
    variant = candidate.F16_C_VARIANTS[kernel.MEDIUM_T]
    moe_host = host.MoeHostSm90(variant.make_gemm1(), variant.make_gemm2(), routing_in_gemm1=routing_in_gemm1)
    assert moe_host.c_to_f16 is not None
    assert moe_host.c_to_f16.link.waits and moe_host.c_to_f16.link.releases
    assert moe_host.gemm1.link.releases and moe_host.gemm2.link.waits and moe_host.gemm2.link.releases
    assert moe_host.combine.link.waits and not moe_host.combine.link.releases
    assert moe_host.gemm1.link.waits != routing_in_gemm1  # the first kernel of a call must not wait
    plain = host.MoeHostSm90(kernel.MEDIUM_T.make_gemm1(), kernel.MEDIUM_T.make_gemm2(), routing_in_gemm1=True)
    assert plain.c_to_f16 is None


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 3


def rows_by_token(workspaces) -> torch.Tensor:
    """The packed rows of a call in (expert, token) order: two calls rank an expert's tokens in whatever order their
    CTAs routed them, so their rows are compared through this map."""
    rows = []
    offset = 0
    for expert, count in enumerate(workspaces.counts.tolist()):
        tokens = workspaces.expert_tokens[expert, :count]
        rows.append(offset + torch.argsort(tokens))
        offset += count
    return torch.cat(rows)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", (80, 901))
def test_the_rewritten_c_is_the_bf16_c_times_a_power_of_two_per_row(num_tokens):
    case = cases.CheckCase(f"t{num_tokens}", num_tokens, 224)
    inputs = cases.make_inputs(case, "cuda", seed=11)
    bf16_c = kernel.run_keeping_workspaces(*inputs.values(), cases.poisoned_output(case.num_tokens, "cuda"))
    f16_c = kernel.run_keeping_workspaces(
        *inputs.values(), cases.poisoned_output(case.num_tokens, "cuda"), choose=candidate.variant_for
    )
    torch.cuda.synchronize()
    rows = int(bf16_c.counts.sum())
    assert rows > 0 and torch.equal(bf16_c.counts, f16_c.counts)
    c = bf16_c.intermediate[:rows][rows_by_token(bf16_c)].float()
    assert torch.isfinite(c).all() and bool((c != 0).any())
    in_order = rows_by_token(f16_c)
    scale = f16_c.c_scale[:rows][in_order]
    stored = f16_c.intermediate[:rows][in_order].view(torch.float16).float()
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # powers of two
    scaled_amax = stored.abs().amax(dim=1)
    assert bool(((scaled_amax >= 2**14) & (scaled_amax < 2**15)).all())
    assert torch.equal(stored * scale[:, None], c)  # every element kept


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    outputs = outputs_of((kernel.run, candidate.run, candidate.run), case, seed=53)
    assert torch.isfinite(outputs[0]).all()
    if case.pattern != "no_local":
        assert bool((outputs[0] != 0).any())
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
