"""kernel.py's f16 C above FEW_TOKENS_MAX (kernels/moe/c_to_f16.py rewrites C in place as f16 times a power of two
per packed row) and MEDIUM_T's f16 GEMM2 (kernels/moe/wgmma_gemm2.py multiplies f16 in 2 stages at three CTAs per SM;
GROUPED_T's grouped GEMM2 reads the same C, tests/kernels/test_moe_grouped_gemm2.py).

CPU: which variants take it, the chain with the rewrite between the GEMMs, the configurations' guards. GPU (marked
`gpu`), on MEDIUM_T (forced above MEDIUM_T_MAX_TOKENS: its GEMM1's grid routes any T): the rewritten C is the bf16 C
times a power of two per row (the row's amax put in [2^14, 2^15), every element above 2^-31 of it kept exactly, smaller
ones within 2^-39 of it), and its output equals, bit for bit, that of the same variant on the bf16 GEMM2 (3 stages, two
CTAs per SM) at 193-3000 tokens for every routing pattern (measured: exact only where no element below 2^-31 of its
row's amax reaches a product that fp32 would keep).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import assert_bit_for_bit

host = solution_module("host")

BITWISE_CASES = (
    cases.CheckCase("t193", 193, 224),
    cases.CheckCase("t901", 901, 96),
    cases.CheckCase("t1024_all_local", 1024, 32, "all_local"),
    cases.CheckCase("t1025_no_local", 1025, 64, "no_local"),
    cases.CheckCase("t2049_one_expert", 2049, 160, "one_expert"),
    cases.CheckCase("t3000", 3000, 0),
)


def on_bf16_gemm2(variant):
    """`variant` with the bf16 WGMMA GEMM2: bf16 C, 3 stages, two CTAs per SM."""
    return dataclasses.replace(variant, f16_c=False, gemm2_num_stages=3)


def test_the_f16_gemm2_runs_above_few_tokens_max_only():
    gemm2 = kernel.MEDIUM_T.gemm2()
    assert kernel.MEDIUM_T.f16_c and gemm2.f16_c and gemm2.num_stages == 2 and gemm2.ctas_per_sm() == 3
    assert kernel.GROUPED_T.f16_c and kernel.GROUPED_T.gemm2().f16_c  # the grouped GEMM2 multiplies f16 too
    for variant in kernel.VARIANTS[:3]:
        assert not variant.f16_c and variant.gemm2().ctas_per_sm() == 2
    assert on_bf16_gemm2(kernel.MEDIUM_T).gemm2().ctas_per_sm() == 2
    with pytest.raises(ValueError, match="WGMMA"):
        dataclasses.replace(kernel.FUSED_T, f16_c=True)


def test_the_rewrite_of_c_is_a_kernel_between_the_gemms(variant=kernel.MEDIUM_T):
    moe_host = variant.make_host()
    assert moe_host.c_to_f16 is not None
    assert moe_host.c_to_f16.link.waits and moe_host.c_to_f16.link.releases
    assert moe_host.gemm1.link.releases and moe_host.gemm2.link.waits and moe_host.gemm2.link.releases
    assert moe_host.combine.link.waits and not moe_host.combine.link.releases
    assert moe_host.gemm1.link.waits != moe_host.routing_in_gemm1  # the first kernel of a call must not wait
    bf16 = on_bf16_gemm2(variant)
    assert bf16.make_host().c_to_f16 is None


def test_the_rewrites_arithmetic_keeps_every_element_above_2_to_the_minus_31_of_the_amax():
    """c_to_f16.py's arithmetic emulated in torch (the power from the amax's biased exponent e: 2^(141 - e)) on bf16
    rows spanning 80 binades: elements above 2^-31 of the amax come back exactly, smaller ones within 2^-39 of it."""
    generator = torch.Generator().manual_seed(7)
    for _ in range(20):
        magnitudes = torch.exp2(torch.empty(2048).uniform_(-60, 20, generator=generator))
        signs = torch.randint(0, 2, (2048,), generator=generator) * 2 - 1
        c = (magnitudes * signs).to(torch.bfloat16).float()
        amax = c.abs().max()
        biased = int(torch.frexp(amax)[1]) - 1 + 127
        to_f16, from_f16 = 2.0 ** (141 - biased), 2.0 ** (biased - 141)
        stored = (c * to_f16).half().float()
        assert 2**14 <= float(stored.abs().max()) < 2**15
        rewritten = stored * from_f16
        kept = c.abs() >= amax * 2.0**-31
        assert bool((~kept).any())  # the rows do reach below the bound
        assert torch.equal(rewritten[kept], c[kept])
        assert bool(((rewritten - c).abs() <= amax * 2.0**-39).all())


def rows_by_token(workspaces) -> torch.Tensor:
    """The packed rows of a call in (expert, token) order: two calls rank an expert's tokens in whatever order their
    CTAs routed them, so their rows are compared through this map."""
    rows = []
    offset = 0
    for expert, count in enumerate(workspaces.counts.tolist()):
        rows.append(offset + torch.argsort(workspaces.expert_tokens[expert, :count]))
        offset += count
    return torch.cat(rows)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", (193, 901, 2049))
def test_the_rewritten_c_is_the_bf16_c_times_a_power_of_two_per_row(num_tokens):
    case = cases.CheckCase(f"t{num_tokens}", num_tokens, 224)
    inputs = cases.make_inputs(case, "cuda", seed=11)
    bf16_c, f16_c = (
        kernel.run_keeping_workspaces(*inputs.values(), cases.poisoned_output(num_tokens, "cuda"), choose=choose)
        for choose in (lambda _: on_bf16_gemm2(kernel.MEDIUM_T), lambda _: kernel.MEDIUM_T)
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
    # Every element at least 2^-31 of its row's amax keeps its bf16 value exactly (8 significant bits fit f16's
    # normals and, down to 2^-17 after the scale, its subnormals); a smaller one (silu of a very negative gate) is an
    # f16 subnormal, within half of its 2^-24 step: at most 2^-39 of the amax. (Asking for every element exactly
    # fails at 2049 tokens on such elements.)
    amax = c.abs().amax(dim=1, keepdim=True)
    kept = c.abs() >= amax * 2.0**-31
    rewritten = stored * scale[:, None]
    assert torch.equal(rewritten[kept], c[kept])
    assert bool(((rewritten - c).abs() <= scale[:, None] * 2.0**-25).all())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_the_bf16_gemm2s_bit_for_bit(case):
    medium = kernel.make_run(lambda _: kernel.MEDIUM_T)
    bf16 = kernel.make_run(lambda _: on_bf16_gemm2(kernel.MEDIUM_T))
    assert_bit_for_bit((bf16, medium, medium), case, seed=53)
