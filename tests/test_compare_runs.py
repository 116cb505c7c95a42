"""tools/compare_runs.py: the repeatability check between a canonical run and its repeat."""

from __future__ import annotations

from pathlib import Path

import pytest

from hopperbench import report
from hopperbench.devcheck import load_module_by_path
from hopperbench.environment import EnvironmentRecord
from hopperbench.paths import REPO_ROOT
from hopperbench.results import GraphStatus, SideResult, Status, WorkloadKey, WorkloadRow, write_results

compare_runs = load_module_by_path(REPO_ROOT / "tools/compare_runs.py", "compare_runs")


def timed(side: str, ms: float, graph: float | None = None, busy: float | None = None, spread: float = 0.0) -> SideResult:
    """A passed side: eager span `ms`; with `graph`, replayed from a graph at that span (busy: `busy` or the span)."""
    fields: dict[str, object] = {}
    if graph is not None:
        fields = {"graph_status": GraphStatus.PASSED, "graph_ms": graph, "graph_busy_ms": graph if busy is None else busy}
    return SideResult(side=side, status=Status.PASSED, latency_ms=ms, min_ms=ms * (1 - spread / 2),
                      max_ms=ms * (1 + spread / 2), **fields)  # fmt: skip


def write_run(path: Path, sides_by_index: dict[int, list[SideResult]], absent: dict[int, list[str]] | None = None) -> Path:
    """Rows of track moe, workload i with `sides_by_index[i]` (and the optional inputs `absent[i]` withheld)."""
    rows = [
        WorkloadRow.from_sides(
            WorkloadKey(track="moe", definition="d", uuid=f"u{i}", index=i, axes={"seq_len": 1},
                        data_source="synthesized", seed=0, absent_inputs=(absent or {}).get(i, [])),  # fmt: skip
            {s.side: s for s in sides},
        )
        for i, sides in sides_by_index.items()
    ]
    write_results(path, EnvironmentRecord(), rows)
    return path


def test_graph_spans_within_tolerance_pass_and_eager_spans_are_only_shown(tmp_path: Path, capsys) -> None:
    a = write_run(tmp_path / "a.json", {0: [timed("ours", 0.3, 0.2, spread=0.1), timed("reference", 5.0)],
                                        1: [timed("ours", 0.012, 0.010)]})  # fmt: skip
    b = write_run(tmp_path / "b.json", {0: [timed("ours", 0.45, 0.201), timed("reference", 9.0)],
                                        1: [timed("ours", 0.013, 0.011)]})  # fmt: skip
    assert compare_runs.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    # The eager span moved 50 % and is shown with run 1's spread; the graph span moved 0.5 %.
    assert "+50.0%" in out and "10.0%" in out and "+0.5%" in out
    assert "eager only (not judged)" in out  # the reference
    assert "not judged (fast)" in out  # a graph span below 20 us
    assert "1 of 1 judged rows: graph span and busy time within 3 %" in out
    assert "moe ours: graph span geomean change +0.50% over 1 rows (ok)" in out


def test_a_graph_span_or_busy_time_over_tolerance_fails_and_names_its_side(tmp_path: Path, capsys) -> None:
    a = write_run(tmp_path / "a.json", {0: [timed("ours", 0.3, 0.2), timed("fla", 1.0, 0.5, busy=0.4)]})
    b = write_run(tmp_path / "b.json", {0: [timed("ours", 0.3, 0.2), timed("fla", 1.0, 0.5, busy=0.44)]})
    assert compare_runs.main([str(a), str(b)]) == 1  # fla's busy time moved 10 %
    out = capsys.readouterr().out
    assert "OVER" in out and "over: fla" in out and "1 of 2 judged rows" in out
    assert compare_runs.main([str(a), str(b), "--tolerance", "15"]) == 0


def test_a_row_over_tolerance_shows_its_graph_span_per_trial(tmp_path: Path, capsys) -> None:
    def trials(ms: list[float]) -> SideResult:
        return timed("ours", 0.07, sorted(ms)[1]).model_copy(update={"per_trial_graph_ms": ms})

    a = write_run(tmp_path / "a.json", {0: [trials([0.0613, 0.0622, 0.0723])]})
    b = write_run(tmp_path / "b.json", {0: [trials([0.0614, 0.0650, 0.0724])]})
    assert compare_runs.main([str(a), str(b)]) == 1  # the middle trial moved 4.5 %
    out = capsys.readouterr().out
    assert "  over: moe 0 all inputs ours, graph span per trial (ms): [0.0613, 0.0622, 0.0723] -> [0.0614, 0.065, 0.0724]" in out


def test_a_side_whose_rows_pass_can_still_fail_on_its_mean(tmp_path: Path, capsys) -> None:
    # Every row 2 % slower: each within 3 %, the side's geometric mean not within 1 %.
    a = write_run(tmp_path / "a.json", {i: [timed("ours", 0.1, 0.1)] for i in range(4)})
    b = write_run(tmp_path / "b.json", {i: [timed("ours", 0.1, 0.102)] for i in range(4)})
    assert compare_runs.main([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "4 of 4 judged rows" in out and "geomean change +2.00% over 4 rows (OVER)" in out


def test_only_rows_timed_in_both_runs_are_compared(tmp_path: Path) -> None:
    failed = SideResult(side="fla", status=Status.FAILED, message="mismatch")
    a = write_run(tmp_path / "a.json", {0: [timed("ours", 0.3, 0.3), timed("fla", 1.0)], 1: [timed("ours", 0.2)]})
    b = write_run(tmp_path / "b.json", {0: [timed("ours", 0.3), failed]})
    rows = compare_runs.compare(compare_runs.read_results(a), compare_runs.read_results(b), min_ms=0.02)
    assert [(c.index, c.side) for c in rows] == [(0, "ours")]
    # Run 2 did not replay it: the graph columns are empty and the row is not judged.
    assert rows[0].change == pytest.approx(0.0) and rows[0].graph_change is None and not rows[0].judged


def test_unreadable_or_disjoint_runs_exit_2(tmp_path: Path, capsys) -> None:
    a = write_run(tmp_path / "a.json", {0: [timed("ours", 0.3)]})
    other = write_run(tmp_path / "b.json", {5: [timed("ours", 0.3)]})
    assert compare_runs.main([str(a), str(other)]) == 2
    (tmp_path / "bad.json").write_text("{}")
    assert compare_runs.main([str(a), str(tmp_path / "bad.json")]) == 2
    assert compare_runs.main([str(a), str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert all(len(line) < 300 for line in err.splitlines()) and "share no timed" in err


def test_a_workload_and_its_no_state_twin_are_paired_with_their_own_rows(tmp_path: Path, capsys) -> None:
    def run(path: Path, own_ms: float, twin_ms: float) -> Path:
        def gdn(absent: list[str], ms: float) -> WorkloadRow:
            key = WorkloadKey(track="gdn_prefill", definition="d", uuid="u0", index=0, axes={"total_seq_len": 6},
                              data_source="synthesized", seed=0, absent_inputs=absent)  # fmt: skip
            return WorkloadRow.from_sides(key, {"ours": timed("ours", ms, ms)})

        write_results(path, EnvironmentRecord(), [gdn([], own_ms), gdn(["state"], twin_ms)])
        return path

    a, b = run(tmp_path / "a.json", 0.1, 0.2), run(tmp_path / "b.json", 0.1, 0.2)
    rows = compare_runs.compare(compare_runs.read_results(a), compare_runs.read_results(b), min_ms=0.02)
    assert [(c.absent_inputs, c.first_ms, c.second_ms) for c in rows] == [((), 0.1, 0.1), (("state",), 0.2, 0.2)]
    assert compare_runs.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "all inputs" in out and "no state" in out and "2 of 2 judged rows" in out


def test_readme_summary_counts_judged_rows_names_the_sides_over_and_their_twins(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a.json", {0: [timed("ours", 0.3, 0.2), timed("fla", 1.0, 0.5)],
                                        1: [timed("ours", 0.3, 0.2), timed("fla", 1.0, 0.5)],
                                        2: [timed("ours", 0.01, 0.01)]}, absent={1: ["state"]})  # fmt: skip
    b = write_run(tmp_path / "b.json", {0: [timed("ours", 0.3, 0.2), timed("fla", 1.0, 0.52)],
                                        1: [timed("ours", 0.3, 0.2), timed("fla", 1.0, 0.47)],
                                        2: [timed("ours", 0.01, 0.02)]}, absent={1: ["state"]})  # fmt: skip
    lines = report.repeat_markdown(compare_runs.read_results(a), compare_runs.read_results(b))
    assert len(lines) == 3 and lines[0].startswith("| track | GPU | rows judged | within 3% |")
    # Five judged rows (row 2 is fast in run 1 but 20 us in run 2: judged, and 100 % over).
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:4] == ["`moe`", "not recorded", "5", "2"]
    assert "`fla` 2 (1), -6.0%" in cells[4] and "`ours` 1 (0), +100.0%" in cells[4]
    assert "`fla` -1.13% (2) **over**" in cells[5]  # sqrt(1.04 x 0.94) - 1
    assert report.repeat_markdown(compare_runs.read_results(a), compare_runs.read_results(a))[2].count("none") == 1


def test_the_gpu_column_says_whether_the_repeat_ran_on_the_same_board(tmp_path: Path, capsys) -> None:
    def run(path: Path, uuid: str | None) -> Path:
        row = WorkloadRow.from_sides(
            WorkloadKey(track="moe", definition="d", uuid="u0", index=0, axes={"seq_len": 1},
                        data_source="synthesized", seed=0, absent_inputs=[]),  # fmt: skip
            {"ours": timed("ours", 0.3, 0.2)},
        )
        write_results(path, EnvironmentRecord(gpu_uuid=uuid), [row])
        return path

    a, b, c = run(tmp_path / "a.json", "GPU-1"), run(tmp_path / "b.json", "GPU-1"), run(tmp_path / "c.json", "GPU-2")
    cell = {name: report.repeat_markdown(compare_runs.read_results(a), compare_runs.read_results(other))[2].split("|")[2]
            for name, other in (("same", b), ("another", c))}  # fmt: skip
    assert {name: text.strip() for name, text in cell.items()} == {"same": "same", "another": "another"}
    assert compare_runs.main([str(a), str(c)]) == 0
    assert "moe: GPU another (GPU-1 -> GPU-2)" in capsys.readouterr().out


def test_readme_summary_names_a_canonical_track_the_repeat_lacks(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a.json", {0: [timed("ours", 0.3, 0.2)]})
    results = compare_runs.read_results(a)
    env = EnvironmentRecord(repo_commit="c" * 40)
    gdn = WorkloadRow.from_sides(
        WorkloadKey(track="gdn_prefill", definition="d", uuid="g0", index=0, axes={"total_seq_len": 6},
                    data_source="synthesized", seed=0, absent_inputs=[]),  # fmt: skip
        {"ours": timed("ours", 0.3, 0.2)},
    )
    canonical = write_results(tmp_path / "c.json", env, [gdn, *results.rows])
    lines = report.repeat_markdown(canonical, results)
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["`gdn_prefill`", "`moe`"]
    assert "not repeated since its canonical run (canonical at `cccccccccc`)" in lines[2]
