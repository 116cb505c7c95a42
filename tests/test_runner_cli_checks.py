"""The runner's command-line checks without a GPU: every check before the CUDA and CUPTI ones,
--list, --dry-run, an unwritable --output, uuid prefixes, and journal errors that name the file."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from hopperbench import runner
from hopperbench.results import Journal, read_results
from hopperbench.runner import RunnerHooks, main
from hopperbench.tracks import TRACKS
from hopperbench.workloads import BlobRef, WorkloadSelectionError, WorkloadSpec, load_workloads, resolve_uuids
from tests.test_runner_cli import calls, fake, run_args  # noqa: F401  (fake is a fixture)


def machine_refused(hooks: RunnerHooks) -> RunnerHooks:
    """Hooks whose CUDA and CUPTI checks fail, as on a machine without a GPU."""

    def no_cuda(requested):
        raise runner.CliError("no CUDA device is visible")

    def no_cupti():
        raise runner.CliError("cupti-python is not installed")

    return replace(hooks, check_devices=no_cuda, timer_protocol=no_cupti)


def machine_untouched(hooks: RunnerHooks) -> RunnerHooks:
    """Hooks that fail the test if the CUDA or CUPTI check, the environment or a worker is reached."""

    def refuse(*args, **kwargs):
        raise AssertionError("must not touch the GPU")

    return replace(hooks, check_devices=refuse, timer_protocol=refuse, collect_environment=refuse)


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("compare_human_best: error:") and err.count("\n") == 1, err
    assert captured.out == ""
    return err


def fake_lists(uuids: dict[str, list[str]]):
    def load(track: str, data_dir):
        return [
            WorkloadSpec(track=track, index=i, uuid=u, axes={"n": i + 1}, scalars={}, data_source="synthesized")
            for i, u in enumerate(uuids.get(track, [f"{track}-only-0"]))
        ]

    return load


# ------------------------------------------------------------------------------------------
# Every argument check comes before the CUDA and CUPTI checks


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--track", "moe", "--workloads", "no-such-uuid"], "unknown workload uuid"),
        (["--track", "moe", "--workloads", "abc"], "at least 6 characters"),
        (["--track", "nope"], "unknown track"),
        (["--sides", "ours,nobody"], "unknown side"),
        (["--data-dir", "/definitely/not/here"], "--data-dir"),
        (["--allow-unpinned", "nope"], "unknown track"),
        (["--resume"], "--resume needs --output"),
        (["--resume", "--output", "{tmp}/none.json"], "nothing to resume"),
        (["--output", "{tmp}/results.txt"], "must name a .json file"),
        (["--output", "{tmp}/file/results.json"], "is not a folder"),
        (["--environment-from", "{tmp}/x.json"], "only applies with --finalize"),
    ],
)
def test_argument_errors_come_before_the_gpu_checks(
    fake: RunnerHooks, tmp_path: Path, capsys, argv, fragment
) -> None:
    (tmp_path / "file").write_text("a file, not a folder")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--output" not in argv and "--resume" not in argv:
        argv = [*argv, "--output", str(tmp_path / "out" / "results.json")]
    assert main(argv, machine_refused(fake)) == 2
    err = one_line_error(capsys)
    assert fragment in err and "CUDA" not in err and "cupti" not in err
    assert not (tmp_path / "out").exists() and calls(tmp_path) == []


def test_the_journal_checks_come_before_the_gpu_checks(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    out = tmp_path / "results.json"
    assert main(run_args(out), fake) == 0
    capsys.readouterr()
    assert main(run_args(out), machine_refused(fake)) == 2
    assert "already exists; pass --resume" in one_line_error(capsys)
    assert main(run_args(out, "--resume", "--seed", "1"), machine_refused(fake)) == 2
    assert "seed" in one_line_error(capsys)
    assert main(run_args(out, "--resume", "--trials", "2"), machine_refused(fake)) == 2
    assert "trials" in one_line_error(capsys)
    # A journal that matches reaches the CUDA check, the last one.
    assert main(run_args(out, "--resume"), machine_refused(fake)) == 2
    assert "no CUDA device" in one_line_error(capsys)


def test_a_resume_under_another_timer_is_refused_after_the_cupti_check(
    fake: RunnerHooks, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "results.json"
    assert main(run_args(out), fake) == 0
    capsys.readouterr()
    assert main(run_args(out, "--resume"), replace(fake, timer_protocol=lambda: {"name": "other-timer"})) == 2
    err = one_line_error(capsys)
    assert "timing protocol differs in timer" in err and str(Journal.path_for(out)) in err


def test_a_resume_at_another_commit_is_refused(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    started, other = "a" * 40, "b" * 40

    def environment_at_started(request, slot):
        return fake.collect_environment(request, slot).model_copy(update={"repo_commit": started})

    out = tmp_path / "results.json"
    assert main(run_args(out), replace(fake, collect_environment=environment_at_started)) == 0
    capsys.readouterr()
    assert main(run_args(out, "--resume"), machine_refused(replace(fake, source_commit=lambda: other))) == 2
    err = one_line_error(capsys)
    assert f"started at commit {started[:10]}" in err and f"this checkout is {other[:10]}" in err
    # At the journal's commit, or where the commit cannot be told, the resume goes on to the GPU check.
    for commit in (started, None):
        assert main(run_args(out, "--resume"), machine_refused(replace(fake, source_commit=lambda: commit))) == 2
        assert "no CUDA device" in one_line_error(capsys)


def test_cuda_is_checked_before_cupti(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    assert main(run_args(tmp_path / "out" / "results.json"), machine_refused(fake)) == 2
    assert "no CUDA device" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_fewer_cores_than_devices_is_refused_before_the_gpu_checks(
    fake: RunnerHooks, tmp_path: Path, capsys
) -> None:
    hooks = replace(machine_refused(fake), available_cpus=lambda: {0}, physical_cores=lambda cpus: [[0]])
    assert main(run_args(tmp_path / "results.json", "--devices", "0,1"), hooks) == 2
    assert "--no-pin-cpus" in one_line_error(capsys)


# ------------------------------------------------------------------------------------------
# --workloads: unique uuid prefixes


def test_resolve_uuids() -> None:
    known = ["abcdef01-1", "abcdef02-2", "123456-x", "fedcba"]
    assert resolve_uuids(["abcdef01", "123456", "fedcba", "abcdef01-1"], known) == (
        ["abcdef01-1", "123456-x", "fedcba"],
        [],
    )
    assert resolve_uuids(["0000000", "abcdef02-2"], known) == (["abcdef02-2"], ["0000000"])
    assert resolve_uuids(["fedcba"], known) == (["fedcba"], [])  # a full uuid wins over being a prefix
    with pytest.raises(WorkloadSelectionError, match=r"'abcdef' is ambiguous: it matches 2 uuids \(abcdef01-1, ab"):
        resolve_uuids(["abcdef"], known)
    with pytest.raises(WorkloadSelectionError, match="at least 6 characters"):
        resolve_uuids(["abcde"], known)
    many = [f"aaaaaa{i}" for i in range(8)]
    with pytest.raises(WorkloadSelectionError, match=r"matches 8 uuids \(aaaaaa0, .*, aaaaaa4 and 3 more\)$"):
        resolve_uuids(["aaaaaa"], many)


def test_a_unique_prefix_selects_the_workload_and_the_records_hold_full_uuids(
    fake: RunnerHooks, tmp_path: Path
) -> None:
    uuids = [w.uuid for w in load_workloads("moe")]
    wanted = uuids[3]
    prefix = next(wanted[:n] for n in range(6, len(wanted)) if sum(u.startswith(wanted[:n]) for u in uuids) == 1)
    out = tmp_path / "results.json"
    assert main(["--track", "moe", "--workloads", prefix, "--iterations", "1", "--output", str(out)], fake) == 0
    assert [r.uuid for r in read_results(out).rows] == [wanted]
    header, records = Journal(Journal.path_for(out)).read()
    assert header.plan is not None and [w.uuid for w in header.plan["moe"].workloads] == [wanted]
    assert {r.workload.uuid for r in records} == {wanted}


def test_prefix_refusals_are_one_line(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    lists = {"moe": ["abcdef-1", "abcdef-2", "abcdef-3"], "gdn_prefill": ["abcdef-4", "123456-1"]}
    hooks = machine_refused(replace(fake, load_workloads=fake_lists(lists)))
    out = tmp_path / "out" / "results.json"
    cases = [
        ("abcdef", "'abcdef' is ambiguous: it matches 4 uuids (abcdef-4, abcdef-1, abcdef-2, abcdef-3)"),
        ("abcde", "at least 6 characters"),
        ("1234567", "unknown workload uuid(s) 1234567"),
    ]
    for text, fragment in cases:
        assert main(["--workloads", text, "--output", str(out)], hooks) == 2
        assert fragment in one_line_error(capsys)
    # The prefix of one track's workload picks that track alone (and its no-state twin: GDN samples
    # the first 4 workloads of a list without the size axis).
    assert main(["--list", "--workloads", "123456"], hooks) == 0
    assert capsys.readouterr().out.splitlines() == [
        "gdn_prefill\t1\t123456-1\tn=2\tsynthesized",
        "gdn_prefill\t1\t123456-1\tn=2\tsynthesized; without state",
    ]
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------
# --list


def test_list_prints_the_selected_workloads_without_a_gpu(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    hooks = machine_untouched(fake)
    moe = load_workloads("moe")
    assert main(["--list", "--track", "moe", "--max-workloads", "3"], hooks) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"moe\t{w.index}\t{w.uuid}\t{' '.join(f'{k}={v}' for k, v in w.axes.items())}\t{w.data_source}" for w in moe[:3]
    ]
    assert main(["--list", "--workloads", f"{moe[5].uuid},{moe[2].uuid[:8]}"], hooks) == 0
    assert [line.split("\t")[:3] for line in capsys.readouterr().out.splitlines()] == [
        ["moe", "2", moe[2].uuid],
        ["moe", "5", moe[5].uuid],
    ]
    assert main(["--list"], hooks) == 0
    listed = capsys.readouterr().out.splitlines()
    assert {line.split("\t")[0] for line in listed} == {"gdn_prefill", "moe", "dsa_attention"}
    assert all(len(line.split("\t")) == 5 for line in listed)
    assert calls(tmp_path) == [] and [p.name for p in tmp_path.iterdir()] == ["fake_worker.py"]


def test_list_refusals_are_one_line(fake: RunnerHooks, capsys) -> None:
    for argv, fragment in [
        (["--list", "--track", "nope"], "unknown track"),
        (["--list", "--workloads", "no-such-uuid"], "unknown workload uuid"),
        (["--list", "--data-dir", "/definitely/not/here"], "--data-dir"),
        (["--list", "--finalize"], "not allowed with"),
        (["--list", "--dry-run"], "not allowed with"),
    ]:
        assert main(argv, machine_untouched(fake)) == 2, argv
        assert fragment in one_line_error(capsys)


def test_list_shows_the_no_state_twins_of_the_first_4_workloads_of_each_size_class(
    fake: RunnerHooks, capsys
) -> None:
    gdn = TRACKS["gdn_prefill"]
    assert gdn.size_classes is not None
    by_class: dict[int, list[int]] = {}
    for w in load_workloads("gdn_prefill"):
        by_class.setdefault(gdn.size_classes.index(w.axes["total_seq_len"]), []).append(w.index)
    expected = sorted(i for indices in by_class.values() for i in indices[:4])
    assert len(expected) == 20
    assert main(["--list", "--track", "gdn_prefill"], machine_untouched(fake)) == 0
    lines = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    own = [line for line in lines if line[4] == "synthesized"]
    twins = [line for line in lines if line[4] == "synthesized; without state"]
    assert len(own) == 100 and len(lines) == 120
    assert lines[100:] == twins  # after the track's workloads, in index order
    assert [int(line[1]) for line in twins] == expected
    assert {tuple(line[:4]) for line in twins} <= {tuple(line[:4]) for line in own}
    # --max-workloads and --workloads count workloads; a selected workload in the sample brings its twin.
    assert main(["--list", "--track", "gdn_prefill", "--max-workloads", "4"], machine_untouched(fake)) == 0
    listed = [line.split("\t")[1] for line in capsys.readouterr().out.splitlines()]
    assert listed == ["0", "1", "2", "3"] * 2
    outside = load_workloads("gdn_prefill")[next(i for i in range(100) if i not in expected)].uuid
    assert main(["--list", "--workloads", outside], machine_untouched(fake)) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_on_official_data_only_workloads_whose_files_hold_a_state_get_a_twin() -> None:
    gdn = TRACKS["gdn_prefill"]
    state = {"state": BlobRef(path=Path("/data/blob.safetensors"), tensor_key="state")}
    workloads = [
        WorkloadSpec(track="gdn_prefill", index=i, uuid=f"w{i}", scalars={}, data_source="official",
                     axes={"total_seq_len": 10 + i, "num_seqs": 1, "len_cu_seqlens": 2},
                     blob_inputs=state if i % 3 else {})  # fmt: skip
        for i in range(12)
    ]
    rows = runner.with_twins(gdn, workloads, workloads)
    assert rows[:12] == workloads
    # All 12 are in the first size class; the first 4 that hold a state are sampled.
    assert [(w.index, w.withheld_inputs) for w in rows[12:]] == [(i, ("state",)) for i in (1, 2, 4, 5)]
    assert runner.with_twins(gdn, workloads, workloads[:3]) == [*workloads[:3], workloads[1].without("state"),
                                                                workloads[2].without("state")]  # fmt: skip
    assert runner.with_twins(TRACKS["moe"], workloads, workloads[:3]) == workloads[:3]  # no sample


# ------------------------------------------------------------------------------------------
# --dry-run


def test_dry_run_prints_the_plan_and_writes_nothing(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out" / "results.json"
    argv = ["--dry-run", "--track", "moe,gdn_prefill", "--max-workloads", "2", "--output", str(out)]
    assert main([*argv, "--devices", "0,1", "--no-pin-cpus"], machine_untouched(fake)) == 0
    lines = capsys.readouterr().out.splitlines()
    # GDN's workloads 0 and 1 are in its no-state sample (first of their size classes): 2 more rows.
    assert lines == [
        f"dry run: nothing run or written; output {out} (18 jobs)",
        "gdn_prefill: 2 workload(s), 2 of them also without state",
        "  runs: reference, ours",
        "  unavailable: human: not checked out here",
        "moe: 2 workload(s)",
        "  runs: reference, ours",
        "  unavailable: human: not checked out here",
        "not checked: the CUDA device(s) (--devices 0,1) and CUPTI; a run checks them before it writes anything",
    ]
    assert not (tmp_path / "out").exists() and calls(tmp_path) == []


def test_dry_run_refuses_what_a_run_would_refuse(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    def refuse(tracks, allow):
        raise runner.CliError("gdn_prefill: human_best/kachua-mlsys is off its pin")

    out = tmp_path / "out" / "results.json"
    hooks = machine_untouched(replace(fake, guard=refuse))
    assert main(["--dry-run", "--track", "moe", "--output", str(out)], hooks) == 2
    assert "off its pin" in one_line_error(capsys)
    assert main(["--dry-run", "--workloads", "abcd", "--output", str(out)], machine_untouched(fake)) == 2
    assert "at least 6 characters" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_dry_run_of_a_resume_counts_what_is_left(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    out = tmp_path / "results.json"
    assert main(run_args(out), fake) == 0
    journal = Journal(Journal.path_for(out))
    lines = journal.path.read_text().splitlines()
    journal.path.write_text("\n".join(line for line in lines if '"side":"ours"' not in line) + "\n")
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    capsys.readouterr()
    assert main(run_args(out, "--resume", "--dry-run"), machine_untouched(fake)) == 0
    stdout = capsys.readouterr().out
    # 2 workloads x (reference, ours, human): the two "ours" are missing, human (unavailable) is looked at again.
    assert f"(resume {journal.path}, 4 of 6 jobs to run)" in stdout.splitlines()[0]
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    assert main(run_args(out, "--resume", "--dry-run", "--seed", "3"), machine_untouched(fake)) == 2
    assert "seed" in one_line_error(capsys)


# ------------------------------------------------------------------------------------------
# An unwritable --output


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder")
def test_output_in_a_read_only_folder_is_one_line(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        for out in (locked / "results.json", locked / "new" / "deeper" / "results.json"):
            assert main(run_args(out), fake) == 2
            assert f"cannot write in {locked}" in one_line_error(capsys)
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_unwritable_output_is_one_line_and_writes_nothing(
    fake: RunnerHooks, tmp_path: Path, capsys, monkeypatch
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access

    def access(path, mode, *args, **kwargs):  # as a read-only folder looks to a user other than root
        if Path(path) == locked and mode & os.W_OK:
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    hooks = machine_refused(fake)
    out = locked / "run" / "results.json"
    for argv in (run_args(out), run_args(out, "--dry-run")):
        assert main(argv, hooks) == 2
        err = one_line_error(capsys)
        assert f"--output {out}: cannot write in {locked} (where {out.parent} would be created)" in err
    assert main(run_args(locked / "results.json"), hooks) == 2
    assert f"cannot write in {locked}" in one_line_error(capsys)
    assert list(locked.iterdir()) == []


def test_output_under_a_file_or_naming_a_folder_is_one_line(fake: RunnerHooks, tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("a file, not a folder")
    for out, fragment in [
        (tmp_path / "file" / "results.json", f"{tmp_path / 'file'} is not a folder"),
        (tmp_path / "file" / "a" / "b" / "results.json", f"{tmp_path / 'file'} is not a folder"),
    ]:
        assert main(run_args(out), fake) == 2
        assert fragment in one_line_error(capsys)
    (tmp_path / "folder.json").mkdir()
    assert main(run_args(tmp_path / "folder.json"), fake) == 2
    assert "is a folder; name a .json file" in one_line_error(capsys)
    assert (tmp_path / "file").read_text() == "a file, not a folder"
    assert list((tmp_path / "folder.json").iterdir()) == [] and calls(tmp_path) == []


# ------------------------------------------------------------------------------------------
# Journal errors name the journal


JOURNAL_DAMAGE = {
    "empty": lambda lines: "",
    "corrupt record": lambda lines: "\n".join([lines[0], "{not json", *lines[1:]]) + "\n",
    "corrupt header": lambda lines: "\n".join(["{not json", *lines[1:]]) + "\n",
    "another header": lambda lines: "\n".join([lines[0].replace('"seed"', '"bogus":1,"seed"'), *lines[1:]]) + "\n",
    "not utf-8": None,
}


@pytest.mark.parametrize("damage", list(JOURNAL_DAMAGE))
@pytest.mark.parametrize("mode", ["resume", "dry-run", "finalize"])
def test_journal_errors_name_the_journal(fake: RunnerHooks, tmp_path: Path, capsys, damage, mode) -> None:
    out = tmp_path / "results.json"
    assert main(run_args(out), fake) == 0
    journal = Journal.path_for(out)
    rewrite = JOURNAL_DAMAGE[damage]
    if rewrite is None:
        journal.write_bytes(b"\xff\xfe" + journal.read_bytes())
    else:
        journal.write_text(rewrite(journal.read_text().splitlines()))
    out.unlink()
    capsys.readouterr()
    argv = {
        "resume": run_args(out, "--resume"),
        "dry-run": run_args(out, "--resume", "--dry-run"),
        "finalize": ["--finalize", "--output", str(out)],
    }[mode]
    assert main(argv, machine_refused(fake)) == 2
    err = one_line_error(capsys)
    assert str(journal) in err and err.count(str(journal)) == 1, err
    assert not out.exists()
