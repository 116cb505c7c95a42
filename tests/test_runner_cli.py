"""The runner's CLI and process handling, with a fake worker process (no GPU needed)."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import threading
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pytest

from hopperbench import runner
from hopperbench.environment import EnvironmentRecord
from hopperbench.results import Journal, Status, read_results, read_tidy_csv, write_results
from hopperbench.runner import RunnerHooks, main
from hopperbench.sides import Side, SideKind
from hopperbench.tracks import TRACKS, CandidateSide
from hopperbench.worker_pool import describe_exit, physical_cores, split_cpus

# A stand-in for `python -m hopperbench.worker JOB.json RESULT.json`. It logs each call,
# writes the reference's scratch files like the real one, and misbehaves on demand
# (FAKE_WORKER_MODE=segv|sleep applies to the "ours" side).
FAKE_WORKER = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    from pathlib import Path

    job = json.loads(Path(sys.argv[1]).read_text())
    side, uuid = job["side"]["name"], job["workload"]["uuid"]
    with open(os.environ["FAKE_WORKER_LOG"], "a") as log:
        log.write(json.dumps({"side": side, "uuid": uuid, "iterations": job["iterations"],
                              "withheld": job["workload"].get("withheld_inputs", []),
                              "time_budget_s": job.get("time_budget_s"),
                              "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                              "cute_arch": os.environ.get("CUTE_DSL_ARCH"), "pid": os.getpid(),
                              "ppid": os.getppid(),
                              "cpus": sorted(os.sched_getaffinity(0)),
                              "warmup": (job.get("warmup_workload") or {}).get("uuid"),
                              "warmup_withheld": (job.get("warmup_workload") or {}).get("withheld_inputs")}) + "\\n")
    mode = os.environ.get("FAKE_WORKER_MODE", "")
    if side == "ours" and mode == "segv":
        print("about to touch an illegal address", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    if side == "ours" and mode == "sleep":
        child = subprocess.Popen(["sleep", "60"])
        Path(os.environ["FAKE_WORKER_CHILD"]).write_text(str(child.pid))
        time.sleep(60)
    if side == "reference":
        row = uuid + "".join(".without-" + name for name in job["workload"].get("withheld_inputs", []))
        for t in range(job["trials"]):
            path = Path(job["scratch_dir"]) / job["track"] / row / f"trial{t}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"fake")
    latency = {"reference": 10.0, "ours": 2.0}.get(side, 5.0) if job["iterations"] else None
    result = {"side": side, "status": "PASSED", "latency_ms": latency, "min_ms": latency, "max_ms": latency}
    Path(sys.argv[2]).write_text(json.dumps(result))
    """
)


def fake_sides(track, ctx) -> list[Side]:
    return [
        Side(name="ours", kind=SideKind.OURS, track=track.name, available=True),
        Side(name="human", kind=SideKind.HUMAN, track=track.name, available=False, reason="not checked out here"),
        Side(
            name="reference", kind=SideKind.REFERENCE, track=track.name, available=True, destination_passing_style=False
        ),
    ]


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunnerHooks:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("FAKE_WORKER_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("FAKE_WORKER_CHILD", str(tmp_path / "child.pid"))
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    return RunnerHooks(
        worker_command=(sys.executable, str(script)),
        check_devices=lambda requested: [None] if requested is None else [str(d) for d in requested],
        timer_protocol=lambda: {"name": "fake-timer"},
        guard=lambda tracks, allow: {},
        sides_for=fake_sides,
        collect_environment=fake_environment,
        show_progress=False,
        preload_modules=(),  # the fork server's imports are tested in test_worker_pool.py
        preload_if_fork_safe=(),
    )


def fake_environment(request, slot) -> EnvironmentRecord:
    return EnvironmentRecord(seed=request.seed, protocol=request.protocol, cpu_affinity=request.cpu_affinity,
                             worker_launch=request.worker_launch, worker_env=request.worker_env,
                             timestamp=time.strftime("%H:%M:%S"))  # fmt: skip


# Every test that exercises worker processes runs through both launch paths.
LAUNCHES = [pytest.param([], id="fork-server"), pytest.param(["--no-preload"], id="subprocess")]


def calls(tmp_path: Path) -> list[dict]:
    log = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def moe_uuids(n: int) -> list[str]:
    from hopperbench.workloads import load_workloads

    return [w.uuid for w in load_workloads("moe")[:n]]


def run_args(out: Path, *extra: str) -> list[str]:
    return ["--track", "moe", "--max-workloads", "2", "--iterations", "2", "--output", str(out), *extra]


@pytest.mark.parametrize("launch", LAUNCHES)
def test_full_run_writes_json_csv_and_journal(fake: RunnerHooks, tmp_path: Path, capsys, launch) -> None:
    out = tmp_path / "run" / "results.json"
    assert main(run_args(out, *launch), fake) == 0
    results = read_results(out)
    assert [r.uuid for r in results.rows] == moe_uuids(2)
    row = results.rows[0]
    assert row.sides["ours"].status == Status.PASSED
    assert row.sides["human"].status == Status.UNAVAILABLE
    assert row.sides["human"].message == "not checked out here"
    assert row.speedup_vs_reference == pytest.approx(5.0)
    assert results.summary["moe"].vs_reference.workloads == 2
    assert out.with_suffix(".csv").is_file()
    _, records = Journal(Journal.path_for(out)).read()
    assert len(records) == 6  # 2 workloads x (reference, ours, human)
    # The reference of a workload always runs before its other sides.
    sequence = calls(tmp_path)
    assert [c["side"] for c in sequence] == ["reference", "ours"] * 2
    assert not (tmp_path / "run" / "results.scratch").exists()  # removed at the end
    stdout = capsys.readouterr().out
    assert "vs reference" in stdout and "5x (2)" in stdout and "partial" not in stdout
    # The environment was collected once, before any job, and the results carry the header's.
    header, _ = Journal(Journal.path_for(out)).read()
    assert header.environment is not None and results.environment == header.environment
    assert results.environment_source == "journal header"
    assert results.environment.worker_launch == ("subprocess" if launch else "fork-server")
    assert results.environment.worker_env["CUTE_DSL_ARCH"] == os.environ.get("CUTE_DSL_ARCH", "sm_90a")
    assert "TRITON_CACHE_AUTOTUNING" not in results.environment.worker_env
    assert header.plan is not None and [w.uuid for w in header.plan["moe"].workloads] == moe_uuids(2)
    assert header.plan["moe"].sides == ["reference", "ours", "human"]
    assert results.completeness is not None and not results.completeness.partial
    assert (results.completeness.planned, results.completeness.complete) == (2, 2)
    assert (row.sides["ours"].wall_s or 0) > 0 and row.sides["human"].wall_s is None


def test_resume_runs_only_what_the_journal_lacks(fake: RunnerHooks, tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    assert main(run_args(out, "--sides", "ours,reference", "--keep-scratch"), fake) == 0
    journal = Journal(Journal.path_for(out))
    lines = journal.path.read_text().splitlines()
    assert len(lines) == 1 + 4
    # Simulate a run killed after 2 of its 4 results: keep both references, drop both "ours".
    kept = [lines[0]] + [line for line in lines[1:] if '"side":"reference"' in line]
    assert len(kept) == 3
    journal.path.write_text("\n".join(kept) + "\n")
    out.unlink()
    out.with_suffix(".csv").unlink()
    (tmp_path / "calls.jsonl").unlink()

    assert main(run_args(out, "--sides", "ours,reference", "--resume"), fake) == 0
    assert [c["side"] for c in calls(tmp_path)] == ["ours", "ours"]
    results = read_results(out)
    assert all(r.sides["ours"].status == Status.PASSED for r in results.rows)
    assert all(r.speedup_vs_reference == pytest.approx(5.0) for r in results.rows)


def test_resume_recomputes_missing_reference_outputs_without_retiming(fake: RunnerHooks, tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    assert main(run_args(out, "--sides", "ours,reference"), fake) == 0  # scratch removed at the end
    journal = Journal(Journal.path_for(out))
    lines = journal.path.read_text().splitlines()
    journal.path.write_text("\n".join(line for line in lines if '"side":"ours"' not in line) + "\n")
    (tmp_path / "calls.jsonl").unlink()
    assert main(run_args(out, "--sides", "ours,reference", "--resume"), fake) == 0
    sequence = [(c["side"], c["iterations"]) for c in calls(tmp_path)]
    assert sequence == [("reference", 0), ("ours", 2)] * 2
    _, records = journal.read()
    assert sum(r.result.side == "reference" for r in records) == 2  # the recomputation is not journaled


def test_resume_refuses_a_different_protocol_or_seed(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    out = tmp_path / "results.json"
    assert main(run_args(out), fake) == 0
    capsys.readouterr()
    assert main(run_args(out, "--resume", "--seed", "1"), fake) == 2
    assert "seed" in capsys.readouterr().err
    assert (
        main(["--track", "moe", "--max-workloads", "2", "--iterations", "3", "--output", str(out), "--resume"], fake)
        == 2
    )
    err = capsys.readouterr().err
    assert "iterations" in err and err.count("\n") == 1


def test_existing_output_needs_resume(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    out = tmp_path / "results.json"
    assert main(run_args(out), fake) == 0
    capsys.readouterr()
    assert main(run_args(out), fake) == 2
    assert "--resume" in capsys.readouterr().err


@pytest.mark.parametrize("launch", LAUNCHES)
def test_crash_is_reported_with_the_log_tail(fake: RunnerHooks, tmp_path: Path, monkeypatch, launch) -> None:
    monkeypatch.setenv("FAKE_WORKER_MODE", "segv")
    out = tmp_path / "results.json"
    assert main(run_args(out, "--max-workloads", "1", *launch), fake) == 0
    ours = read_results(out).rows[0].sides["ours"]
    assert ours.status == Status.CRASH
    assert "SIGSEGV" in (ours.message or "")
    assert "about to touch an illegal address" in (ours.message or "")
    assert read_results(out).rows[0].sides["reference"].status == Status.PASSED


@pytest.mark.parametrize("launch", LAUNCHES)
def test_timeout_kills_the_whole_process_group(fake: RunnerHooks, tmp_path: Path, monkeypatch, launch) -> None:
    monkeypatch.setenv("FAKE_WORKER_MODE", "sleep")
    out = tmp_path / "results.json"
    started = time.monotonic()
    assert main(run_args(out, "--max-workloads", "1", "--timeout", "1.5", *launch), fake) == 0
    assert time.monotonic() - started < 30
    ours = read_results(out).rows[0].sides["ours"]
    assert ours.status == Status.TIMEOUT
    assert "1.5 s" in (ours.message or "")
    grandchild = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of a dead parent may linger as a zombie until reaped by init.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("launch", LAUNCHES)
def test_reference_failure_gives_no_reference(fake: RunnerHooks, tmp_path: Path, monkeypatch, launch) -> None:
    broken = tmp_path / "broken_worker.py"
    broken.write_text(
        FAKE_WORKER.replace('if side == "reference":', 'if side == "reference":\n    sys.exit(3)\nif False:')
    )
    hooks = replace(fake, worker_command=(sys.executable, str(broken)))
    out = tmp_path / "results.json"
    assert main(run_args(out, "--max-workloads", "1", *launch), hooks) == 0
    row = read_results(out).rows[0]
    assert row.sides["reference"].status == Status.CRASH
    assert "exit code 3" in (row.sides["reference"].message or "")
    assert row.sides["ours"].status == Status.NO_REFERENCE
    assert [c["side"] for c in calls(tmp_path)] == ["reference"]


@pytest.mark.parametrize("launch", LAUNCHES)
def test_devices_keep_a_workload_on_one_device(fake: RunnerHooks, tmp_path: Path, launch) -> None:
    out = tmp_path / "results.json"
    assert main(run_args(out, "--max-workloads", "3", "--devices", "0,1", *launch), fake) == 0
    by_uuid: dict[str, set] = {}
    for c in calls(tmp_path):
        by_uuid.setdefault(c["uuid"], set()).add(c["cuda"])
    assert len(by_uuid) == 3
    assert all(len(devices) == 1 and devices <= {"0", "1"} for devices in by_uuid.values())
    assert len(read_results(out).rows) == 3


def test_reference_timing_defaults_and_overrides(fake: RunnerHooks, tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    assert main(run_args(out, "--max-workloads", "1"), fake) == 0
    moe_defaults = TRACKS["moe"].timing
    # The MoE reference gets the track's own count (not the kernels' --iterations 2), capped by its budget.
    assert moe_defaults.reference_iterations is not None and moe_defaults.reference_time_budget_s is not None
    assert calls(tmp_path)[0] == {
        **calls(tmp_path)[0],
        "side": "reference",
        "iterations": moe_defaults.reference_iterations,
        "time_budget_s": moe_defaults.reference_time_budget_s,
    }
    assert all(c["time_budget_s"] is None and c["iterations"] == 2 for c in calls(tmp_path)[1:])
    protocol = read_results(out).environment.protocol["reference"]["moe"]
    assert protocol == {
        "warmup": 3,
        "iterations": moe_defaults.reference_iterations,
        "time_budget_s": moe_defaults.reference_time_budget_s,
    }
    (tmp_path / "calls.jsonl").unlink()
    assert main(run_args(tmp_path / "b.json", "--max-workloads", "1", "--reference-iterations", "0"), fake) == 0
    assert calls(tmp_path)[0]["iterations"] == 0
    assert read_results(tmp_path / "b.json").rows[0].sides["reference"].latency_ms is None


# ------------------------------------------------------------------------------------------
# Bad input: one line on stderr, exit 2, nothing written


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--track", "nope"], "unknown track"),
        (["--track", "moe,nope"], "unknown track"),
        (["--max-workloads", "0"], "--max-workloads"),
        (["--max-workloads", "-1"], "--max-workloads"),
        (["--max-workloads", "two"], "--max-workloads"),
        (["--iterations", "0"], "--iterations"),
        (["--trials", "0"], "--trials"),
        (["--timeout", "0"], "--timeout"),
        (["--devices", "0,0"], "--devices"),
        (["--track", "moe", "--workloads", "no-such-uuid"], "unknown workload uuid"),
        (["--data-dir", "/definitely/not/here"], "--data-dir"),
        (["--sides", "ours,nobody"], "unknown side"),
        (["--allow-unpinned", "nope"], "unknown track"),
        (["--resume"], "--resume needs --output"),
        (["--bogus-flag"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(fake: RunnerHooks, tmp_path: Path, capsys, argv, fragment) -> None:
    out = tmp_path / "out" / "results.json"
    if "--resume" not in argv or "--output" in argv:
        argv = [*argv, "--output", str(out)]
    assert main(argv, fake) == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert err.count("\n") == 1 and err.startswith("compare_human_best: error:")
    assert not (tmp_path / "out").exists()
    assert calls(tmp_path) == []


def test_no_cuda_device_is_refused(fake: RunnerHooks, tmp_path: Path, capsys, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hooks = replace(fake, check_devices=runner.check_cuda_devices)
    out = tmp_path / "out" / "results.json"
    assert main(["--track", "moe", "--output", str(out)], hooks) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_missing_cupti_is_refused(fake: RunnerHooks, tmp_path: Path, capsys, monkeypatch) -> None:
    from hopperbench.timing import cupti_timer

    monkeypatch.setattr(cupti_timer, "cupti_python_version", lambda: None)
    hooks = replace(fake, timer_protocol=runner.timer_protocol)
    out = tmp_path / "out" / "results.json"
    assert main(["--track", "moe", "--output", str(out)], hooks) == 2
    err = capsys.readouterr().err
    assert "cupti-python" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_workloads_filter_spans_tracks(fake: RunnerHooks, tmp_path: Path) -> None:
    from hopperbench.workloads import WorkloadSpec

    def fake_lists(track: str, data_dir):
        return [
            WorkloadSpec(
                track=track, index=i, uuid=f"{track}-{i}", axes={"n": i + 1}, scalars={}, data_source="synthesized"
            )
            for i in range(3)
        ]

    out = tmp_path / "results.json"
    hooks = replace(fake, load_workloads=fake_lists)
    argv = ["--track", "all", "--workloads", "moe-2,gdn_prefill-0", "--iterations", "1", "--output", str(out)]
    assert main(argv, hooks) == 0
    rows = read_results(out).rows
    # Each row records which optional inputs its calls got as None: GDN's workload 0 gives its
    # state and, in the track's no-state sample, runs again as its twin without it.
    assert sorted((r.track, r.uuid, r.index, r.absent_inputs) for r in rows) == [
        ("gdn_prefill", "gdn_prefill-0", 0, []),
        ("gdn_prefill", "gdn_prefill-0", 0, ["state"]),
        ("moe", "moe-2", 2, []),
    ]
    assert all(result.status == Status.PASSED for r in rows for name, result in r.sides.items() if name != "human")


def test_integrity_refusal_is_one_line(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    def refuse(tracks, allow):
        raise runner.CliError("gdn_prefill: human_best/kachua-mlsys is off its pin")

    out = tmp_path / "out" / "results.json"
    assert main(["--track", "moe", "--output", str(out)], replace(fake, guard=refuse)) == 2
    assert "off its pin" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_guard_not_consulted_without_the_human_side(fake: RunnerHooks, tmp_path: Path) -> None:
    def refuse(tracks, allow):
        raise AssertionError("guard called")

    out = tmp_path / "results.json"
    hooks = replace(fake, guard=refuse)
    assert main(run_args(out, "--max-workloads", "1", "--sides", "ours"), hooks) == 0
    assert set(read_results(out).rows[0].sides) == {"ours", "reference"}


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_reference_only_smoke_run_on_the_gpu(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    argv = ["--track", "dsa_attention", "--max-workloads", "1", "--sides", "reference", "--iterations", "3",
            "--warmup", "1", "--trials", "1", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    row = read_results(out).rows[0]
    assert row.sides["reference"].status == Status.PASSED, row.sides["reference"].message
    assert (row.sides["reference"].latency_ms or 0) > 0
    assert read_results(out).environment.gpu_name


def test_sigsegv_constant_matches_platform() -> None:
    assert describe_exit(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert describe_exit(3) == "exit code 3"


def test_resume_with_another_track_selection(fake: RunnerHooks, tmp_path: Path) -> None:
    from hopperbench.workloads import WorkloadSpec

    def fake_lists(track: str, data_dir):
        return [
            WorkloadSpec(track=track, index=0, uuid=f"{track}-0", axes={"n": 1}, scalars={}, data_source="synthesized")
        ]

    hooks = replace(fake, load_workloads=fake_lists)
    out = tmp_path / "results.json"
    assert main(["--track", "moe", "--iterations", "1", "--output", str(out)], hooks) == 0
    out.unlink()
    (tmp_path / "calls.jsonl").unlink()
    assert main(["--track", "all", "--iterations", "1", "--output", str(out), "--resume"], hooks) == 0
    assert {c["uuid"] for c in calls(tmp_path)} == {"gdn_prefill-0", "dsa_attention-0"}
    assert {r.track for r in read_results(out).rows} == {"moe", "gdn_prefill", "dsa_attention"}


# ------------------------------------------------------------------------------------------
# The environment in the journal header; resume


def drop_lines(journal: Journal, fragment: str, keep_last: int = 0) -> None:
    """Simulate a run killed early: remove journal records containing `fragment` (but the first `keep_last`)."""
    lines = journal.path.read_text().splitlines()
    matching = [i for i, line in enumerate(lines) if i > 0 and fragment in line]
    dropped = set(matching[keep_last:])
    journal.path.write_text("".join(line + "\n" for i, line in enumerate(lines) if i not in dropped))


def make_old_style(journal: Journal) -> None:
    """Rewrite the header as journals were before it held the environment and the plan."""
    lines = journal.path.read_text().splitlines()
    header = json.loads(lines[0])
    lines[0] = json.dumps({k: header[k] for k in ("kind", "seed", "protocol")})
    journal.path.write_text("\n".join(lines) + "\n")


def test_resume_keeps_the_header_environment_and_notes_the_resume(fake: RunnerHooks, tmp_path: Path) -> None:
    collected = []

    def counting(request, slot):
        collected.append(request)
        return fake_environment(request, slot)

    hooks = replace(fake, collect_environment=counting)
    out = tmp_path / "results.json"
    assert main(run_args(out, "--sides", "ours,reference"), hooks) == 0
    assert len(collected) == 1
    journal = Journal(Journal.path_for(out))
    original, _ = journal.read()
    drop_lines(journal, '"side":"ours"')
    with open(journal.path, "a") as f:
        f.write('{"workload": {"track": "mo')  # and torn mid-write
    out.unlink()

    assert main(run_args(out, "--sides", "ours,reference", "--resume"), hooks) == 0
    assert len(collected) == 1  # not collected again
    header, records = journal.read()  # the torn line is gone, not glued to the next record
    assert len(records) == 4
    assert header.environment == original.environment
    assert len(header.resumed_at) == 1 and datetime.fromisoformat(header.resumed_at[0]).tzinfo is not None
    results = read_results(out)
    assert results.environment == original.environment and results.resumed_at == header.resumed_at
    assert results.completeness is not None and not results.completeness.partial


def test_resuming_a_journal_without_environment_records_one(fake: RunnerHooks, tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    assert main(run_args(out, "--sides", "ours,reference"), fake) == 0
    journal = Journal(Journal.path_for(out))
    make_old_style(journal)
    drop_lines(journal, '"side":"ours"')
    assert journal.read()[0].environment is None  # still readable
    assert main(run_args(out, "--sides", "ours,reference", "--resume"), fake) == 0
    header, _ = journal.read()
    assert header.environment is not None and header.environment.protocol == header.protocol
    assert header.plan is not None and [w.uuid for w in header.plan["moe"].workloads] == moe_uuids(2)
    assert sorted(header.plan["moe"].sides) == ["ours", "reference"]


def test_a_resume_adds_the_no_state_twins_to_a_journal_without_them(
    fake: RunnerHooks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hopperbench.workloads import load_workloads

    out = tmp_path / "results.json"
    gdn_args = ["--track", "gdn_prefill", "--max-workloads", "2", "--iterations", "1", "--output", str(out)]
    without_sample = replace(TRACKS["gdn_prefill"], absent_input_sample=None)
    with monkeypatch.context() as m:  # a run planned before the track sampled the no-state case
        m.setitem(TRACKS, "gdn_prefill", without_sample)
        assert main(gdn_args, fake) == 0
    journal = Journal(Journal.path_for(out))
    before_header, before = journal.read()
    assert len(read_results(out).rows) == 2
    (tmp_path / "calls.jsonl").unlink()

    assert main([*gdn_args, "--resume"], fake) == 0
    uuids = [w.uuid for w in load_workloads("gdn_prefill")[:2]]
    # Only the twins ran (workloads 0 and 1 lead their size classes), each reference first.
    assert [(c["uuid"], c["side"], c["withheld"]) for c in calls(tmp_path)] == [
        (u, side, ["state"]) for u in uuids for side in ("reference", "ours")
    ]
    header, records = journal.read()
    assert header.protocol == before_header.protocol and records[: len(before)] == before
    assert header.plan is not None
    assert [(w.uuid, w.absent_inputs) for w in header.plan["gdn_prefill"].workloads] == [
        *((u, ()) for u in uuids), *((u, ("state",)) for u in uuids)
    ]
    results = read_results(out)
    assert [(r.uuid, r.absent_inputs) for r in results.rows] == [
        (uuids[0], []), (uuids[0], ["state"]), (uuids[1], []), (uuids[1], ["state"])
    ]
    assert results.completeness is not None and not results.completeness.partial
    assert (results.completeness.planned, results.completeness.complete) == (4, 4)
    # A twin's records and its workload's are separate: a second resume has nothing left to run.
    (tmp_path / "calls.jsonl").unlink()
    assert main([*gdn_args, "--resume"], fake) == 0
    assert calls(tmp_path) == []


# ------------------------------------------------------------------------------------------
# --finalize


def machine_free(fake: RunnerHooks) -> RunnerHooks:
    """Hooks that fail the test if --finalize touches the GPU, the guard, the workloads or the environment."""

    def refuse(*args, **kwargs):
        raise AssertionError("--finalize must not touch the machine")

    return replace(fake, check_devices=refuse, timer_protocol=refuse, guard=refuse, collect_environment=refuse,
                   load_workloads=refuse, sides_for=refuse)  # fmt: skip


def test_finalize_writes_partial_results_from_the_journal_alone(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    out = tmp_path / "results.json"
    assert main(run_args(out), fake) == 0
    journal = Journal(Journal.path_for(out))
    drop_lines(journal, '"side":"ours"', keep_last=1)
    out.unlink()
    out.with_suffix(".csv").unlink()
    (tmp_path / "calls.jsonl").unlink()
    capsys.readouterr()

    assert main(["--finalize", "--output", str(out)], machine_free(fake)) == 0
    assert calls(tmp_path) == []
    results = read_results(out)
    assert out.with_suffix(".csv").is_file()
    completeness = results.completeness
    assert completeness is not None and completeness.partial
    assert (completeness.planned, completeness.complete) == (2, 1)
    assert completeness.tracks["moe"].complete == 1 and completeness.plan_source == "journal header"
    assert len(results.rows) == 2  # only recorded rows: one of them lacks "ours"
    assert sorted("ours" in r.sides for r in results.rows) == [False, True]
    assert results.environment == journal.read()[0].environment
    stdout = capsys.readouterr().out
    assert "partial: 1 of 2 workloads" in stdout


def test_finalize_attaches_another_runs_environment(fake: RunnerHooks, tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    assert main(run_args(out), fake) == 0
    make_old_style(Journal(Journal.path_for(out)))
    other = tmp_path / "h200" / "results.json"
    write_results(other, EnvironmentRecord(gpu_name="NVIDIA H200", sm_count=132), [])
    assert main(["--finalize", "--output", str(out), "--environment-from", str(other)], machine_free(fake)) == 0
    results = read_results(out)
    assert results.environment.gpu_name == "NVIDIA H200"
    assert results.environment_source == f"{other} (attached at finalize)"
    assert results.completeness is not None and results.completeness.plan_source == "journal records"
    assert not results.completeness.partial and len(results.rows) == 2


def test_finalize_refusals_are_one_line(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    with_env = tmp_path / "with_env.json"
    assert main(run_args(with_env, "--max-workloads", "1"), fake) == 0
    without_env = tmp_path / "without_env.json"
    assert main(run_args(without_env, "--max-workloads", "1"), fake) == 0
    make_old_style(Journal(Journal.path_for(without_env)))
    without_env.unlink()
    capsys.readouterr()
    journal_file = str(Journal.path_for(with_env))
    cases = [
        (["--finalize"], "--finalize needs --output"),
        (["--finalize", "--output", str(tmp_path / "none.json")], "nothing to finalize"),
        (["--finalize", "--resume", "--output", str(with_env)], "cannot be combined with --resume"),
        (["--finalize", "--output", str(without_env)], "records no environment; pass --environment-from"),
        (["--finalize", "--output", str(with_env), "--environment-from", str(with_env)], "its own environment"),
        (["--finalize", "--output", str(without_env), "--environment-from", str(tmp_path / "no.json")], "no.json"),
        (["--finalize", "--output", str(without_env), "--environment-from", journal_file], "is not JSON"),
        ([*run_args(with_env), "--resume", "--environment-from", str(with_env)], "only applies with --finalize"),
    ]
    for argv, fragment in cases:
        assert main(argv, machine_free(fake)) == 2, argv
        err = capsys.readouterr().err
        assert fragment in err and err.count("\n") == 1 and err.startswith("compare_human_best: error:"), err
    assert not without_env.exists()


# ------------------------------------------------------------------------------------------
# Interruptions


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_interrupted_run_writes_partial_results_and_resumes(
    fake: RunnerHooks, tmp_path: Path, monkeypatch, capsys, launch, signum
) -> None:
    monkeypatch.setenv("FAKE_WORKER_MODE", "sleep")  # "ours" hangs: interrupt it while it runs
    child_file = tmp_path / "child.pid"

    def interrupt_while_ours_runs() -> None:
        deadline = time.monotonic() + 30
        while not (child_file.exists() and child_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signum)

    threading.Thread(target=interrupt_while_ours_runs, daemon=True).start()
    out = tmp_path / "results.json"
    started = time.monotonic()
    assert main(run_args(out, *launch), fake) == 128 + signum
    assert time.monotonic() - started < 30
    results = read_results(out)
    assert results.completeness is not None and results.completeness.partial
    assert (results.completeness.planned, results.completeness.complete) == (2, 0)
    assert [set(r.sides) for r in results.rows] == [{"reference"}]  # nothing recorded for the killed job
    assert not _alive(int(child_file.read_text()))
    captured = capsys.readouterr()
    assert f"interrupted by {signal.Signals(signum).name}" in captured.err and "--resume" in captured.err
    assert "partial: 0 of 2 workloads" in captured.out

    monkeypatch.delenv("FAKE_WORKER_MODE")
    assert main(run_args(out, "--resume", *launch), fake) == 0
    resumed = read_results(out)
    assert resumed.completeness is not None and not resumed.completeness.partial
    assert all(r.sides["ours"].status == Status.PASSED for r in resumed.rows)


def test_a_fork_server_that_cannot_start_stops_the_run(fake: RunnerHooks, tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "dies_on_import.py").write_text("import os\nos._exit(5)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "results.json"
    assert main(run_args(out), replace(fake, preload_modules=("dies_on_import",))) == 1
    err = capsys.readouterr().err
    assert "fork server did not start" in err and "exit code 5" in err and "--no-preload" in err
    assert calls(tmp_path) == []
    results = read_results(out)  # what there is (nothing) is still written, marked partial
    assert results.rows == [] and results.completeness is not None and results.completeness.partial


# ------------------------------------------------------------------------------------------
# CPU pinning


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPU cores")
def test_each_device_gets_its_own_cores_and_the_record_says_which(fake: RunnerHooks, tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    shares = split_cpus(cores, 2, physical_cores(set(cores)))  # whole physical cores where the host has SMT
    out = tmp_path / "pinned.json"
    assert main(run_args(out, "--max-workloads", "3", "--devices", "0,1"), fake) == 0
    seen = {(c["cuda"], tuple(c["cpus"])) for c in calls(tmp_path)}
    assert seen and all(cpus == tuple(shares[int(device)]) for device, cpus in seen)
    assert read_results(out).environment.cpu_affinity == {"0": shares[0], "1": shares[1]}

    (tmp_path / "calls.jsonl").unlink()
    out = tmp_path / "unpinned.json"
    assert main(run_args(out, "--max-workloads", "1", "--no-pin-cpus"), fake) == 0
    assert {tuple(c["cpus"]) for c in calls(tmp_path)} == {tuple(cores)}
    assert read_results(out).environment.cpu_affinity is None


def test_fewer_cores_than_devices_is_refused(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out" / "results.json"
    assert main(run_args(out, "--devices", "0,1"), replace(fake, available_cpus=lambda: {0})) == 2
    err = capsys.readouterr().err
    assert "2 devices but only 1" in err and "--no-pin-cpus" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("launch", LAUNCHES)
def test_an_unexpected_error_keeps_the_partial_results_and_raises(fake: RunnerHooks, tmp_path: Path, launch) -> None:
    out = tmp_path / "results.json"
    hooks = replace(fake, worker_cwd=tmp_path / "gone")  # spawning any worker fails
    with pytest.raises(FileNotFoundError):
        main(run_args(out, *launch), hooks)
    results = read_results(out)
    assert results.rows == [] and results.completeness is not None and results.completeness.partial


def with_moe_candidate(fake: RunnerHooks, monkeypatch: pytest.MonkeyPatch, name: str) -> RunnerHooks:
    """`fake` with a candidate `name` registered for MoE (--sides accepts the names the registry
    holds) and built beside the fake sides."""
    candidate_side = CandidateSide(name=name, entry="next.py::run", description="a candidate")
    monkeypatch.setitem(TRACKS, "moe", replace(TRACKS["moe"], candidates=(candidate_side,)))

    def sides_with_candidate(track, ctx) -> list[Side]:
        candidate = Side(name=name, kind=SideKind.CANDIDATE, track=track.name, available=True)
        return [*fake_sides(track, ctx), candidate]

    return replace(fake, sides_for=sides_with_candidate)


def test_candidates_run_only_when_named_and_never_count_as_a_reference(
    fake: RunnerHooks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "cand_next"
    hooks = with_moe_candidate(fake, monkeypatch, name)
    default = tmp_path / "default" / "results.json"
    assert main(run_args(default), hooks) == 0
    assert name not in read_results(default).rows[0].sides
    assert read_results(default).summary["moe"].candidates_vs_ours == {}

    named = tmp_path / "named" / "results.json"
    assert main(run_args(named, "--sides", f"ours,reference,{name}"), hooks) == 0
    results = read_results(named)
    row = results.rows[0]
    assert list(row.sides) == ["ours", name, "reference"]
    assert row.best_reference == "reference"  # the candidate (5 ms) is faster than it but not a reference
    assert results.summary["moe"].candidates_vs_ours[name].geomean == pytest.approx(2.0 / 5.0)
    csv_lines = read_tidy_csv(named.with_suffix(".csv"))
    kinds = {line["side_kind"] for line in csv_lines if line["side"] == name}
    assert kinds == {"candidate"}


# ------------------------------------------------------------------------------------------
# Worker processes: one session per side in the fork server, CUTE_DSL_ARCH for every worker


@pytest.mark.parametrize("launch", LAUNCHES)
def test_each_side_runs_its_jobs_in_one_process_of_its_own(
    fake: RunnerHooks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launch
) -> None:
    name = "cand_next"
    hooks = with_moe_candidate(fake, monkeypatch, name)
    sides = f"ours,reference,{name}"
    assert main(run_args(tmp_path / "results.json", "--max-workloads", "3", "--sides", sides, *launch), hooks) == 0
    jobs = calls(tmp_path)
    assert len(jobs) == 9 and {j["cute_arch"] for j in jobs} == {"sm_90a"}  # compiles never ask the driver for it
    pids = {side: {j["pid"] for j in jobs if j["side"] == side} for side in ("reference", "ours", name)}
    if launch:  # --no-preload: a fresh process per job
        assert all(len(p) == 3 for p in pids.values()) and len(set.union(*pids.values())) == 9
    else:  # a session per (track, side), all forked by the device's one fork server
        assert all(len(p) == 1 for p in pids.values()) and len(set.union(*pids.values())) == 3
        assert len({j["ppid"] for j in jobs}) == 1


def test_a_caller_set_cute_dsl_arch_reaches_the_workers(
    fake: RunnerHooks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90")
    out = tmp_path / "results.json"
    assert main(run_args(out), fake) == 0
    assert {j["cute_arch"] for j in calls(tmp_path)} == {"sm_90"}
    assert read_results(out).environment.worker_env == {"CUTE_DSL_ARCH": "sm_90"}


def test_a_job_killed_during_its_graph_replays_keeps_its_checkpointed_eager_result(tmp_path: Path) -> None:
    from hopperbench.results import SideResult
    from hopperbench.worker import WorkerJob
    from hopperbench.worker_pool import JobExit, JobFiles

    files = JobFiles(job=tmp_path / "j.json", result=tmp_path / "r.json", log=tmp_path / "log")
    eager = SideResult(side="ours", status=Status.PASSED, latency_ms=0.5, min_ms=0.4, max_ms=0.6)
    files.result.write_text(eager.model_dump_json())
    side = Side(name="ours", kind=SideKind.OURS, track="moe", available=True)
    job = WorkerJob(track="moe", side=side, workload={}, seed=0, trials=3, warmup=1, iterations=5, scratch_dir=tmp_path)
    result = runner._job_result(job, files, JobExit(returncode=None, timed_out=True, wall_s=300.0), 300.0)
    assert result.status == Status.PASSED and result.latency_ms == 0.5
    assert result.graph_status == "FAILED" and "did not finish within 300 s" in (result.graph_message or "")
    # Without a checkpoint the job is a timeout, as before.
    files.result.unlink()
    assert runner._job_result(job, files, JobExit(returncode=None, timed_out=True, wall_s=300.0), 300.0).status == Status.TIMEOUT


def test_every_side_but_the_reference_warms_up_on_the_runs_largest_workload(fake: RunnerHooks, tmp_path: Path) -> None:
    from hopperbench.workloads import load_workloads

    out = tmp_path / "results.json"
    assert main(run_args(out, "--max-workloads", "3"), fake) == 0
    planned = load_workloads("moe")[:3]
    largest = max(planned, key=lambda w: w.axes["seq_len"])
    for call in calls(tmp_path):
        assert call["warmup"] == (None if call["side"] == "reference" else largest.uuid)
    protocol = read_results(out).environment.protocol
    assert "largest workload" in protocol["side_warmup"] and "withholding the same" in protocol["twin_warmup"]


def test_a_twin_warms_up_on_the_largest_twin_so_an_autotuner_keyed_on_types_tunes_there(
    fake: RunnerHooks, tmp_path: Path
) -> None:
    from hopperbench.workloads import load_workloads

    out = tmp_path / "results.json"
    argv = ["--track", "gdn_prefill", "--max-workloads", "2", "--iterations", "1", "--output", str(out)]
    assert main(argv, fake) == 0
    planned = load_workloads("gdn_prefill")[:2]  # both lead their size classes: both have a no-state twin
    largest = max(planned, key=lambda w: w.axes["total_seq_len"])
    warmups = {(c["uuid"], tuple(c["withheld"])): (c["warmup"], c["warmup_withheld"]) for c in calls(tmp_path)
               if c["side"] == "ours"}  # fmt: skip
    assert warmups == {
        **{(w.uuid, ()): (largest.uuid, []) for w in planned},
        **{(w.uuid, ("state",)): (largest.uuid, ["state"]) for w in planned},
    }
