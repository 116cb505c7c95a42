"""tools/merge_track_runs.py: a track's re-run merged into the canonical run (CPU only)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from hopperbench import report
from hopperbench.devcheck import load_module_by_path
from hopperbench.environment import EnvironmentRecord
from hopperbench.paths import REPO_ROOT
from hopperbench.results import (
    JournalHeader,
    PlannedRow,
    PlannedTrack,
    SideRecord,
    SideResult,
    Status,
    TrackRun,
    WorkloadKey,
    csv_path_for,
    read_results,
    summarize,
    write_journal_results,
    write_results_file,
)
from hopperbench.sides import known_side_names
from hopperbench.tracks import TRACKS, is_candidate_side

merge_track_runs = load_module_by_path(REPO_ROOT / "tools/merge_track_runs.py", "merge_track_runs")

OLD, NEW = "a" * 40, "b" * 40
AXES = {"gdn_prefill": {"total_seq_len": 64, "num_seqs": 1, "len_cu_seqlens": 2}, "moe": {"seq_len": 4},
        "dsa_attention": {"num_tokens": 1, "num_pages": 8}}  # fmt: skip
# Workloads per track; GDN's first also runs without its state (a twin).
WORKLOADS = {"gdn_prefill": 2, "moe": 2, "dsa_attention": 1}


def environment(commit: str, date: str, **changes: Any) -> EnvironmentRecord:
    protocol = {"timer": {"name": "cupti"}, "warmup": 3, "iterations": 50, "trials": 3,
                "reference": {t: {"warmup": 3, "iterations": 10} for t in TRACKS}}  # fmt: skip
    fields: dict[str, Any] = dict(gpu_name="NVIDIA H200", sm_count=132, repo_commit=commit, seed=0, protocol=protocol,
                                  timestamp=f"{date}T04:00:00+00:00", empty_kernel_span_ms=0.001,
                                  data_sources={t: ["synthesized"] for t in TRACKS})  # fmt: skip
    return EnvironmentRecord(**{**fields, **changes})


def track_sides(track: str) -> list[str]:
    return [s for s in known_side_names([TRACKS[track]]) if not is_candidate_side(s)]


def keys(track: str) -> list[WorkloadKey]:
    out = []
    for index in range(WORKLOADS[track]):
        absents = [[], ["state"]] if track == "gdn_prefill" and index == 0 else [[] if track == "gdn_prefill" else None]
        out += [WorkloadKey(track=track, definition=TRACKS[track].definition_name, uuid=f"{track}-{index}", index=index,
                            axes=AXES[track], data_source="synthesized", seed=0, absent_inputs=a)  # fmt: skip
                for a in absents]
    return out


def write_run(
    path: Path,
    env: EnvironmentRecord,
    tracks: list[str],
    ms: float,
    *,
    sides: list[str] | None = None,
    skip_rows: int = 0,
    unfinished: bool = False,
) -> Path:
    """A finished run of `tracks` as the runner writes it; every side passes in `ms`. `skip_rows`
    leaves out the last rows of each track (from the plan too); `unfinished` plans one row it never records."""
    plan: dict[str, PlannedTrack] = {}
    records: list[SideRecord] = []
    for track in tracks:
        names = sides if sides is not None else track_sides(track)
        wanted = keys(track)[: len(keys(track)) - skip_rows]
        planned = [PlannedRow(uuid=k.uuid, absent_inputs=tuple(k.absent_inputs or ())) for k in wanted]
        plan[track] = PlannedTrack(workloads=planned + [PlannedRow(uuid="never")] * unfinished, sides=names)
        records += [SideRecord(workload=k, result=SideResult(side=s, status=Status.PASSED, latency_ms=ms,
                                                             per_trial_ms=[ms] * 3))  # fmt: skip
                    for k in wanted for s in names]
    header = JournalHeader(seed=0, protocol=env.protocol, environment=env, plan=plan, resumed_at=[f"resumed {ms}"])
    write_journal_results(path, header, records, env, "journal header")
    return path


@pytest.fixture
def canonical(tmp_path: Path) -> Path:
    return write_run(tmp_path / "latest.json", environment(OLD, "2026-12-02"), list(WORKLOADS), 1.0)


def _merge(*paths: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = merge_track_runs.main([str(p) for p in paths])
    return code, capsys.readouterr().err


def test_merge_replaces_the_tracks_rows_twins_included_and_keeps_the_others(
    canonical: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = read_results(canonical)
    newer_env = environment(NEW, "2026-12-03")
    newer = read_results(write_run(tmp_path / "gdn.json", newer_env, ["gdn_prefill"], 0.5))
    assert _merge(canonical, tmp_path / "gdn.json", capsys=capsys) == (0, "")
    merged = read_results(canonical)
    # GDN's rows, its no-state twin among them, are the newer run's; the others are as they were.
    gdn = [r for r in merged.rows if r.track == "gdn_prefill"]
    assert [r.model_dump_json() for r in gdn] == [r.model_dump_json() for r in newer.rows]
    assert len(gdn) == 3 and [r.absent_inputs for r in gdn] == [[], ["state"], []]
    others = [r.model_dump_json() for r in merged.rows if r.track != "gdn_prefill"]
    assert others == [r.model_dump_json() for r in before.rows if r.track != "gdn_prefill"]
    # The file's own environment stays the kept tracks'; GDN's is the newer run's, with its resumes.
    assert merged.environment == before.environment and merged.resumed_at == before.resumed_at
    assert merged.track_runs == {
        "gdn_prefill": TrackRun(environment=newer_env, environment_source="journal header", resumed_at=["resumed 0.5"])
    }
    assert merged.track_environment("gdn_prefill") == newer_env
    assert merged.track_environment("moe") == before.environment
    assert merged.summary == summarize(merged.rows) and merged.summary["moe"] == before.summary["moe"]
    assert merged.summary["gdn_prefill"] == newer.summary["gdn_prefill"]
    assert merged.completeness is not None and not merged.completeness.partial
    assert merged.completeness.complete == merged.completeness.planned == len(merged.rows) == 6
    assert list(merged.completeness.tracks) == list(WORKLOADS)
    # The CSV: each line's commit, GPU and ours' version are its track's.
    with open(csv_path_for(canonical), newline="") as f:
        lines = list(csv.DictReader(f))
    commits = {(line["track"], line["commit"]) for line in lines}
    assert commits == {("gdn_prefill", NEW), ("moe", OLD), ("dsa_attention", OLD)}
    ours = {(line["track"], line["side_version"]) for line in lines if line["side"] == "ours"}
    assert ours == {("gdn_prefill", NEW), ("moe", OLD), ("dsa_attention", OLD)}
    assert len([line for line in lines if line["track"] == "gdn_prefill" and line["state_given"] == "false"]) == 5
    # Written as the runner writes it, and said per track in README's environment line.
    assert canonical.read_text() == merged.model_dump_json(indent=2) + "\n"
    line = report.environment_line(merged.environment, merged.track_environments())
    assert "commit `bbbbbbbbbb` (gdn_prefill; 2026-12-03), `aaaaaaaaaa` (moe, dsa_attention; 2026-12-02);" in line


def test_merging_every_track_leaves_one_environment(
    canonical: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    newer_env = environment(NEW, "2026-12-03")
    write_run(tmp_path / "moe.json", newer_env, ["moe"], 0.5)
    write_run(tmp_path / "rest.json", newer_env, ["gdn_prefill", "dsa_attention"], 0.5)
    assert _merge(canonical, tmp_path / "moe.json", tmp_path / "rest.json", capsys=capsys) == (0, "")
    merged = read_results(canonical)
    assert merged.environment == newer_env and merged.track_runs == {}
    assert merged.resumed_at == ["resumed 0.5"]


def _refused(canonical: Path, newer: Path, capsys: pytest.CaptureFixture[str], expected: str) -> None:
    before = {p: p.read_bytes() for p in (canonical, csv_path_for(canonical))}
    code, err = _merge(canonical, newer, capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("merge_track_runs: error: ")
    assert expected in err
    assert {p: p.read_bytes() for p in before} == before
    assert not list(canonical.parent.glob("*.tmp"))


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"gpu_name": "NVIDIA H100"}, "gpu_name ('NVIDIA H100' against 'NVIDIA H200')"),
        ({"sm_count": 114}, "sm_count (114 against 132)"),
        ({"seed": 1}, "seed (1 against 0)"),
        ({"protocol": {**environment(NEW, "x").protocol, "iterations": 20}}, "iterations (20 against 50)"),
        ({"protocol": {**environment(NEW, "x").protocol, "timer": {"name": "other"}}}, "differs from"),
        ({"data_sources": {"moe": ["official"]}}, "workloads are official"),
    ],
)
def test_a_run_measured_otherwise_is_refused(
    canonical: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, Any], expected: str
) -> None:
    newer = write_run(tmp_path / "moe.json", environment(NEW, "2026-12-03", **changes), ["moe"], 0.5)
    _refused(canonical, newer, capsys, expected)


def test_an_offlist_run_is_refused_on_either_side(canonical: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    protocol = {**environment(NEW, "x").protocol, "workload_list": "offlist"}
    by_protocol = write_run(tmp_path / "moe_routing.json", environment(NEW, "2026-12-03", protocol=protocol), ["moe"], 0.5)
    _refused(canonical, by_protocol, capsys, "is an off-list run (--workload-list offlist): the canonical run holds")
    # Rows that name a recipe variant are off-list whatever the protocol says.
    plain = write_run(tmp_path / "moe.json", environment(NEW, "2026-12-03"), ["moe"], 0.5)
    results = read_results(plain)
    rows = [r.model_copy(update={"recipe_variant": "zipf"}) for r in results.rows]
    write_results_file(plain, results.model_copy(update={"rows": rows}))
    _refused(canonical, plain, capsys, "is an off-list run")
    code, err = _merge(by_protocol, write_run(tmp_path / "again.json", environment(NEW, "x"), ["moe"], 0.5), capsys=capsys)
    assert code == 2 and f"{by_protocol} is an off-list run" in err


@pytest.mark.parametrize("timed_track", ["dsa_attention", "moe"])
def test_the_reference_timing_concerns_its_own_tracks_rows_only(
    canonical: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], timed_track: str
) -> None:
    """Another track's, or the merged track's own (its reference rows all come from the newer run)."""
    protocol = environment(NEW, "x").protocol
    protocol = {**protocol, "reference": {**protocol["reference"], timed_track: {"iterations": 0}}}
    newer = write_run(tmp_path / "moe.json", environment(NEW, "2026-12-03", protocol=protocol), ["moe"], 0.5)
    assert _merge(canonical, newer, capsys=capsys) == (0, "")


def test_the_twins_warm_up_is_the_merged_tracks_own(canonical: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    protocol = {**environment(NEW, "x").protocol, "twin_warmup": "on the largest twin"}
    newer = write_run(tmp_path / "gdn.json", environment(NEW, "2026-12-03", protocol=protocol), ["gdn_prefill"], 0.5)
    assert _merge(canonical, newer, capsys=capsys) == (0, "")
    merged = read_results(canonical)
    assert merged.track_environment("gdn_prefill").protocol["twin_warmup"] == "on the largest twin"
    assert "twin_warmup" not in merged.track_environment("moe").protocol


def test_an_incomplete_run_a_missing_side_or_row_is_refused(
    canonical: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = environment(NEW, "2026-12-03")
    partial = write_run(tmp_path / "partial.json", env, ["moe"], 0.5, unfinished=True)
    _refused(canonical, partial, capsys, "is partial for moe: 2 of 3 rows")
    no_human = write_run(tmp_path / "no_human.json", env, ["moe"], 0.5,
                         sides=[s for s in track_sides("moe") if s != "human"])  # fmt: skip
    _refused(canonical, no_human, capsys, "lacks side human of moe")
    no_twin = write_run(tmp_path / "no_twin.json", env, ["gdn_prefill"], 0.5, skip_rows=1)
    _refused(canonical, no_twin, capsys, "lacks 1 of")


def test_unreadable_files_and_a_journal_beside_the_canonical_file_are_refused(
    canonical: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(canonical, tmp_path / "missing.json", capsys, "cannot read")
    not_results = tmp_path / "other.json"
    not_results.write_text(json.dumps({"rows": []}))
    _refused(canonical, not_results, capsys, "is not a results JSON")
    _refused(canonical, canonical, capsys, "is the canonical file itself")
    newer = write_run(tmp_path / "moe.json", environment(NEW, "2026-12-03"), ["moe"], 0.5)
    journal = tmp_path / "latest.journal.jsonl"
    journal.write_text("{}\n")
    _refused(canonical, newer, capsys, "finish that run")
    journal.unlink()
    canonical.write_text("not json")
    code, err = _merge(canonical, newer, capsys=capsys)
    assert code == 2 and "is not a results JSON" in err and canonical.read_text() == "not json"


def test_a_failure_writing_the_csv_leaves_the_canonical_json_as_it_was(
    canonical: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hopperbench import results

    newer = write_run(tmp_path / "moe.json", environment(NEW, "2026-12-03"), ["moe"], 0.5)
    before = {p: p.read_bytes() for p in (canonical, csv_path_for(canonical))}
    write_temporary = results._write_temporary

    def disk_full_for_csv(path: Path, text: str) -> Path:
        if path.suffix == ".csv":
            raise OSError(28, "No space left on device", str(path))
        return write_temporary(path, text)

    monkeypatch.setattr(results, "_write_temporary", disk_full_for_csv)
    code, err = _merge(canonical, newer, capsys=capsys)
    assert code == 1 and "No space left on device" in err and err.count("\n") == 1
    assert {p: p.read_bytes() for p in before} == before
    assert not list(tmp_path.glob("*.tmp"))


def test_the_merged_tracks_leave_the_repeat_run(canonical: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repeat = write_run(tmp_path / "repeat.json", environment(OLD, "2026-12-02"), ["gdn_prefill", "moe"], 1.01)
    newer = write_run(tmp_path / "gdn.json", environment(NEW, "2026-12-03"), ["gdn_prefill"], 0.5)
    code = merge_track_runs.main([str(canonical), str(newer), "--repeat", str(repeat)])
    out = capsys.readouterr().out
    assert code == 0 and f"{repeat}: dropped gdn_prefill; run the track again" in out
    kept = read_results(repeat)
    assert {r.track for r in kept.rows} == {"moe"} and kept.summary == summarize(kept.rows)
    assert kept.completeness is not None and list(kept.completeness.tracks) == ["moe"]
    with open(csv_path_for(repeat), newline="") as f:
        assert {line["track"] for line in csv.DictReader(f)} == {"moe"}
    # README's repeat table names the track the repeat no longer holds.
    lines = report.repeat_markdown(read_results(canonical), kept)
    assert "`gdn_prefill` | - | 0 | - | not repeated since its canonical run (canonical at `bbbbbbbbbb`)" in "\n".join(lines)
    # Merging the last track it holds removes it; the repeat of a track merges into it as into any run.
    moe = write_run(tmp_path / "moe.json", environment(NEW, "2026-12-03"), ["moe"], 0.5)
    assert merge_track_runs.main([str(canonical), str(moe), "--repeat", str(repeat)]) == 0
    assert "(nothing left: removed)" in capsys.readouterr().out
    assert not repeat.exists() and not csv_path_for(repeat).exists()
    # With no repeat left (or none yet), a merge has nothing to drop.
    assert merge_track_runs.main([str(canonical), str(newer), "--repeat", str(repeat)]) == 0
    assert "dropped" not in capsys.readouterr().out and not repeat.exists()


def test_a_repeat_that_is_the_canonical_file_or_has_a_journal_is_refused(
    canonical: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    newer = write_run(tmp_path / "gdn.json", environment(NEW, "2026-12-03"), ["gdn_prefill"], 0.5)
    repeat = write_run(tmp_path / "repeat.json", environment(OLD, "2026-12-02"), ["gdn_prefill"], 1.01)
    (tmp_path / "repeat.journal.jsonl").write_text("{}\n")
    before = {p: p.read_bytes() for p in (canonical, repeat)}
    for given, expected in ((canonical, "is the canonical file itself"), (repeat, "finish that run")):
        assert merge_track_runs.main([str(canonical), str(newer), "--repeat", str(given)]) == 2
        assert expected in capsys.readouterr().err
    assert {p: p.read_bytes() for p in before} == before
