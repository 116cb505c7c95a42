"""The correctness gate: the contest's acceptance rule plus our explicit inf/nan rules.

Contest rule (harness_facts.md §4.2): both tensors are cast to fp32; with
`abs_err = |out - ref|` and `rel_err = abs_err / (|ref| + 1e-8)` an element is bad only
when `abs_err > atol` and `rel_err > rtol`; `matched_ratio = 1 - bad / numel` must be at
least `required_matched_ratio`.

Our rules for non-finite values, stated instead of inherited from NaN comparison quirks:
- a NaN anywhere in the output fails the output;
- an inf in the output is good only where the reference holds the same inf (the DSA
  lse of a row with no valid index is -inf); any other inf fails the output, as the
  contest fails every inf;
- a finite output where the reference is inf is a bad element (the contest would count
  it as matched, because inf/inf is NaN and NaN comparisons are false);
- a NaN in the reference makes the output unjudgeable, so it fails.
Errors and the relative L2 are taken over elements where both sides are finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict

from hopperbench.tracks import AcceptanceRule

REL_EPS = 1e-8
# Elements per chunk: bounds the fp32/fp64 temporaries to about 250 MB whatever the output size.
CHUNK_ELEMENTS = 1 << 22


class OutputStats(BaseModel):
    """One output's comparison. The statistics are None when it could not be compared
    (missing, not a tensor, shape or dtype mismatch)."""

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="strings")

    passed: bool
    reason: str | None = None
    numel: int | None = None
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    relative_l2: float | None = None
    matched_ratio: float | None = None
    bad_count: int | None = None
    nan_count: int | None = None
    inf_mismatch_count: int | None = None


class Verdict(BaseModel):
    model_config = ConfigDict(frozen=True, ser_json_inf_nan="strings")

    passed: bool
    reason: str | None = None  # one line
    outputs: dict[str, OutputStats]


@dataclass
class _Tally:
    """Running totals over chunks of one output."""

    numel: int = 0
    good: int = 0
    nan: int = 0
    reference_nan: int = 0
    output_inf_mismatch: int = 0
    reference_inf_mismatch: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    diff_sq: float = 0.0
    ref_sq: float = 0.0

    def add_chunk(self, out: torch.Tensor, ref: torch.Tensor, rule: AcceptanceRule) -> None:
        o = out.to(torch.float32)
        r = ref.to(device=o.device, dtype=torch.float32)
        o_finite, r_finite = o.isfinite(), r.isfinite()
        both_finite = o_finite & r_finite
        o_inf, r_inf = o.isinf(), r.isinf()

        # The contest's element test, in fp32 as the contest computes it.
        abs_err = (o - r).abs()
        rel_err = abs_err / (r.abs() + REL_EPS)
        within = ~((abs_err > rule.atol) & (rel_err > rule.rtol))
        good = (both_finite & within) | (o_inf & (o == r))

        zero = torch.zeros((), dtype=torch.float32, device=o.device)
        finite_abs = torch.where(both_finite, abs_err, zero)
        finite_rel = torch.where(both_finite, rel_err, zero)
        # The L2 sums run in float64: over ~1e8 elements fp32 accumulation would drift.
        ref_finite = torch.where(both_finite, r, zero).double()
        diff = torch.where(both_finite, o, zero).double() - ref_finite

        counts = torch.stack(
            [
                good.sum(),
                o.isnan().sum(),
                r.isnan().sum(),
                (o_inf & (o != r)).sum(),
                (r_inf & o_finite).sum(),
            ]
        ).tolist()
        self.numel += o.numel()
        self.good += counts[0]
        self.nan += counts[1]
        self.reference_nan += counts[2]
        self.output_inf_mismatch += counts[3]
        self.reference_inf_mismatch += counts[4]
        if o.numel():
            self.max_abs = max(self.max_abs, finite_abs.max().item())
            self.max_rel = max(self.max_rel, finite_rel.max().item())
        self.diff_sq += diff.square().sum().item()
        self.ref_sq += ref_finite.square().sum().item()

    def relative_l2(self) -> float:
        if self.ref_sq == 0.0:
            return 0.0 if self.diff_sq == 0.0 else math.inf
        return math.sqrt(self.diff_sq) / math.sqrt(self.ref_sq)

    def stats(self, rule: AcceptanceRule) -> OutputStats:
        bad = self.numel - self.good
        matched_ratio = 1.0 if self.numel == 0 else min(1.0, max(0.0, 1.0 - bad / self.numel))
        relative_l2 = self.relative_l2()
        failures = []
        if self.nan:
            failures.append(f"{self.nan} NaN in the output")
        if self.output_inf_mismatch:
            failures.append(f"{self.output_inf_mismatch} inf in the output where the reference differs")
        if self.reference_nan:
            failures.append(f"{self.reference_nan} NaN in the reference")
        if matched_ratio < rule.required_matched_ratio:
            inf_note = (
                f", {self.reference_inf_mismatch} finite where the reference is inf"
                if self.reference_inf_mismatch
                else ""
            )
            failures.append(
                f"{bad} of {self.numel} elements out of tolerance{inf_note} "
                f"(matched_ratio {matched_ratio:.10g} < {rule.required_matched_ratio})"
            )
        if rule.max_relative_l2 is not None and relative_l2 > rule.max_relative_l2:
            failures.append(f"relative L2 {relative_l2:.4g} > {rule.max_relative_l2}")
        return OutputStats(
            passed=not failures,
            reason="; ".join(failures) or None,
            numel=self.numel,
            max_abs_err=self.max_abs,
            max_rel_err=self.max_rel,
            relative_l2=relative_l2,
            matched_ratio=matched_ratio,
            bad_count=bad,
            nan_count=self.nan,
            inf_mismatch_count=self.output_inf_mismatch + self.reference_inf_mismatch,
        )


def _mismatch_reason(out: object, ref: object) -> str | None:
    if not isinstance(out, torch.Tensor):
        return f"the output is a {type(out).__name__}, not a tensor"
    if not isinstance(ref, torch.Tensor):
        return f"the reference is a {type(ref).__name__}, not a tensor"
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} differs from the reference's {tuple(ref.shape)}"
    if out.dtype != ref.dtype:
        return f"dtype {out.dtype} differs from the reference's {ref.dtype}"
    return None


def compare_output(rule: AcceptanceRule, out: torch.Tensor, ref: torch.Tensor) -> OutputStats:
    """Compare one output tensor with its reference under `rule`."""
    if reason := _mismatch_reason(out, ref):
        return OutputStats(passed=False, reason=reason)
    tally = _Tally()
    flat_out, flat_ref = out.reshape(-1), ref.reshape(-1)
    with torch.no_grad():
        for start in range(0, flat_out.numel(), CHUNK_ELEMENTS):
            stop = start + CHUNK_ELEMENTS
            tally.add_chunk(flat_out[start:stop], flat_ref[start:stop], rule)
    return tally.stats(rule)


def _verdict(outputs: dict[str, OutputStats]) -> Verdict:
    failing = [f"{name}: {stats.reason}" for name, stats in outputs.items() if not stats.passed]
    return Verdict(passed=not failing, reason="; ".join(failing) or None, outputs=outputs)


def check_outputs(
    rule: AcceptanceRule,
    outputs: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
) -> Verdict:
    """Judge every output the rule names; outputs the rule does not name are ignored."""
    results: dict[str, OutputStats] = {}
    for name in rule.outputs:
        if name not in outputs:
            results[name] = OutputStats(passed=False, reason="missing from the solution's outputs")
        elif name not in reference:
            results[name] = OutputStats(passed=False, reason="missing from the reference outputs")
        else:
            results[name] = compare_output(rule, outputs[name], reference[name])
    return _verdict(results)


def _merge_output(trials: list[tuple[int, OutputStats]]) -> OutputStats:
    first_failure = next(((i, s) for i, s in trials if not s.passed), None)

    def worst(name: str, pick: Callable[[list], float | int]) -> float | int | None:
        # Trials where the output could not be compared carry no statistics.
        present = [getattr(s, name) for _, s in trials if getattr(s, name) is not None]
        return pick(present) if present else None

    return OutputStats(
        passed=first_failure is None,
        reason=None if first_failure is None else f"trial {first_failure[0]}: {first_failure[1].reason}",
        numel=worst("numel", max),
        max_abs_err=worst("max_abs_err", max),
        max_rel_err=worst("max_rel_err", max),
        relative_l2=worst("relative_l2", max),
        matched_ratio=worst("matched_ratio", min),
        bad_count=worst("bad_count", max),
        nan_count=worst("nan_count", max),
        inf_mismatch_count=worst("inf_mismatch_count", max),
    )


def merge_verdicts(verdicts: Sequence[Verdict]) -> Verdict:
    """Combine the verdicts of several trials (list index = trial): the worst statistic
    of each output, failing if any trial failed."""
    if not verdicts:
        raise ValueError("merge_verdicts needs at least one verdict")
    per_output: dict[str, list[tuple[int, OutputStats]]] = {}
    for trial, verdict in enumerate(verdicts):
        for name, stats in verdict.outputs.items():
            per_output.setdefault(name, []).append((trial, stats))
    merged = {name: _merge_output(trials) for name, trials in per_output.items()}
    failed_trial = next((i for i, v in enumerate(verdicts) if not v.passed), None)
    if failed_trial is None:
        return Verdict(passed=True, reason=None, outputs=merged)
    reason = f"trial {failed_trial}: {verdicts[failed_trial].reason}"
    return Verdict(passed=False, reason=reason, outputs=merged)
