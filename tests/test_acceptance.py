"""The correctness gate under the registry's real acceptance rules."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from hopperbench import acceptance
from hopperbench.acceptance import OutputStats, Verdict, check_outputs, compare_output, merge_verdicts
from hopperbench.tracks import DSA_ATTENTION, GDN_PREFILL, MOE

GDN = GDN_PREFILL.acceptance  # atol 1e-2, rtol 1e-2, ratio 1.0, output + new_state
MOE_RULE = MOE.acceptance_for("ours")  # atol 1, rtol 0.3, ratio 0.9, relative L2 <= 1e-2
MOE_RATIO_ONLY = MOE.acceptance  # the contest's MoE rule alone, for every side but ours
DSA = DSA_ATTENTION.acceptance  # atol 1e-2, rtol 1e-2, ratio 1.0, output + lse
INF = math.inf


def t(values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def one(rule, out, ref) -> OutputStats:
    return compare_output(rule, out, ref)


def test_registry_rules_are_the_contest_rules():
    assert (GDN.atol, GDN.rtol, GDN.required_matched_ratio) == (1e-2, 1e-2, 1.0)
    assert (MOE_RULE.atol, MOE_RULE.rtol, MOE_RULE.required_matched_ratio) == (1.0, 0.3, 0.9)
    assert DSA.outputs == ("output", "lse")


def test_identical_outputs_pass_every_track():
    gen = torch.Generator().manual_seed(0)
    for track in (GDN_PREFILL, MOE, DSA_ATTENTION):
        tensors = {name: torch.randn(4, 8, generator=gen).to(torch.bfloat16) for name in track.acceptance.outputs}
        verdict = check_outputs(track.acceptance, tensors, {k: v.clone() for k, v in tensors.items()})
        assert verdict.passed and verdict.reason is None
        for stats in verdict.outputs.values():
            assert (stats.max_abs_err, stats.relative_l2, stats.matched_ratio, stats.bad_count) == (0.0, 0.0, 1.0, 0)


# --- the contest element rule: bad only when both tolerances are exceeded ---------------------------


@pytest.mark.parametrize(
    ("ref", "out", "bad"),
    [
        (0.0, 1.0, False),  # abs exactly atol (rel huge): not bad
        (0.0, 1.0 + 2**-23, True),  # abs just over atol, rel huge: bad
        (10.0, 13.0, False),  # rel exactly rtol in fp32 (abs 3): not bad
        (100.0, 129.0, False),  # abs 29 but rel 0.29 <= 0.3
        (100.0, 131.0, True),  # abs 31 and rel 0.31
        (-100.0, -69.0, True),  # sign does not matter: abs 31, rel 0.31
        (2.0, 2.5, False),  # both within
    ],
)
def test_element_is_bad_only_when_both_tolerances_fail(ref, out, bad):
    stats = one(MOE_RATIO_ONLY, t([out]), t([ref]))
    assert stats.bad_count == int(bad)
    assert stats.passed is (not bad)  # a single element: one bad element fails the output
    assert stats.max_abs_err == pytest.approx(abs(out - ref))


def test_tight_rule_uses_the_relative_tolerance_for_large_values():
    ref = t([0.0, 1000.0, 1.0])
    assert one(GDN, t([0.005, 1000.5, 1.0]), ref).passed  # abs within; rel 5e-4 within; exact
    failing = one(GDN, t([0.005, 1000.5, 1.02]), ref)  # abs 0.02 and rel 0.02 both over 1e-2
    assert not failing.passed and failing.bad_count == 1
    assert "1 of 3 elements out of tolerance" in failing.reason


def test_moe_matched_ratio_0_9_is_inclusive():
    # 90 large good elements keep the relative L2 small; bad elements: abs 2 > 1 and rel 2 > 0.3.
    def case(n_bad: int) -> OutputStats:
        ref = torch.cat([torch.full((100 - n_bad,), 1000.0), torch.ones(n_bad)])
        out = torch.cat([torch.full((100 - n_bad,), 1000.0), torch.full((n_bad,), 3.0)])
        return one(MOE_RULE, out.to(torch.bfloat16), ref.to(torch.bfloat16))

    at_threshold = case(10)
    assert at_threshold.passed and at_threshold.matched_ratio == 0.9 and at_threshold.bad_count == 10
    assert at_threshold.relative_l2 < MOE_RULE.max_relative_l2
    below = case(11)
    assert not below.passed and below.matched_ratio == pytest.approx(0.89)
    assert "matched_ratio 0.89 < 0.9" in below.reason


def test_moe_relative_l2_bound():
    ref = torch.ones(64)
    loose = one(MOE_RULE, ref * 1.5, ref)  # every element within atol 1, but 50 % L2 error
    assert loose.matched_ratio == 1.0 and loose.relative_l2 == pytest.approx(0.5)
    assert not loose.passed and loose.reason == f"relative L2 0.5 > {MOE_RULE.max_relative_l2}"
    assert one(MOE_RATIO_ONLY, ref * 1.5, ref).passed  # the contest rule alone lets it through
    close = one(MOE_RULE, ref * 1.005, ref)
    assert close.passed and close.relative_l2 == pytest.approx(0.005, rel=1e-5)


def test_relative_l2_of_zero_reference():
    zeros = torch.zeros(5)
    assert one(MOE_RULE, zeros, zeros).relative_l2 == 0.0
    stats = one(MOE_RULE, t([0, 0, 0, 0, 0.5]), zeros)
    assert stats.relative_l2 == INF and not stats.passed
    assert "Infinity" in stats.model_dump_json()  # inf survives JSON as a string


# --- non-finite values ----------------------------------------------------------------------------


def test_nan_in_output_fails_even_under_a_ratio():
    ref = torch.ones(100)
    out = ref.clone()
    out[7] = math.nan
    for rule in (GDN, MOE_RATIO_ONLY):
        stats = one(rule, out, ref)
        assert not stats.passed and stats.nan_count == 1 and stats.bad_count == 1
        assert stats.reason.startswith("1 NaN in the output")
        assert math.isfinite(stats.max_abs_err)


def test_nan_in_reference_fails():
    stats = one(GDN, t([1.0, 2.0]), t([1.0, math.nan]))
    assert not stats.passed and "NaN in the reference" in stats.reason and stats.nan_count == 0


def test_matching_negative_inf_passes():
    # DSA: the lse of a row with no valid index is -inf on both sides.
    lse = t([[-INF, -INF], [1.5, 2.0]])
    stats = one(DSA, lse.clone(), lse)
    assert stats.passed and stats.inf_mismatch_count == 0 and stats.bad_count == 0
    assert stats.max_abs_err == 0.0 and stats.relative_l2 == 0.0


def test_opposite_inf_fails():
    stats = one(DSA, t([INF, 1.0]), t([-INF, 1.0]))
    assert not stats.passed and stats.inf_mismatch_count == 1
    assert "1 inf in the output where the reference differs" in stats.reason


def test_inf_where_reference_is_finite_fails_even_under_a_ratio():
    ref = torch.ones(100)
    out = ref.clone()
    out[3] = -INF
    stats = one(MOE_RATIO_ONLY, out, ref)
    assert not stats.passed and stats.inf_mismatch_count == 1
    assert stats.matched_ratio == pytest.approx(0.99)  # passes the ratio, fails the inf rule


def test_finite_output_where_reference_is_inf_is_a_bad_element():
    stats = one(DSA, t([-30.0, 1.0]), t([-INF, 1.0]))
    assert not stats.passed and stats.bad_count == 1 and stats.inf_mismatch_count == 1
    assert "finite where the reference is inf" in stats.reason
    # Under a ratio it is one bad element among many, not an outright failure.
    ref = torch.ones(100)
    ref[0] = -INF
    out = torch.ones(100)
    loose = one(MOE_RATIO_ONLY, out, ref)
    assert loose.passed and loose.bad_count == 1 and loose.matched_ratio == pytest.approx(0.99)


# --- structure ------------------------------------------------------------------------------------


def test_shape_mismatch_fails_clearly():
    stats = one(GDN, torch.zeros(2, 3), torch.zeros(3, 2))
    assert not stats.passed and stats.reason == "shape (2, 3) differs from the reference's (3, 2)"
    assert stats.max_abs_err is None and stats.matched_ratio is None


def test_dtype_mismatch_fails_clearly():
    stats = one(GDN, torch.zeros(4, dtype=torch.float32), torch.zeros(4, dtype=torch.bfloat16))
    assert not stats.passed and stats.reason == "dtype torch.float32 differs from the reference's torch.bfloat16"


def test_missing_and_non_tensor_outputs_fail():
    ref = {"output": torch.zeros(2, 2), "lse": torch.zeros(2)}
    verdict = check_outputs(DSA, {"output": torch.zeros(2, 2)}, ref)
    assert not verdict.passed and verdict.outputs["output"].passed
    assert verdict.reason == "lse: missing from the solution's outputs"
    verdict = check_outputs(DSA, {"output": torch.zeros(2, 2), "lse": [0.0, 0.0]}, ref)
    assert verdict.reason == "lse: the output is a list, not a tensor"
    verdict = check_outputs(DSA, {"output": torch.zeros(2, 2), "lse": torch.zeros(2)}, {"output": ref["output"]})
    assert verdict.reason == "lse: missing from the reference outputs"


def test_every_named_output_is_checked_and_extras_ignored():
    ref = {"output": torch.ones(3, 4), "new_state": torch.ones(2, 2)}
    out = {"output": torch.ones(3, 4), "new_state": torch.full((2, 2), 2.0), "debug": torch.zeros(1)}
    verdict = check_outputs(GDN, out, ref)
    assert set(verdict.outputs) == {"output", "new_state"}
    assert not verdict.passed and verdict.reason.startswith("new_state: 4 of 4 elements out of tolerance")
    assert "\n" not in verdict.reason


def test_empty_output_passes():
    stats = one(GDN, torch.zeros(0, 8), torch.zeros(0, 8))
    assert stats.passed and stats.matched_ratio == 1.0 and stats.numel == 0


def test_chunked_statistics_equal_unchunked(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    ref = (torch.randn(37, 29, generator=gen) * 4).to(torch.bfloat16)
    out = (ref.float() + torch.randn(37, 29, generator=gen) * 0.5).to(torch.bfloat16)
    out[0, 0] = -INF
    ref[0, 0] = -INF
    whole = one(MOE_RATIO_ONLY, out, ref)
    monkeypatch.setattr(acceptance, "CHUNK_ELEMENTS", 50)
    chunked = one(MOE_RATIO_ONLY, out, ref)
    assert chunked.model_dump(exclude={"relative_l2"}) == whole.model_dump(exclude={"relative_l2"})
    assert chunked.relative_l2 == pytest.approx(whole.relative_l2, rel=1e-12)


def test_non_contiguous_output_is_compared_elementwise():
    ref = torch.arange(12.0).reshape(3, 4)
    out = ref.t().contiguous().t()  # same values, transposed strides
    assert not out.is_contiguous()
    assert one(GDN, out, ref).passed


def test_finite_statistics_match_the_flashinfer_bench_rule():
    from flashinfer_bench.bench.utils import compute_error_stats

    gen = torch.Generator().manual_seed(2)
    ref = (torch.randn(256, 64, generator=gen) * 3).to(torch.bfloat16)
    out = (ref.float() * (1 + torch.randn(256, 64, generator=gen) * 0.2) + torch.randn(256, 64, generator=gen)).to(
        torch.bfloat16
    )
    for rule in (GDN, MOE_RATIO_ONLY):
        cfg = SimpleNamespace(atol=rule.atol, rtol=rule.rtol, required_matched_ratio=rule.required_matched_ratio)
        fib_abs, fib_rel, fib_fails, fib_ratio = compute_error_stats(out, ref, cfg)
        ours = one(rule, out, ref)
        assert ours.matched_ratio == fib_ratio
        assert ours.passed == (not fib_fails)
        assert ours.max_abs_err == pytest.approx(fib_abs, rel=1e-6)
        assert ours.max_rel_err == pytest.approx(fib_rel, rel=1e-6)
    assert 0.0 < one(GDN, out, ref).matched_ratio < 1.0  # the data exercises the rule


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_output_against_cpu_reference():
    ref = torch.randn(1000, 64).to(torch.bfloat16)
    out = ref.cuda()
    out[5, 5] = math.nan
    stats = one(GDN, out, ref)
    assert not stats.passed and stats.nan_count == 1
    assert one(GDN, ref.cuda(), ref).passed


# --- verdicts over trials -------------------------------------------------------------------------


def _trial(scale: float) -> Verdict:
    ref = {"output": torch.ones(10), "lse": torch.zeros(4)}
    out = {"output": torch.ones(10) * scale, "lse": torch.zeros(4)}
    return check_outputs(DSA, out, ref)


def test_merge_keeps_the_worst_and_fails_if_any_trial_fails():
    trials = [_trial(1.0), _trial(1.5), _trial(1.001)]
    merged = merge_verdicts(trials)
    assert not merged.passed
    assert merged.reason == f"trial 1: {trials[1].reason}"
    output = merged.outputs["output"]
    assert output.max_abs_err == max(v.outputs["output"].max_abs_err for v in trials)
    assert output.matched_ratio == min(v.outputs["output"].matched_ratio for v in trials) == 0.0
    assert output.reason.startswith("trial 1: 10 of 10 elements")
    assert merged.outputs["lse"].passed


def test_merge_of_passing_trials_passes():
    merged = merge_verdicts([_trial(1.0), _trial(1.001)])
    assert merged.passed and merged.reason is None
    assert merged.outputs["output"].max_abs_err == pytest.approx(0.001, rel=1e-3)


def test_merge_handles_uncompared_outputs_and_rejects_an_empty_list():
    reference = {"output": torch.ones(10), "lse": torch.zeros(4)}
    shape_fail = check_outputs(DSA, {"output": torch.ones(3), "lse": torch.zeros(4)}, reference)
    merged = merge_verdicts([_trial(1.0), shape_fail])
    assert not merged.passed and merged.outputs["output"].max_abs_err == 0.0
    assert merged.reason.startswith("trial 1: output: shape (3,)")
    with pytest.raises(ValueError):
        merge_verdicts([])


def test_verdict_serialises_to_json():
    data = json.loads(_trial(1.5).model_dump_json())
    assert data["passed"] is False and data["outputs"]["output"]["bad_count"] == 10
    assert Verdict.model_validate(data) == _trial(1.5)


def test_only_our_kernel_answers_to_the_stricter_moe_bound() -> None:
    """The human and library sides are judged by the contest rule; the 1e-2 relative L2 is our own bar."""
    assert MOE.acceptance.max_relative_l2 is None
    assert MOE.acceptance_for("ours").max_relative_l2 == 1e-2
    for kind in ("human", "reference", "library"):
        assert MOE.acceptance_for(kind) == MOE.acceptance
    assert DSA_ATTENTION.acceptance_for("ours") == DSA_ATTENTION.acceptance
