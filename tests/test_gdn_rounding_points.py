"""kernels/gdn_prefill/probes/rounding_points.py and the models' `paired` rounding points (CPU): with none paired
the models compute what they computed before; T and V'c as hi / lo pairs remove most of the error of one key
repeated over each chunk (NOTES.md's accuracy bullet), in the chained and the context-parallel model; a pair
holds a value to ~2^-22; bad arguments exit 2."""

from __future__ import annotations

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT

probe = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/probes/rounding_points.py", "rounding_points")
chunked_model = probe.chunked_model

REPEATED_KEYS = probe.cases.CheckCase("repeated_keys_512", (512,), True, 0.0, "slow_decay", keys="repeated")


def _inputs(case, seed: int) -> list:
    inputs = probe.cases.make_inputs(case, "cpu", seed=seed)
    return [inputs[name] for name in probe.INPUTS]


def test_no_paired_point_is_the_kernels_rounding():
    args = _inputs(probe.cases.CheckCase("random_130", (130,), True, 0.0, "mamba2"), seed=3)
    plain = chunked_model.run(*args, precision=chunked_model.KERNEL)
    explicit = chunked_model.run(
        *args, precision=chunked_model.KERNEL,
        step=lambda *a: chunked_model.chunk_step(*a, paired=frozenset()),
    )  # fmt: skip
    paired = chunked_model.run(
        *args, precision=chunked_model.KERNEL,
        step=lambda *a: chunked_model.chunk_step(*a, paired=chunked_model.ROUNDING_POINTS),
    )  # fmt: skip
    assert all(torch.equal(x, y) for x, y in zip(plain, explicit))
    assert not torch.equal(plain[1], paired[1])  # the points do round something


def test_a_pair_holds_a_value_to_22_bits():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(5)) * 3.0
    pairs = chunked_model.Precision(torch.float32, torch.float16, pairs=True).round(x)
    single = chunked_model.KERNEL.round(x)
    # relative 2^-21, and half of fp16's subnormal step (2^-24) where the low half underflows
    assert ((pairs - x).abs() <= x.abs() * 2.0**-21 + 2.0**-25).all()
    assert (single - x).abs().max() > 2.0**-13 * x.abs().max()


@pytest.mark.parametrize("seed", [0, 1])
def test_t_and_vc_as_pairs_remove_most_of_the_repeated_key_error(seed):
    args = _inputs(REPEATED_KEYS, seed)
    reference = probe.cp_model.token_recurrence(*args)
    rounded = probe.errors(args, reference, frozenset())
    paired = probe.errors(args, reference, frozenset({"T", "Vc"}))
    for path in ("chained", "CP"):
        assert 0.2 < rounded[f"{path} state"] < 1.0  # passes at 512 tokens, with a visible error
        assert paired[f"{path} state"] < rounded[f"{path} state"] / 5
        assert paired[f"{path} output"] <= rounded[f"{path} output"]


def test_unknown_points_and_cases_are_refused(capsys):
    with pytest.raises(ValueError, match="unknown rounding points"):
        chunked_model.chunk_step(*[None] * 8, paired=frozenset({"S0"}))
    assert probe.main(["--points", "T+bogus"]) == 2
    assert probe.main(["--case", "no_such_case"]) == 2
    assert capsys.readouterr().err.count("\n") == 2
