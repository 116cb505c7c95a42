"""kernels/moe/probes/moe_activation_numerics.py: the precision of GEMM2's output per storage format of C."""

from __future__ import annotations

import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT

numerics = load_module_by_path(REPO_ROOT / "kernels/moe/probes/moe_activation_numerics.py", "moe_activation_numerics")


def test_two_terms_capture_what_one_misses_and_zero_groups_stay_zero():
    generator = torch.Generator().manual_seed(3)
    c = torch.randn(4, 256, generator=generator) * torch.logspace(-3, 3, 256)
    c[1, :32] = 0.0
    one, two = numerics.quantise_groups(c, 1, 32), numerics.quantise_groups(c, 2, 32)
    assert torch.equal(one[1, :32], torch.zeros(32)) and torch.equal(two[1, :32], torch.zeros(32))
    assert numerics.relative_l2(two, c) < numerics.relative_l2(one, c) / 8  # e4m3 has 3 mantissa bits


def test_the_formats_rank_as_design_b_and_candidate_v2_11_need(capsys):
    # One small expert (CPU): one e4m3 term breaks the 1e-2 bound, bf16 keeps it, two terms beat bf16, and
    # f16 with a scale per token beats bf16 by about its three more significand bits.
    result = numerics.errors(tokens=8, seed=0, groups=(128,))
    assert result["e4m3 x1 /128"] > 1e-2 > result["bf16"] > result["e4m3 x2 /128"]
    assert result["f16 /token"] < result["bf16"] / 4
    assert numerics.main(["--tokens", "4", "--seeds", "1", "--groups", "128"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 1 + 4


def test_the_per_token_f16_scale_is_a_power_of_two_that_keeps_every_row_finite():
    c = torch.tensor([[1e6, -3.0, 0.0], [1e-6, 2e-7, 0.0], [0.0, 0.0, 0.0]])
    stored = numerics.f16_per_row(c)
    assert torch.isfinite(stored).all() and torch.equal(stored[2], torch.zeros(3))
    assert torch.allclose(stored, c, rtol=2**-11, atol=0.0)


def test_bad_arguments_exit_2_with_one_line(capsys):
    assert numerics.main(["--groups", "100"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
