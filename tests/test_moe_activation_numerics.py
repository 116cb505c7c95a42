"""tools/moe_activation_numerics.py: the precision of GEMM2's output per storage format of C."""

from __future__ import annotations

import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT

numerics = load_module_by_path(REPO_ROOT / "tools/moe_activation_numerics.py", "moe_activation_numerics")


def test_two_terms_capture_what_one_misses_and_zero_groups_stay_zero():
    generator = torch.Generator().manual_seed(3)
    c = torch.randn(4, 256, generator=generator) * torch.logspace(-3, 3, 256)
    c[1, :32] = 0.0
    one, two = numerics.quantise_groups(c, 1, 32), numerics.quantise_groups(c, 2, 32)
    assert torch.equal(one[1, :32], torch.zeros(32)) and torch.equal(two[1, :32], torch.zeros(32))
    assert numerics.relative_l2(two, c) < numerics.relative_l2(one, c) / 8  # e4m3 has 3 mantissa bits


def test_the_formats_rank_as_design_b_needs(capsys):
    # One small expert (CPU): one e4m3 term breaks the 1e-2 bound, bf16 keeps it, two terms beat bf16.
    result = numerics.errors(tokens=8, seed=0, groups=(128,))
    assert result["e4m3 x1 /128"] > 1e-2 > result["bf16"] > result["e4m3 x2 /128"]
    assert numerics.main(["--tokens", "4", "--seeds", "1", "--groups", "128"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 1 + 3


def test_bad_arguments_exit_2_with_one_line(capsys):
    assert numerics.main(["--groups", "100"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
