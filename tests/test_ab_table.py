"""tools/ab_table.py: a candidate's A/B statistics against a base side in one results file."""

from __future__ import annotations

from pathlib import Path

import pytest

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT
from hopperbench.results import SideResult, Status, read_results
from tests.test_compare_runs import write_run

ab_table = load_module_by_path(REPO_ROOT / "tools/ab_table.py", "ab_table")


def timed(side: str, per_trial_ms: list[float]) -> SideResult:
    ordered = sorted(per_trial_ms)
    return SideResult(side=side, status=Status.PASSED, latency_ms=ordered[len(ordered) // 2], min_ms=ordered[0],
                      max_ms=ordered[-1], per_trial_ms=per_trial_ms)  # fmt: skip


def test_paired_ratios_use_every_trial_where_the_ratio_of_medians_is_one_trials(tmp_path: Path, capsys) -> None:
    # Trials of very different latency (different routings): the median trial (index 0) barely moves, the rest gain 5 %.
    ours = timed("ours", [3.0, 2.0, 4.0, 1.0, 5.0])
    cand = timed("cand_x", [3.0 / 1.002, 2.0 / 1.05, 4.0 / 1.05, 1.0 / 1.05, 5.0 / 1.05])
    path = write_run(tmp_path / "ab.json", {4: [ours, cand]})
    (row,) = ab_table.ab_rows(read_results(path), "ours", None)
    assert row.ratio_of_medians == pytest.approx(1.002)
    assert row.paired_median == pytest.approx(1.05)
    assert row.trials_faster == 5
    assert ab_table.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "cand_x" in out and "1.002" in out and "1.050" in out and "5/5" in out


def test_rows_without_both_sides_timed_are_left_out_and_sides_are_chosen(tmp_path: Path) -> None:
    failed = SideResult(side="cand_y", status=Status.FAILED, message="mismatch")
    path = write_run(
        tmp_path / "ab.json",
        {
            0: [timed("ours", [1.0, 2.0]), timed("cand_x", [0.5, 1.0]), failed],
            1: [timed("ours", [1.0, 1.0]), timed("cand_y", [2.0, 2.0])],
        },
    )
    rows = ab_table.ab_rows(read_results(path), "ours", None)
    assert [(r.index, r.side) for r in rows] == [(0, "cand_x"), (1, "cand_y")]
    assert rows[0].paired == (2.0, 2.0) and rows[1].trials_faster == 0
    assert [r.side for r in ab_table.ab_rows(read_results(path), "ours", ["cand_y"])] == ["cand_y"]


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    path = write_run(tmp_path / "ab.json", {0: [timed("ours", [1.0]), timed("cand_x", [1.0])]})
    assert ab_table.main([str(path), "--sides", "cand_nope"]) == 2
    assert ab_table.main([str(path), "--base", "nobody"]) == 2
    assert ab_table.main([str(tmp_path / "absent.json")]) == 2
    uneven = write_run(tmp_path / "uneven.json", {0: [timed("ours", [1.0, 1.0]), timed("cand_x", [1.0])]})
    assert ab_table.main([str(uneven)]) == 2
    only_ours = write_run(tmp_path / "only.json", {0: [timed("ours", [1.0])]})
    assert ab_table.main([str(only_ours)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 5 and all(line.startswith("ab_table: ") for line in errors)
