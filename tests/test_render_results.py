"""hopperbench/report.py on small synthetic runs, and tools/render_results.py against the
repository's own README.md and results/ (CPU only)."""

from __future__ import annotations

import csv
import importlib.util
import io
from pathlib import Path

import pytest

from hopperbench import report
from hopperbench.environment import EnvironmentRecord
from hopperbench.results import (
    GraphStatus,
    ResultsFile,
    SideResult,
    Status,
    WorkloadKey,
    WorkloadRow,
    summarize,
    write_results,
)
from hopperbench.tracks import TRACKS, SizeClasses

REPO_ROOT = Path(__file__).resolve().parents[1]


def _load_renderer():
    path = REPO_ROOT / "tools" / "render_results.py"
    spec = importlib.util.spec_from_file_location("render_results", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def side(
    name: str, ms: float | None, graph: float | GraphStatus | None = None, status: Status = Status.PASSED
) -> SideResult:
    """A side's result: `graph` a graph time (PASSED), a GraphStatus without time, or None."""
    if status != Status.PASSED or ms is None:
        return SideResult(side=name, status=status)
    fields: dict[str, object] = {}
    if isinstance(graph, float):
        fields = {"graph_status": GraphStatus.PASSED, "graph_ms": graph}
    elif isinstance(graph, GraphStatus):
        message = "capture failed" if graph == GraphStatus.NOT_CAPTURABLE else None
        fields = {"graph_status": graph, "graph_message": message}
    return SideResult(side=name, status=status, latency_ms=ms, per_trial_ms=[ms] * 3, **fields)


def workload(track: str, index: int, sides: list[SideResult], absent: list[str] | None = None) -> WorkloadRow:
    axes = {"gdn_prefill": {"total_seq_len": 64 * (index + 1), "num_seqs": 1, "len_cu_seqlens": 2},
            "moe": {"seq_len": index + 1}, "dsa_attention": {"num_tokens": index + 1, "num_pages": 8}}[track]  # fmt: skip
    key = WorkloadKey(track=track, definition=TRACKS[track].definition_name, uuid=f"{track}-{index:04d}", index=index,
                      axes=axes, data_source="synthesized", seed=0, absent_inputs=absent)  # fmt: skip
    return WorkloadRow.from_sides(key, {s.side: s for s in sides})


def results_of(rows: list[WorkloadRow], env: EnvironmentRecord | None = None) -> ResultsFile:
    return ResultsFile(environment=env or EnvironmentRecord(), rows=rows, summary=summarize(rows))


# ------------------------------------------------------------------------------------------
# report.py


def gdn_rows() -> list[WorkloadRow]:
    return [
        workload("gdn_prefill", 0, [side("ours", 1.0, 0.5), side("human", 4.0, GraphStatus.NOT_CAPTURABLE),
                                    side("flashinfer_gdn", 2.0, 1.0), side("fla_chunk", 8.0, 4.0)], absent=[]),  # fmt: skip
        workload("gdn_prefill", 1, [side("ours", 1.0, 0.25), side("human", 2.0, GraphStatus.NOT_CAPTURABLE),
                                    side("flashinfer_gdn", 8.0, 2.0), side("fla_chunk", 16.0, None)], absent=[]),  # fmt: skip
        # ours failed here: excluded from every mean with ours, kept in the others
        workload("gdn_prefill", 2, [side("ours", None, status=Status.FAILED), side("human", 1.0, GraphStatus.NOT_CAPTURABLE),
                                    side("flashinfer_gdn", 3.0, 3.0), side("fla_chunk", 3.0, 3.0)], absent=[]),  # fmt: skip
    ]


def test_gdn_headline_uses_flashinfer_and_geometric_means_of_per_workload_ratios() -> None:
    (h,) = report.headline(results_of(gdn_rows()))
    assert h.baseline == report.Baseline("flashinfer_gdn", "FlashInfer")
    # ours: eager 2/1 and 8/1 (workload 2 excluded: ours failed) -> 4; graph 1/0.5 and 2/0.25 -> 4.
    assert (h.ours.eager.geomean, h.ours.eager.workloads) == (pytest.approx(4.0), 2)
    assert (h.ours.graph.geomean, h.ours.graph.workloads) == (pytest.approx(4.0), 2)
    # human: 2/4, 8/2, 3/1 -> (0.5 * 4 * 3) ** (1/3); never graph-timed: the cell says why.
    assert h.human.eager.geomean == pytest.approx(6 ** (1 / 3)) and h.human.eager.workloads == 3
    assert h.human.graph == report.Ratio(None, 0, "NOT_CAPTURABLE")
    assert report.format_ratio(h.human.graph) == "n/a (NOT_CAPTURABLE)"
    # the other library: eager over all three, graph only where both were graph-timed (0 and 2).
    assert h.other_library.side == "fla_chunk"
    assert h.other_library.eager.geomean == pytest.approx((0.25 * 0.5 * 1.0) ** (1 / 3))
    assert (h.other_library.graph.geomean, h.other_library.graph.workloads) == (pytest.approx(0.5), 2)
    # ours over human: 4/1 and 2/1; graph: the human side has none.
    assert h.ours_vs_human.eager.geomean == pytest.approx(8**0.5) and h.ours_vs_human.eager.workloads == 2
    assert h.ours_vs_human.graph.note == "human NOT_CAPTURABLE"
    table = "\n".join(report.headline_markdown([h]))
    assert "| `gdn_prefill` (3) | `flashinfer_gdn` (FlashInfer) | `fla_chunk` | 0.50× (3) | 0.50× (2) |" in table
    assert "| 4.00× (2) | 4.00× (2) | 2.83× (2) | n/a (human NOT_CAPTURABLE) |" in table


def test_size_classes_label_and_place_workloads_at_their_bounds() -> None:
    classes = SizeClasses("total_seq_len", (40, 200))
    assert classes.labels() == ["<= 40", "41-200", "> 200"]
    assert [classes.index(v) for v in (1, 40, 41, 200, 201, 10**6)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="ascending"):
        SizeClasses("total_seq_len", (200, 40))


def test_by_size_rows_split_the_headline_and_show_the_smallest_ratio() -> None:
    # total_seq_len = 64 (index + 1): indices 0 and 1 are 41-200 tokens, index 70 is above 4000.
    rows = [
        workload("gdn_prefill", 0, [side("ours", 1.0, 0.5), side("flashinfer_gdn", 2.0, 1.0), side("human", 1.0, 1.0)]),
        workload("gdn_prefill", 1, [side("ours", 1.0, 0.5), side("flashinfer_gdn", 8.0, 2.0), side("human", 2.0, 1.0)]),
        workload("gdn_prefill", 70, [side("ours", 2.0, 2.0), side("flashinfer_gdn", 1.0, 1.0), side("human", 4.0, 4.0)]),
    ]
    small, large = report.size_rows("gdn_prefill", rows)
    assert (small.size, small.workloads, large.size, large.workloads) == ("41-200", 2, "> 4000", 1)
    assert small.baseline == large.baseline == "flashinfer_gdn"
    # eager 2/1 and 8/1: geomean 4, smallest 2; the large class is slower than the baseline.
    assert small.versus_baseline.eager == report.Ratio(pytest.approx(4.0), 2, minimum=pytest.approx(2.0))
    assert large.versus_baseline.graph.geomean == pytest.approx(0.5)
    assert report.format_ratio_with_minimum(small.versus_human.graph) == "2.00× (2; min 2.00×)"
    table = "\n".join(report.size_markdown(results_of(rows)))
    assert "| `gdn_prefill` | > 4000 (`total_seq_len`) | 1 | 0.50× (1; min 0.50×) | 0.50× (1; min 0.50×) |" in table
    assert report.size_rows("gdn_prefill", []) == []


def test_without_a_passing_flashinfer_the_fastest_library_is_the_baseline_named() -> None:
    rows = [workload("gdn_prefill", i, [side("ours", 1.0), side("flashinfer_gdn", None, status=Status.RUNTIME_ERROR),
                                        side("fla_chunk", 6.0), side("other_lib", 3.0)]) for i in range(2)]  # fmt: skip
    (h,) = report.headline(results_of(rows))
    assert h.baseline == report.Baseline("other_lib", "fastest library", "flashinfer_gdn RUNTIME_ERROR")
    assert h.other_library.side == "fla_chunk"  # the failed FlashInfer side is no candidate
    assert h.ours.eager.geomean == pytest.approx(3.0)
    assert h.ours.graph.note == "not attempted"


def test_libraries_rank_by_graph_time_so_host_gaps_do_not_pick_the_baseline() -> None:
    # host_bound: slow eager spans (launch gaps) around the faster kernels; never_graphed ranks last.
    dsa = [workload("dsa_attention", i, [side("ours", 0.01, 0.01), side("host_bound", 0.4, 0.03),
                                         side("tight", 0.2, 0.07), side("never_graphed", 0.1)]) for i in range(2)]  # fmt: skip
    assert [n for n, _ in report.rank_libraries(dsa, ["host_bound", "never_graphed", "tight"])] == [
        "host_bound", "tight", "never_graphed"]  # fmt: skip
    (h,) = report.headline(results_of(dsa))
    assert h.baseline == report.Baseline("host_bound", "fastest library")
    assert h.ours.graph.geomean == pytest.approx(3.0)


def test_without_flashinfer_moe_the_fastest_library_is_the_baseline_and_the_reference_is_never_one() -> None:
    moe = [workload("moe", i, [side("ours", 1.0), side("human", None, status=Status.UNAVAILABLE),
                               side("reference", 0.5), side("deepgemm_grouped", 10.0 * (i + 1)),
                               side("slow_lib", 40.0)]) for i in range(2)]  # fmt: skip
    dsa = [workload("dsa_attention", 0, [side("ours", 1.0), side("reference", 2.0)])]
    h_moe, h_dsa = report.headline(results_of(moe + dsa))
    assert h_moe.baseline == report.Baseline("deepgemm_grouped", "fastest library", "flashinfer_moe not run")
    assert h_moe.other_library.side == "slow_lib"
    assert h_moe.other_library.eager.geomean == pytest.approx((0.25 * 0.5) ** 0.5)
    assert h_moe.human.eager == report.Ratio(None, 0, "UNAVAILABLE")
    assert h_moe.ours_vs_human.eager.note == "human UNAVAILABLE"
    assert h_dsa.baseline.side is None and h_dsa.ours.eager.note == "no baseline"
    assert "| `dsa_attention` (1) | none passed | – | – | – |" in "\n".join(report.headline_markdown([h_dsa]))


def test_pass_lines_count_each_status_per_side() -> None:
    lines = report.pass_lines(gdn_rows())
    assert lines == [
        "`gdn_prefill` (3 workloads): ours 2 passed, 1 FAILED; human 3 passed; fla_chunk 3 passed;"
        " flashinfer_gdn 3 passed."
    ]


def test_the_headline_takes_the_rows_with_a_state_and_the_no_state_rows_are_a_table_of_their_own() -> None:
    with_state = gdn_rows()
    twins = [
        workload("gdn_prefill", 0, [side("ours", 2.0, 1.0), side("human", 4.0, 2.0), side("flashinfer_gdn", 8.0, 1.0),
                                    side("fla_chunk", 8.0, 4.0)], absent=["state"]),  # fmt: skip
        workload("gdn_prefill", 1, [side("ours", 1.0, 1.0), side("human", None, status=Status.RUNTIME_ERROR),
                                    side("flashinfer_gdn", 4.0, 1.0), side("fla_chunk", 8.0, 4.0)],
                 absent=["state"]),  # fmt: skip
    ]
    moe = [workload("moe", 0, [side("ours", 1.0), side("deepgemm_grouped", 2.0)], absent=[])]
    results = results_of([*with_state, *twins, *moe])
    assert report.headline_rows(results.rows) == [*with_state, *moe]
    assert report.absent_input_rows(results.rows) == twins
    # The headline is what it is without the twins.
    assert report.headline(results) == report.headline(results_of([*with_state, *moe]))
    assert report.size_markdown(results) == report.size_markdown(results_of([*with_state, *moe]))
    no_state = report.absent_input_markdown(results)
    # The by-size table's columns over the twins (41-200 tokens): ours over flashinfer_gdn 8/2 and
    # 4/1 eager, 1/1 graph; over human (which failed on one) 4/2 eager and 2/1 graph.
    assert no_state[:3] == [
        "| " + " | ".join(report.SIZE_HEADER) + " |",
        "|---|---|---|---|---|---|---|",
        "| `gdn_prefill` | 41-200 (`total_seq_len`) | 2 | 4.00× (2; min 4.00×) | 1.00× (2; min 1.00×)"
        " | 2.00× (1; min 2.00×) | 2.00× (1; min 2.00×) |",
    ]
    assert no_state[-2:] == ["", "- `gdn_prefill` (2 workloads): ours 2 passed; human 1 passed, 1 RUNTIME_ERROR;"
                             " fla_chunk 2 passed; flashinfer_gdn 2 passed."]  # fmt: skip
    assert report.absent_input_markdown(results_of([*with_state, *moe])) == []
    # A row that does not record its absent inputs, and a track without a sample, are headline rows.
    unrecorded = workload("gdn_prefill", 5, [side("ours", 1.0)], absent=None)
    moe_without = workload("moe", 1, [side("ours", 1.0)], absent=["state"])
    assert report.headline_rows([unrecorded, moe_without]) == [unrecorded, moe_without]
    # The views hold every row, a workload's own line before its twin's.
    human = _csv_lines(report.human_best_view([*twins, *with_state]))
    assert [(line["workload_index"], line["state_given"]) for line in human] == [
        ("0", "true"), ("0", "false"), ("1", "true"), ("1", "false"), ("2", "true")
    ]
    libraries = _csv_lines(report.libraries_view([*twins, *with_state]))
    assert len(libraries) == 10
    assert {line["baseline"] for line in libraries if line["library"] == "flashinfer_gdn"} == {"true"}


def _csv_lines(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def test_published_views_one_line_per_workload_and_per_workload_and_library() -> None:
    rows = gdn_rows()
    rows[1] = rows[1].model_copy(update={"absent_inputs": ["state"]})
    human = _csv_lines(report.human_best_view(rows))
    assert [line["workload_index"] for line in human] == ["0", "1", "2"]
    assert [line["state_given"] for line in human] == ["true", "false", "true"]
    assert float(human[0]["eager_speedup"]) == pytest.approx(4.0) and human[0]["graph_speedup"] == ""
    assert human[0]["human_graph_status"] == "NOT_CAPTURABLE" and human[0]["ours_graph_ms"] == "0.5"
    assert human[2]["ours_status"] == "FAILED" and human[2]["eager_speedup"] == ""
    assert human[0]["total_seq_len"] == "64" and human[0]["seq_len"] == ""
    libraries = _csv_lines(report.libraries_view(rows))
    assert [(line["workload_index"], line["library"], line["baseline"]) for line in libraries] == [
        ("0", "fla_chunk", "false"), ("0", "flashinfer_gdn", "true"), ("1", "fla_chunk", "false"),
        ("1", "flashinfer_gdn", "true"), ("2", "fla_chunk", "false"), ("2", "flashinfer_gdn", "true"),
    ]  # fmt: skip
    assert float(libraries[1]["eager_speedup"]) == pytest.approx(2.0)
    assert float(libraries[1]["graph_speedup"]) == pytest.approx(2.0)
    assert libraries[2]["graph_speedup"] == "" and libraries[2]["library_graph_status"] == ""
    assert libraries[0]["library_version"] == "fla-core==0.6.0"
    # Without rows: the header only.
    assert report.human_best_view([]).count("\n") == 1


def test_environment_line_names_gpu_commit_date_and_protocol() -> None:
    env = EnvironmentRecord(gpu_name="NVIDIA H200", sm_count=132, repo_commit="0123456789abcdef", seed=0,
                            timestamp="2026-12-02T10:00:00+00:00", data_sources={"moe": ["synthesized"]},
                            protocol={"warmup": 3, "iterations": 50, "trials": 3, "timer": {"name": "cupti"}})  # fmt: skip
    assert report.environment_line(env) == (
        "NVIDIA H200 (132 SMs); commit `0123456789`; 2026-12-02; protocol warmup 3 / iterations 50 / trials 3;"
        " timer `cupti`; seed 0; data synthesized."
    )


def test_environment_line_names_each_commit_with_its_tracks_when_they_differ() -> None:
    env = EnvironmentRecord(gpu_name="NVIDIA H200", repo_commit="0123456789abcdef", timestamp="2026-12-02T10:00:00",
                            seed=0, data_sources={"moe": ["synthesized"], "gdn_prefill": ["synthesized"]})  # fmt: skip
    one = report.environment_line(env, {"moe": env, "gdn_prefill": env})
    assert one == report.environment_line(env) == (
        "NVIDIA H200; commit `0123456789`; 2026-12-02; seed 0; data synthesized."
    )
    moe = env.model_copy(update={"repo_commit": "fedcba9876543210", "timestamp": "2026-12-03T01:00:00",
                                 "repo_dirty": True, "data_sources": {"moe": ["official"]}})  # fmt: skip
    two = report.environment_line(env, {"dsa_attention": env, "moe": moe, "gdn_prefill": env})
    assert two == (
        "NVIDIA H200; commit `0123456789` (gdn_prefill, dsa_attention; 2026-12-02), `fedcba9876` (moe; 2026-12-03;"
        " dirty); seed 0; data official, synthesized."
    )


def test_sides_table_lists_every_library_side_of_the_registry() -> None:
    table = "\n".join(report.sides_table())
    for track in TRACKS.values():
        for lib in track.libraries:
            assert f"| `{track.name}` | `{lib.name}`" in table


# ------------------------------------------------------------------------------------------
# tools/render_results.py


def test_readme_and_the_published_views_are_what_the_canonical_run_says() -> None:
    """The repository's README.md and results/ as committed: `uv run tools/render_results.py` fixes a failure."""
    messages: list[str] = []
    assert _load_renderer().main(["--check"], out=messages.append) == 0, messages


def _readme(render, path: Path) -> Path:
    blocks = "\n\n".join(f"{b}\nold\n{e}" for b, e in (render.markers(n) for n in render.SECTIONS))
    path.write_text(f"# title\n\n{blocks}\n\nafter\n")
    return path


def test_render_writes_sections_and_views_and_check_catches_staleness(tmp_path: Path) -> None:
    render = _load_renderer()
    results_dir, readme = tmp_path / "results", _readme(render, tmp_path / "README.md")
    args = ["--results-dir", str(results_dir), "--readme", str(readme)]
    messages: list[str] = []
    # No canonical run: still generated, still checked.
    assert render.main([*args, "--check"], out=messages.append) == 1 and "stale" in messages[-1]
    assert render.main(args) == 0
    assert render.NO_RUN in readme.read_text() and "old" not in readme.read_text()
    assert (results_dir / render.HUMAN_VIEW).read_text().count("\n") == 1
    assert render.main([*args, "--check"]) == 0
    # A canonical run appears: README and views are stale until rendered.
    env = EnvironmentRecord(gpu_name="NVIDIA H200", repo_commit="abcdef1234567890", protocol={"trials": 3})
    write_results(results_dir / "h200" / "latest.json", env, gdn_rows())
    assert render.main([*args, "--check"]) == 1
    assert render.main(args) == 0 and render.main([*args, "--check"]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n") and text.endswith("\nafter\n")
    assert "`flashinfer_gdn` (FlashInfer)" in text and "commit `abcdef1234`" in text
    assert render.NO_STATE_ROWS in text  # a run without twins says so in one line
    assert render.NO_REPEAT in text
    # A repeat appears beside it: README's repeat section is stale until rendered.
    write_results(results_dir / "h200" / "repeat.json", env, gdn_rows())
    assert render.main([*args, "--check"]) == 1
    assert render.main(args) == 0 and render.NO_REPEAT not in readme.read_text()
    assert (results_dir / render.LIBRARY_VIEW).stat().st_mode & 0o777 == 0o644
    # A hand edit of a view is caught.
    view = results_dir / render.HUMAN_VIEW
    view.write_text(view.read_text().replace("PASSED", "FAILED", 1))
    assert render.main([*args, "--check"]) == 1


def test_render_writes_the_no_state_table_of_a_run_with_twins(tmp_path: Path) -> None:
    render = _load_renderer()
    results_dir, readme = tmp_path / "results", _readme(render, tmp_path / "README.md")
    args = ["--results-dir", str(results_dir), "--readme", str(readme)]
    twin = gdn_rows()[0].model_copy(update={"absent_inputs": ["state"]})
    write_results(results_dir / "h200" / "latest.json", EnvironmentRecord(), [*gdn_rows(), twin])
    assert render.main(args) == 0 and render.main([*args, "--check"]) == 0
    text = readme.read_text()
    begin, end = render.markers("no-state")
    section = text[text.index(begin) : text.index(end)]
    assert "| `gdn_prefill` | 41-200 (`total_seq_len`) | 1 |" in section and "(1 workloads)" in section
    begin, end = render.markers("passes")
    assert "(3 workloads)" in text[text.index(begin) : text.index(end)]
    assert [line.split(",")[4] for line in (results_dir / render.HUMAN_VIEW).read_text().splitlines()[1:]] == [
        "true", "false", "true", "true"
    ]
    # The CSV beside the JSON must hold the twin's lines too.
    csv_path = results_dir / "h200" / "latest.csv"
    lines = csv_path.read_text().splitlines()
    csv_path.write_text("\n".join(line for line in lines if ",false," not in line) + "\n")
    messages: list[str] = []
    assert render.main(args, out=messages.append) == 2 and "differ" in messages[-1]


def test_render_refuses_a_canonical_run_without_its_tidy_csv_and_a_readme_without_markers(tmp_path: Path) -> None:
    render = _load_renderer()
    results_dir, readme = tmp_path / "results", _readme(render, tmp_path / "README.md")
    args = ["--results-dir", str(results_dir), "--readme", str(readme)]
    latest = results_dir / "h200" / "latest.json"
    write_results(latest, EnvironmentRecord(), gdn_rows())
    latest.with_suffix(".csv").write_text("track,uuid\n")
    messages: list[str] = []
    assert render.main(args, out=messages.append) == 2 and "not a tidy results CSV" in messages[-1]
    readme.write_text("# no markers\n")
    latest.with_suffix(".csv").unlink()
    write_results(latest, EnvironmentRecord(), gdn_rows())
    assert render.main(args, out=messages.append) == 2 and "generated:headline:begin" in messages[-1]
    assert readme.read_text() == "# no markers\n"
