"""tools/compare_runs.py: the runner's repeatability check between two results files."""

from __future__ import annotations

from pathlib import Path

import pytest

from hopperbench.devcheck import load_module_by_path
from hopperbench.environment import EnvironmentRecord
from hopperbench.paths import REPO_ROOT
from hopperbench.results import SideResult, Status, WorkloadKey, WorkloadRow, write_results

compare_runs = load_module_by_path(REPO_ROOT / "tools/compare_runs.py", "compare_runs")


def timed(side: str, ms: float, spread: float = 0.0) -> SideResult:
    return SideResult(side=side, status=Status.PASSED, latency_ms=ms, min_ms=ms * (1 - spread / 2),
                      max_ms=ms * (1 + spread / 2))  # fmt: skip


def write_run(path: Path, sides_by_index: dict[int, list[SideResult]]) -> Path:
    rows = [
        WorkloadRow.from_sides(
            WorkloadKey(track="moe", definition="d", uuid=f"u{i}", index=i, axes={"seq_len": 1},
                        data_source="synthesized", seed=0),  # fmt: skip
            {s.side: s for s in sides},
        )
        for i, sides in sides_by_index.items()
    ]
    write_results(path, EnvironmentRecord(), rows)
    return path


def test_rows_within_tolerance_pass_and_fast_rows_are_not_judged(tmp_path: Path, capsys) -> None:
    a = write_run(tmp_path / "a.json", {0: [timed("ours", 0.3, 0.1), timed("reference", 0.01)]})
    b = write_run(tmp_path / "b.json", {0: [timed("ours", 0.309), timed("reference", 0.02)]})
    assert compare_runs.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "+3.0%" in out and "10.0%" in out  # the change, and run 1's spread over trials
    assert "not judged (fast)" in out and "1 of 1 judged rows within 5 %" in out


def test_a_row_over_tolerance_fails_and_names_its_side(tmp_path: Path, capsys) -> None:
    a = write_run(tmp_path / "a.json", {0: [timed("ours", 0.3), timed("fla", 1.0)], 1: [timed("ours", 0.2)]})
    b = write_run(tmp_path / "b.json", {0: [timed("ours", 0.3), timed("fla", 0.9)], 1: [timed("ours", 0.2)]})
    assert compare_runs.main([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "OVER" in out and "over: fla" in out and "2 of 3 judged rows" in out
    assert compare_runs.main([str(a), str(b), "--tolerance", "15"]) == 0


def test_only_rows_timed_in_both_runs_are_compared(tmp_path: Path) -> None:
    failed = SideResult(side="fla", status=Status.FAILED, message="mismatch")
    a = write_run(tmp_path / "a.json", {0: [timed("ours", 0.3), timed("fla", 1.0)], 1: [timed("ours", 0.2)]})
    b = write_run(tmp_path / "b.json", {0: [timed("ours", 0.3), failed]})
    rows = compare_runs.compare(compare_runs.read_results(a), compare_runs.read_results(b), min_ms=0.05)
    assert [(c.index, c.side) for c in rows] == [(0, "ours")]
    assert rows[0].change == pytest.approx(0.0)


def test_unreadable_or_disjoint_runs_exit_2(tmp_path: Path, capsys) -> None:
    a = write_run(tmp_path / "a.json", {0: [timed("ours", 0.3)]})
    other = write_run(tmp_path / "b.json", {5: [timed("ours", 0.3)]})
    assert compare_runs.main([str(a), str(other)]) == 2
    (tmp_path / "bad.json").write_text("{}")
    assert compare_runs.main([str(a), str(tmp_path / "bad.json")]) == 2
    assert compare_runs.main([str(a), str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert all(len(line) < 300 for line in err.splitlines()) and "share no timed" in err


def test_each_runs_gpu_busy_share_is_shown_where_recorded(tmp_path: Path, capsys) -> None:
    host_bound = timed("fla", 1.0).model_copy(update={"busy_ms": 0.25})
    a = write_run(tmp_path / "a.json", {0: [host_bound, timed("ours", 0.3)]})
    b = write_run(tmp_path / "b.json", {0: [timed("fla", 1.0).model_copy(update={"busy_ms": 0.2}), timed("ours", 0.3)]})
    rows = compare_runs.compare(compare_runs.read_results(a), compare_runs.read_results(b), min_ms=0.05)
    by_side = {c.side: c for c in rows}
    fla, ours = by_side["fla"], by_side["ours"]
    assert (fla.first_busy, fla.second_busy) == (pytest.approx(0.25), pytest.approx(0.2))
    assert ours.first_busy is None  # a run that predates the busy time
    compare_runs.main([str(a), str(b)])
    fla_line = next(line for line in capsys.readouterr().out.splitlines() if " fla " in line)
    assert "25%" in fla_line and "20%" in fla_line


def test_the_busy_time_change_separates_host_time_from_gpu_time(tmp_path: Path, capsys) -> None:
    # A host-bound side whose span moves 50 % while its GPU work stays put: the table and the last
    # line say the GPU time repeated.
    a = write_run(tmp_path / "a.json", {0: [timed("fla", 1.0).model_copy(update={"busy_ms": 0.1})]})
    b = write_run(tmp_path / "b.json", {0: [timed("fla", 1.5).model_copy(update={"busy_ms": 0.101})]})
    rows = compare_runs.compare(compare_runs.read_results(a), compare_runs.read_results(b), min_ms=0.05)
    assert rows[0].busy_change == pytest.approx(0.01) and rows[0].change == pytest.approx(0.5)
    assert compare_runs.main([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "+1.0%" in out and "OVER" in out
    assert "GPU-busy time of 1 rows within 1.0% between the runs" in out
    no_busy = write_run(tmp_path / "c.json", {0: [timed("fla", 1.0)]})
    assert compare_runs.compare(compare_runs.read_results(no_busy), compare_runs.read_results(b), 0.05)[0].busy_change is None
