"""Result schema, journal, JSON/CSV files and the per-track summary (CPU only)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from hopperbench.environment import EnvironmentRecord
from hopperbench.results import (
    FLOOR_FIELDS,
    Journal,
    JournalHeader,
    JournalMismatchError,
    PlannedRow,
    PlannedTrack,
    SideRecord,
    SideResult,
    Status,
    TrackSummary,
    TidyFormatError,
    TrialFloor,
    WorkloadKey,
    WorkloadRow,
    assess_completeness,
    attach_floors,
    build_rows,
    busy_speedup,
    csv_path_for,
    format_completeness,
    format_summary_table,
    merge_plans,
    read_csv_rows,
    read_results,
    summarize,
    tidy_columns,
    tidy_records,
    write_journal_results,
    write_results,
)


def key(index: int, track: str = "moe") -> WorkloadKey:
    return WorkloadKey(
        track=track,
        definition=f"{track}_def",
        uuid=f"{track}-uuid-{index}",
        index=index,
        axes={"seq_len": index + 1, "other": 7},
        data_source="synthesized",
        seed=0,
    )


def passed(side: str, ms: float, **extra: object) -> SideResult:
    return SideResult(side=side, status=Status.PASSED, latency_ms=ms, min_ms=ms * 0.9, max_ms=ms * 1.1,
                      per_trial_ms=[ms * 0.9, ms, ms * 1.1], max_abs_err=0.001, max_rel_err=0.002,
                      relative_l2=1e-4, matched_ratio=1.0, **extra)  # fmt: skip


def row(index: int, sides: list[SideResult], track: str = "moe") -> WorkloadRow:
    return WorkloadRow.from_sides(key(index, track), {s.side: s for s in sides})


def test_speedups_are_other_over_ours_and_need_both_passed() -> None:
    r = row(0, [passed("ours", 2.0), passed("human", 3.0), passed("reference", 40.0), passed("fla", 2.5)])
    assert r.speedup_vs_human == pytest.approx(1.5)
    assert r.speedup_vs_reference == pytest.approx(20.0)
    # The fastest passing of reference and libraries, never human or ours.
    assert r.best_reference == "fla"
    assert r.speedup_vs_best_reference == pytest.approx(1.25)

    failed_human = SideResult(side="human", status=Status.FAILED, message="mismatch", max_abs_err=3.0)
    r = row(1, [passed("ours", 2.0), failed_human, passed("reference", 40.0)])
    assert r.speedup_vs_human is None
    assert r.best_reference == "reference"
    assert r.speedup_vs_best_reference == pytest.approx(20.0)

    r = row(2, [SideResult(side="ours", status=Status.CRASH, message="x"), passed("reference", 4.0)])
    assert r.speedup_vs_reference is None and r.speedup_vs_best_reference is None
    assert r.best_reference == "reference"


def test_side_order_is_canonical() -> None:
    r = row(0, [passed("zlib", 1.0), passed("reference", 1.0), passed("alib", 1.0), passed("ours", 1.0)])
    assert list(r.sides) == ["ours", "reference", "alib", "zlib"]


def test_human_pinned_comes_from_the_human_side() -> None:
    assert row(0, [passed("ours", 1.0), passed("human", 1.0, pinned=False)]).human_pinned is False
    assert row(0, [passed("ours", 1.0)]).human_pinned is None


def test_summary_geometric_means_and_counts() -> None:
    rows = [
        row(0, [passed("ours", 1.0), passed("human", 2.0), passed("reference", 10.0)]),
        row(1, [passed("ours", 1.0), passed("human", 8.0), passed("reference", 1000.0)]),
        # Human failed: this workload enters the reference mean only.
        row(2, [passed("ours", 1.0), SideResult(side="human", status=Status.FAILED), passed("reference", 100.0)]),
        row(3, [SideResult(side="ours", status=Status.UNAVAILABLE, message="no kernel"), passed("reference", 5.0)]),
        row(0, [passed("ours", 1.0), passed("reference", 3.0)], track="dsa_attention"),
    ]
    summary = summarize(rows)
    moe = summary["moe"]
    assert moe.workloads == 4
    assert moe.vs_human.geomean == pytest.approx(math.sqrt(2.0 * 8.0))
    assert moe.vs_human.workloads == 2
    assert moe.vs_reference.geomean == pytest.approx((10.0 * 1000.0 * 100.0) ** (1 / 3))
    assert moe.vs_reference.workloads == 3
    assert moe.vs_best_reference.geomean == pytest.approx(moe.vs_reference.geomean)
    assert moe.passed == {"ours": 3, "human": 2, "reference": 4}
    assert moe.failed == {"ours": 0, "human": 1, "reference": 0}
    assert moe.unavailable == {"ours": 1, "human": 0, "reference": 0}
    dsa = summary["dsa_attention"]
    assert dsa.vs_human.geomean is None and dsa.vs_human.workloads == 0
    assert dsa.vs_reference.geomean == pytest.approx(3.0)


def test_busy_time_speedups_compare_kernels_without_host_gaps() -> None:
    # Spans 1 / 4 / 2 ms, GPU busy 0.9 / 0.6 / 0.5 ms: the human side's span lead over ours is host time.
    r = row(0, [passed("ours", 1.0, busy_ms=0.9), passed("human", 4.0, busy_ms=0.6), passed("reference", 2.0, busy_ms=1.8),
                passed("fla", 3.0, busy_ms=0.45)])  # fmt: skip
    assert busy_speedup(r.sides["ours"], r.sides["human"]) == pytest.approx(0.6 / 0.9)
    assert busy_speedup(r.sides["ours"], passed("x", 1.0)) is None  # no busy time recorded
    assert busy_speedup(r.sides["ours"], SideResult(side="x", status=Status.FAILED)) is None
    summary = summarize([r, row(1, [passed("ours", 1.0, busy_ms=1.0), passed("human", 2.0, busy_ms=2.0)])])["moe"]
    assert summary.vs_human_busy.geomean == pytest.approx(math.sqrt(0.6 / 0.9 * 2.0))
    assert summary.vs_human_busy.workloads == 2
    # Best reference on spans is the reference (2 ms); on busy time it is fla, the least GPU time.
    assert r.best_reference == "reference"
    assert summary.vs_best_reference_busy.geomean == pytest.approx(0.45 / 0.9)
    assert summary.vs_best_reference_busy.workloads == 1
    # Runs written before busy time existed summarise to no busy mean, and still load.
    old = summarize([row(0, [passed("ours", 1.0), passed("human", 2.0)])])["moe"]
    assert old.vs_human_busy.geomean is None and old.vs_human_busy.workloads == 0
    dumped = old.model_dump()
    del dumped["vs_human_busy"], dumped["vs_best_reference_busy"]
    assert TrackSummary.model_validate(dumped).vs_human_busy.workloads == 0


def test_json_round_trip_and_csv_beside_it(tmp_path: Path) -> None:
    inf_error = SideResult(
        side="human", status=Status.FAILED, max_abs_err=math.inf, max_rel_err=math.nan, message="nan out"
    )
    rows = [
        row(0, [passed("ours", 1.0), passed("human", 2.0, pinned=True), passed("reference", 10.0)]),
        row(1, [passed("ours", 1.0), inf_error, passed("reference", 10.0)]),
    ]
    env = EnvironmentRecord(gpu_name="NVIDIA H200", sm_count=132, seed=0, protocol={"iterations": 50})
    output = tmp_path / "run" / "results.json"
    written = write_results(output, env, rows)
    back = read_results(output)
    assert back.environment == env
    assert back.rows[0] == rows[0]
    assert math.isinf(back.rows[1].sides["human"].max_abs_err or 0.0)
    assert math.isnan(back.rows[1].sides["human"].max_rel_err or 0.0)
    assert back.summary == written.summary
    assert csv_path_for(output) == tmp_path / "run" / "results.csv"
    assert csv_path_for(output).is_file()
    assert not list(output.parent.glob("*.tmp"))


def test_csv_is_tidy_one_line_per_workload_and_side(tmp_path: Path) -> None:
    rows = [
        row(0, [passed("ours", 1.5), passed("human", 3.0, pinned=True), passed("reference", 9.0), passed("fla", 6.0)])
    ]
    output = tmp_path / "results.json"
    env = EnvironmentRecord(gpu_name="NVIDIA H200", repo_commit="c0ffee" * 6 + "abcd", protocol={"iterations": 50})
    write_results(output, env, rows)
    assert output.stat().st_mode & 0o777 == 0o644
    assert csv_path_for(output).stat().st_mode & 0o777 == 0o644
    with open(csv_path_for(output), newline="") as f:
        reader = csv.DictReader(f)
        lines = list(reader)
        columns = reader.fieldnames
    assert columns == tidy_columns(rows)
    assert columns[:7] == [
        "track", "definition", "workload_index", "uuid", "data_source", "state_given", "recipe_variant"
    ]  # fmt: skip
    # Every var axis of every definition, then the test's own axis that no definition has.
    assert columns[7:14] == ["total_seq_len", "num_seqs", "len_cu_seqlens", "seq_len", "num_tokens", "num_pages", "other"]
    assert columns[14:18] == ["side", "side_kind", "side_version", "status"]
    assert columns[-5:] == ["trials", "iterations", "seed", "gpu", "commit"]
    assert [line["side"] for line in lines] == ["ours", "human", "reference", "fla"]
    assert [line["side_kind"] for line in lines] == ["ours", "human", "reference", "library"]
    ours, human, reference, fla = lines
    assert ours["side_version"] == env.repo_commit and reference["side_version"] == "definition"
    assert fla["side_version"] == ""  # not a registry library
    assert ours["seq_len"] == "1" and ours["other"] == "7" and ours["num_tokens"] == ""
    assert ours["state_given"] == ""  # moe has no optional input
    assert ours["recipe_variant"] == ""  # a listed workload
    assert float(ours["eager_ms"]) == 1.5 and float(human["eager_ms"]) == 3.0
    assert ours["eager_min_ms"] == repr(1.5 * 0.9)
    assert ours["trials"] == "3" and ours["iterations"] == "50" and ours["gpu"] == "NVIDIA H200"
    assert ours["graph_status"] == "" and ours["status"] == "PASSED"


def test_csv_side_versions_come_from_the_registry_and_the_manifest(tmp_path: Path) -> None:
    from hopperbench.human_best import load_manifest
    from hopperbench.tracks import TRACKS

    library = TRACKS["moe"].libraries[0]
    rows = [
        row(0, [passed("ours", 1.0), SideResult(side="human", status=Status.UNAVAILABLE), passed(library.name, 2.0)]),
        row(1, [passed("ours", 1.0), passed("human", 2.0)], track="gdn_prefill"),
    ]
    lines = tidy_records(rows, EnvironmentRecord(repo_commit="abc"))
    assert [(r["side"], r["side_version"]) for r in lines[:3]] == [
        ("ours", "abc"), ("human", None), (library.name, library.package or library.submodule),
    ]  # fmt: skip
    assert lines[4]["side_version"] == load_manifest()["gdn_prefill"].commit


def test_csv_lines_carry_the_environment_of_their_tracks_run() -> None:
    rows = [row(0, [passed("ours", 1.0)]), row(0, [passed("ours", 1.0)], track="dsa_attention")]
    base = EnvironmentRecord(gpu_name="NVIDIA H200", repo_commit="old", protocol={"iterations": 50})
    moe = EnvironmentRecord(gpu_name="NVIDIA H200 NVL", repo_commit="new", protocol={"iterations": 20})
    lines = tidy_records(rows, base, {"moe": moe})
    assert [(r["track"], r["commit"], r["side_version"], r["gpu"]) for r in lines] == [
        ("moe", "new", "new", "NVIDIA H200 NVL"), ("dsa_attention", "old", "old", "NVIDIA H200"),
    ]  # fmt: skip
    assert [r["iterations"] for r in lines] == [20, 50]


def test_csv_reads_back_to_the_same_speedups(tmp_path: Path) -> None:
    rows = [
        row(0, [passed("ours", 1.5), passed("human", 3.0, pinned=False), passed("reference", 9.0)]),
        row(
            1,
            [
                SideResult(side="ours", status=Status.TIMEOUT),
                passed("human", 3.0, pinned=False),
                passed("reference", 9.0),
            ],
        ),
    ]
    output = tmp_path / "results.json"
    write_results(output, EnvironmentRecord(), rows)
    back = read_csv_rows(csv_path_for(output))
    assert [r.speedup_vs_human for r in back] == [r.speedup_vs_human for r in rows]
    assert [r.sides["ours"].status for r in back] == [Status.PASSED, Status.TIMEOUT]
    assert back[0].axes == rows[0].axes


def test_journal_append_read_and_resume_checks(tmp_path: Path) -> None:
    journal = Journal(Journal.path_for(tmp_path / "results.json"))
    assert journal.path.name == "results.journal.jsonl"
    header = JournalHeader(seed=3, protocol={"iterations": 50, "timer": {"name": "cupti"}})
    journal.create(header)
    first = SideRecord(workload=key(0), result=passed("reference", 2.0))
    second = SideRecord(workload=key(0), result=passed("ours", 1.0))
    journal.append(first)
    journal.append(second)
    read_header, records = journal.read()
    assert read_header == header
    assert records == [first, second]
    row_0 = ("moe", "moe-uuid-0", ())
    assert [r.key for r in records] == [(row_0, "reference"), (row_0, "ours")]
    assert journal.check_resumable(header) == records

    with pytest.raises(JournalMismatchError, match="seed"):
        journal.check_resumable(JournalHeader(seed=4, protocol=header.protocol))
    with pytest.raises(JournalMismatchError, match="iterations"):
        journal.check_resumable(JournalHeader(seed=3, protocol={"iterations": 5, "timer": {"name": "cupti"}}))
    with pytest.raises(FileExistsError):
        journal.create(header)  # never overwritten


def test_journal_tolerates_a_torn_last_line_only(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.journal.jsonl")
    journal.create(JournalHeader(seed=0, protocol={}))
    record = SideRecord(workload=key(0), result=passed("ours", 1.0))
    journal.append(record)
    with open(journal.path, "a") as f:
        f.write('{"workload": {"track": "mo')  # killed mid-write
    assert journal.read()[1] == [record]
    with open(journal.path, "a") as f:
        f.write("\n" + record.model_dump_json() + "\n")
    with pytest.raises(JournalMismatchError, match="not a valid record"):
        journal.read()


def test_build_rows_last_record_wins_and_orders_rows() -> None:
    records = [
        SideRecord(workload=key(1), result=passed("reference", 5.0)),
        SideRecord(workload=key(0), result=SideResult(side="ours", status=Status.UNAVAILABLE)),
        SideRecord(workload=key(0), result=passed("ours", 1.0)),
        SideRecord(workload=key(0), result=passed("reference", 4.0)),
    ]
    rows = build_rows(records)
    assert [r.index for r in rows] == [0, 1]
    assert rows[0].sides["ours"].status == Status.PASSED
    assert rows[0].speedup_vs_reference == pytest.approx(4.0)


def test_journal_header_keeps_environment_plan_and_resumes_and_reads_old_headers(tmp_path: Path) -> None:
    env = EnvironmentRecord(gpu_name="NVIDIA H200", cpu_affinity={"0": [0, 1]}, worker_launch="fork-server")
    header = JournalHeader(seed=0, protocol={"iterations": 50}, environment=env,
                           plan={"moe": PlannedTrack(workloads=["a", "b"], sides=["reference", "ours"])},
                           resumed_at=["2026-01-01T00:00:00+00:00"])  # fmt: skip
    journal = Journal(tmp_path / "new.journal.jsonl")
    journal.create(header)
    assert journal.read()[0] == header

    old = Journal(tmp_path / "old.journal.jsonl")
    record = SideRecord(workload=key(0), result=passed("ours", 1.0))
    old.path.write_text('{"kind": "header", "seed": 0, "protocol": {"iterations": 50}}\n' + record.model_dump_json())
    old_header, records = old.read()
    assert old_header.environment is None and old_header.plan is None and old_header.resumed_at == []
    assert records == [record]
    assert old.check_resumable(JournalHeader(seed=0, protocol={"iterations": 50}, environment=env)) == [record]


def test_rewrite_header_keeps_records_and_drops_a_torn_tail(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.journal.jsonl")
    journal.create(JournalHeader(seed=0, protocol={}))
    records = [SideRecord(workload=key(i), result=passed("ours", 1.0 + i)) for i in range(2)]
    for record in records:
        journal.append(record)
    with open(journal.path, "a") as f:
        f.write('{"workload": {"track": "mo')
    new_header = JournalHeader(seed=0, protocol={}, environment=EnvironmentRecord(gpu_name="x"), resumed_at=["t"])
    journal.rewrite_header(new_header)
    late = SideRecord(workload=key(2), result=passed("ours", 9.0))
    journal.append(late)
    assert journal.read() == (new_header, [*records, late])


def test_merge_plans_is_an_ordered_union() -> None:
    first = {"moe": PlannedTrack(workloads=["a", "b"], sides=["reference", "ours"])}
    second = {
        "moe": PlannedTrack(workloads=["b", "c"], sides=["reference", "human"]),
        "gdn_prefill": PlannedTrack(workloads=["g"], sides=["reference"]),
    }
    merged = merge_plans(first, None, second)
    assert merged["moe"] == PlannedTrack(workloads=["a", "b", "c"], sides=["reference", "ours", "human"])
    assert merged["gdn_prefill"] == second["gdn_prefill"]
    # A twin is a row of its own: a plan that adds twins to one without them keeps both rows.
    twin = PlannedRow(uuid="g", absent_inputs=("state",))
    with_twin = merge_plans(second, {"gdn_prefill": PlannedTrack(workloads=["g", twin], sides=["reference"])})
    assert with_twin["gdn_prefill"].workloads == [PlannedRow(uuid="g"), twin]


def twin_key(index: int) -> WorkloadKey:
    """A GDN workload's key with the state given, and its twin's without it."""
    return key(index, "gdn_prefill").model_copy(update={"absent_inputs": []})


def no_state_key(index: int) -> WorkloadKey:
    return twin_key(index).model_copy(update={"absent_inputs": ["state"]})


def test_a_planned_row_without_absent_inputs_is_written_as_its_uuid() -> None:
    plan = PlannedTrack(workloads=["u", PlannedRow(uuid="u", absent_inputs=("state",))], sides=["ours"])
    text = plan.model_dump_json()
    assert json.loads(text)["workloads"] == ["u", {"uuid": "u", "absent_inputs": ["state"]}]
    assert PlannedTrack.model_validate_json(text) == plan
    # A header written before twins existed (uuids only) reads as rows with every input.
    old_plan = '{"seed": 0, "protocol": {}, "plan": {"moe": {"workloads": ["a"], "sides": []}}}'
    old = JournalHeader.model_validate_json(old_plan)
    assert old.plan is not None and old.plan["moe"].workloads == [PlannedRow(uuid="a")]


def test_a_workload_and_its_no_state_twin_are_two_rows_in_the_journal_and_the_files(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.journal.jsonl")
    plan = {"gdn_prefill": PlannedTrack(workloads=[twin_key(0).uuid, twin_key(1).uuid,
                                                   PlannedRow(uuid=twin_key(0).uuid, absent_inputs=("state",))],
                                        sides=["reference", "ours"])}  # fmt: skip
    header = JournalHeader(seed=0, protocol={}, plan=plan)
    journal.create(header)
    records = [
        SideRecord(workload=twin_key(0), result=passed("reference", 4.0)),
        SideRecord(workload=no_state_key(0), result=passed("reference", 3.0)),
        SideRecord(workload=twin_key(0), result=passed("ours", 1.0)),
        SideRecord(workload=no_state_key(0), result=passed("ours", 0.5)),
        SideRecord(workload=twin_key(1), result=passed("reference", 4.0)),
    ]
    for record in records:
        journal.append(record)
    read_header, back = journal.read()
    assert read_header == header and back == records
    # Neither overwrites the other: one row each, the workload's own first.
    rows = build_rows(back)
    assert [(r.index, r.absent_inputs) for r in rows] == [(0, []), (0, ["state"]), (1, [])]
    assert [r.speedup_vs_reference for r in rows[:2]] == [pytest.approx(4.0), pytest.approx(6.0)]
    assert len({r.key for r in back}) == len(back)
    # Completeness counts the twin as a planned row of its own: 2 of 3 have every side.
    completeness = assess_completeness(plan, back)
    assert (completeness.planned, completeness.complete) == (3, 2)
    assert assess_completeness(plan, back[:3]).complete == 1  # the twin lacks ours
    # The summary splits the two kinds of call; the JSON and the tidy CSV keep both rows.
    output = tmp_path / "results.json"
    write_journal_results(output, read_header, back, EnvironmentRecord(), "journal header")
    summary = read_results(output).summary["gdn_prefill"]
    assert {label: g.workloads for label, g in summary.by_absent_inputs.items()} == {"all inputs": 2, "no state": 1}
    # The track's own means and counts are the headline's: the twin is not among them.
    assert summary.workloads == 2 and summary.passed["ours"] == 1
    assert summary.vs_reference.geomean == pytest.approx(4.0) and summary.vs_reference.workloads == 1
    assert [(r.index, r.absent_inputs) for r in read_results(output).rows] == [(0, []), (0, ["state"]), (1, [])]
    lines = list(csv.DictReader(open(csv_path_for(output))))
    assert [(line["workload_index"], line["state_given"], line["side"]) for line in lines] == [
        ("0", "true", "ours"), ("0", "true", "reference"), ("0", "false", "ours"), ("0", "false", "reference"),
        ("1", "true", "reference"),
    ]  # fmt: skip
    from_csv = read_csv_rows(csv_path_for(output))
    assert [(r.index, r.absent_inputs, r.speedup_vs_reference) for r in from_csv] == [
        (0, [], pytest.approx(4.0)), (0, ["state"], pytest.approx(6.0)), (1, [], None),
    ]  # fmt: skip


def test_records_that_do_not_say_which_inputs_were_absent_are_their_workloads_own_rows() -> None:
    old = key(0, "gdn_prefill")  # absent_inputs None: a journal from before the field
    assert old.row_id == twin_key(0).row_id != no_state_key(0).row_id
    rows = build_rows([SideRecord(workload=old, result=passed("reference", 2.0)),
                       SideRecord(workload=twin_key(0), result=passed("ours", 1.0))])  # fmt: skip
    assert len(rows) == 1 and set(rows[0].sides) == {"ours", "reference"}


def test_completeness_counts_workloads_with_every_planned_side() -> None:
    records = [
        SideRecord(workload=key(0), result=passed("reference", 4.0)),
        SideRecord(workload=key(0), result=SideResult(side="ours", status=Status.CRASH)),  # recorded counts
        SideRecord(workload=key(1), result=passed("reference", 4.0)),
    ]
    plan = {"moe": PlannedTrack(workloads=[key(i).uuid for i in range(3)], sides=["reference", "ours"])}
    completeness = assess_completeness(plan, records)
    assert completeness.partial and (completeness.planned, completeness.complete) == (3, 1)
    assert completeness.tracks["moe"].planned == 3 and completeness.plan_source == "journal header"
    assert format_completeness(completeness) == "partial: 1 of 3 workloads have every planned side recorded (moe 1/3)"
    # Without a stored plan: the recorded workloads, each expected to have every side seen in its track.
    derived = assess_completeness(None, records)
    assert (derived.planned, derived.complete, derived.plan_source) == (2, 1, "journal records")
    complete = assess_completeness(plan, [*records, *(SideRecord(workload=key(i), result=passed(s, 1.0))
                                                       for i in (1, 2) for s in ("reference", "ours"))])  # fmt: skip
    assert not complete.partial and format_completeness(complete) is None


def test_journal_results_carry_completeness_source_and_resumes(tmp_path: Path) -> None:
    plan = {"moe": PlannedTrack(workloads=[key(0).uuid, key(1).uuid], sides=["reference"])}
    header = JournalHeader(seed=0, protocol={}, resumed_at=["2026-01-02T03:04:05+00:00"], plan=plan)
    records = [SideRecord(workload=key(0), result=passed("reference", 4.0))]
    output = tmp_path / "results.json"
    written = write_journal_results(
        output, header, records, EnvironmentRecord(gpu_name="g"), "x (attached at finalize)"
    )
    back = read_results(output)
    assert back == written
    assert back.environment_source == "x (attached at finalize)"
    assert back.resumed_at == header.resumed_at
    assert back.completeness is not None and back.completeness.partial and len(back.rows) == 1


def test_results_written_before_completeness_still_read(tmp_path: Path) -> None:
    output = tmp_path / "results.json"
    write_results(output, EnvironmentRecord(), [row(0, [passed("ours", 1.0), passed("reference", 2.0)])])
    data = json.loads(output.read_text())
    for field in ("environment_source", "resumed_at", "completeness"):
        del data[field]
    for side in data["rows"][0]["sides"].values():
        del side["wall_s"], side["per_trial_floor"]
    output.write_text(json.dumps(data))
    back = read_results(output)
    assert back.completeness is None and back.rows[0].speedup_vs_reference == pytest.approx(2.0)


def test_results_without_track_runs_read_as_one_run_of_every_track(tmp_path: Path) -> None:
    output = tmp_path / "results.json"
    env = EnvironmentRecord(repo_commit="abc")
    write_results(output, env, [row(0, [passed("ours", 1.0)]), row(0, [passed("ours", 1.0)], track="dsa_attention")])
    data = json.loads(output.read_text())
    assert data.pop("track_runs") == {}
    output.write_text(json.dumps(data))
    back = read_results(output)
    assert back.track_runs == {} and back.track_environments() == {"dsa_attention": env, "moe": env}
    data["track_runs"] = {"moe": {"environment": {}, "unknown": 1}}
    output.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown"):
        read_results(output)


TRIAL_FLOORS = [
    TrialFloor(bytes_min=30e6, core_us=7.0),
    TrialFloor(bytes_min=10e6, core_us=3.0),
    TrialFloor(bytes_min=11e6, core_us=4.0),
]


def test_rows_get_the_floor_of_the_inputs_each_trial_timed(tmp_path: Path) -> None:
    ours = SideResult(side="ours", status=Status.PASSED, latency_ms=0.010, per_trial_ms=[0.012, 0.010, 0.005],
                      per_trial_floor=TRIAL_FLOORS)  # fmt: skip
    moe = row(0, [ours, passed("reference", 0.9)])
    output = tmp_path / "results.json"
    written = write_results(output, EnvironmentRecord(empty_kernel_span_ms=0.001), [moe])  # t_lat 1 us
    (got,) = written.rows
    floor_ms = [0.008, 0.004, 0.005]  # (core + 1 us) per trial
    assert got.floor_ms == pytest.approx(0.005)  # median
    assert got.floor_bytes == pytest.approx(17e6)  # mean
    # Trial by trial: 1.5, 2.5, 1.0 and 2.5, 1.0, 2.2 TB/s; medians of those, not ratios of medians.
    assert got.ours_over_floor == pytest.approx(1.5)
    assert [o / f for o, f in zip(ours.per_trial_ms, floor_ms)] == pytest.approx([1.5, 2.5, 1.0])
    assert got.ours_tb_per_s == pytest.approx(2.2)
    assert written.summary["moe"].ours_over_floor.geomean == pytest.approx(1.5)
    # The JSON keeps the per-trial floors; the CSV carries the row's, and the README renderer reads them back.
    assert read_results(output).rows[0].sides["ours"].per_trial_floor == TRIAL_FLOORS
    # The CSV has no per-trial values: its over_floor is the side's latency / the row's floor.
    (back,) = read_csv_rows(csv_path_for(output))
    assert back.ours_over_floor == pytest.approx(0.010 / 0.005)
    assert back.floor_ms == pytest.approx(got.floor_ms)


def test_without_trial_floors_a_row_has_no_floor_not_the_axes_only_expectation() -> None:
    from hopperbench.floors import floor

    moe = row(0, [passed("ours", 0.05), passed("reference", 0.9)])
    assert floor("moe", moe.axes, t_lat_us=1.0).floor_us > 0  # an expectation exists, and is not used
    (got,) = attach_floors([moe], t_lat_us=1.0)
    assert all(getattr(got, f) is None for f in FLOOR_FIELDS)
    # A stale value (e.g. from an older file) does not survive either.
    (stale,) = attach_floors([moe.model_copy(update={"floor_ms": 1.0, "ours_tb_per_s": 4.8})], t_lat_us=1.0)
    assert stale.floor_ms is None and stale.ours_tb_per_s is None


def test_another_sides_trial_floors_give_the_floor_when_ours_was_not_timed() -> None:
    failed_ours = SideResult(side="ours", status=Status.FAILED, message="mismatch")
    reference = passed("reference", 9.0, per_trial_floor=TRIAL_FLOORS)
    (got,) = attach_floors([row(0, [failed_ours, reference])], t_lat_us=1.0)
    assert got.floor_ms == pytest.approx(0.005) and got.floor_bytes == pytest.approx(17e6)
    assert got.ours_over_floor is None and got.ours_tb_per_s is None


def test_no_floor_without_the_empty_kernel_span(tmp_path: Path) -> None:
    rows = [row(0, [passed("ours", 1.0, per_trial_floor=TRIAL_FLOORS), passed("reference", 9.0)])]
    unknown = write_results(tmp_path / "a.json", EnvironmentRecord(), rows)
    assert all(r.floor_ms is None and r.ours_over_floor is None for r in unknown.rows)
    assert unknown.summary["moe"].ours_over_floor is None
    with pytest.raises(ValueError, match="t_lat_us"):
        attach_floors(rows, t_lat_us=-1.0)


def with_absent(r: WorkloadRow, absent: list[str] | None) -> WorkloadRow:
    return r.model_copy(update={"absent_inputs": absent})


def test_absent_state_survives_json_and_csv_as_state_given(tmp_path: Path) -> None:
    rows = [
        with_absent(row(0, [passed("ours", 1.0), passed("human", 2.0)], track="gdn_prefill"), ["state"]),
        with_absent(row(1, [passed("ours", 1.0), passed("human", 2.0)], track="gdn_prefill"), []),
        with_absent(row(2, [passed("ours", 1.0), passed("human", 2.0)], track="gdn_prefill"), None),
    ]
    output = tmp_path / "results.json"
    write_results(output, EnvironmentRecord(), rows)
    assert [r.absent_inputs for r in read_results(output).rows] == [["state"], [], None]
    with open(csv_path_for(output), newline="") as f:
        assert [line["state_given"] for line in csv.DictReader(f)] == ["false", "false", "true", "true", "", ""]
    assert [r.absent_inputs for r in read_csv_rows(csv_path_for(output))] == [["state"], [], None]


def test_recipe_variant_survives_json_and_csv_and_an_older_csv_without_its_column_reads(tmp_path: Path) -> None:
    variant = row(0, [passed("ours", 1.0), passed("reference", 2.0)]).model_copy(update={"recipe_variant": "zipf"})
    rows = [variant, row(1, [passed("ours", 1.0), passed("reference", 2.0)])]
    output = tmp_path / "results.json"
    write_results(output, EnvironmentRecord(), rows)
    assert [r.recipe_variant for r in read_results(output).rows] == ["zipf", None]
    with open(csv_path_for(output), newline="") as f:
        lines = list(csv.DictReader(f))
    assert [line["recipe_variant"] for line in lines] == ["zipf", "zipf", "", ""]
    assert [r.recipe_variant for r in read_csv_rows(csv_path_for(output))] == ["zipf", None]
    # A CSV written before the column existed (the canonical latest.csv) is still tidy.
    older = tmp_path / "older.csv"
    with open(older, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[c for c in lines[0] if c != "recipe_variant"], lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: v for k, v in line.items() if k != "recipe_variant"} for line in lines[2:])
    (back,) = read_csv_rows(older)
    assert back.recipe_variant is None and back.axes == {"seq_len": 2, "other": 7}


def test_a_csv_in_the_old_wide_format_is_read_through_the_json_beside_it(tmp_path: Path) -> None:
    output = tmp_path / "old.json"
    write_results(output, EnvironmentRecord(), [row(0, [passed("ours", 1.0), passed("reference", 2.0)])])
    csv_path_for(output).write_text("track,definition,uuid,index,axes\nmoe,d,u,0,seq_len=1\n")
    (back,) = read_csv_rows(csv_path_for(output))
    assert back.speedup_vs_reference == pytest.approx(2.0)
    output.unlink()
    with pytest.raises(TidyFormatError):
        read_csv_rows(csv_path_for(output))


def test_the_summary_is_the_headlines_and_splits_by_absent_inputs_only_when_workloads_differ() -> None:
    def gdn(index: int, human_ms: float, absent: list[str] | None) -> WorkloadRow:
        sides = [passed("ours", 1.0), passed("human", human_ms), passed("fla", 4.0 * human_ms)]
        return with_absent(row(index, sides, track="gdn_prefill"), absent)

    split = summarize([gdn(0, 1.0, []), gdn(1, 4.0, []), gdn(2, 9.0, ["state"])])["gdn_prefill"]
    assert set(split.by_absent_inputs) == {"all inputs", "no state"}
    given, missing = split.by_absent_inputs["all inputs"], split.by_absent_inputs["no state"]
    assert (given.workloads, given.vs_human.geomean, given.vs_human.workloads) == (2, pytest.approx(2.0), 2)
    assert given.vs_best_reference.geomean == pytest.approx(8.0)
    assert (missing.workloads, missing.vs_human.geomean) == (1, pytest.approx(9.0))
    # The track's own mean is the headline's: the rows that gave GDN's sampled input (the state).
    assert (split.workloads, split.vs_human.geomean) == (2, pytest.approx(2.0))
    assert summarize([gdn(0, 1.0, []), gdn(1, 4.0, [])])["gdn_prefill"].by_absent_inputs == {}
    assert summarize([gdn(0, 1.0, None), gdn(1, 4.0, None)])["gdn_prefill"].by_absent_inputs == {}


def test_side_results_written_before_per_trial_floors_still_load() -> None:
    line = passed("ours", 1.0).model_dump(mode="json")
    del line["per_trial_floor"]
    result = SideResult.model_validate_json(json.dumps(line))
    assert result.per_trial_floor == [] and result.per_trial_ms == pytest.approx([0.9, 1.0, 1.1])
    with pytest.raises(ValueError):
        SideResult.model_validate({**line, "per_trial_floor": [{"bytes_min": 1.0}]})  # core_us missing


def test_the_summary_has_candidates_only_when_a_run_timed_some() -> None:
    plain = summarize([row(0, [passed("ours", 2.0), passed("reference", 9.0)])])
    assert plain["moe"].candidates_vs_ours == {}
    with_candidate = summarize([row(0, [passed("ours", 2.0), passed("cand_next", 1.0), passed("reference", 9.0)])])
    assert with_candidate["moe"].candidates_vs_ours["cand_next"].geomean == pytest.approx(2.0)
    # A candidate is never the best reference, however fast.
    assert row(0, [passed("ours", 2.0), passed("cand_next", 1.0), passed("reference", 9.0)]).best_reference == "reference"
    assert "cand_next 2x (1)" in format_summary_table(with_candidate)


