"""The paired runner: `uv run benchmarks/compare_human_best.py`.

It checks every input before it writes anything (a bad flag, an unknown uuid, a
missing data folder, an unwritable --output, a journal that cannot be resumed, a
tampered human_best pin, no CUDA device or no CUPTI is one line on stderr and exit
code 2; the CUDA and CUPTI checks come last, so that a machine without a GPU
validates everything else), then runs every (side, workload) of the selected
tracks in its own worker process (`hopperbench.worker`), the reference side of a
workload first because the others are checked against its stored outputs.
`--dry-run` stops after the checks but the CUDA and CUPTI ones and prints the plan;
`--list` prints the selected workloads. Neither needs a GPU or writes anything.
`--workloads` takes full uuids or unique prefixes of at least 6 characters. `--workload-list offlist`
takes a track's off-list workloads instead of its listed ones (`hopperbench.workloads.load_offlist`;
the tracks that have some only), into a results file of its own: never the canonical
`results/h200/latest.json`, and the protocol records the list, so that neither a resume nor
`tools/merge_track_runs.py` can mix its rows with the listed ones. A selected workload
in its track's `absent_input_sample` also runs as its twin without that input, a row of its own
(planned after the track's workloads; the sample is drawn from the track's whole list, so a
workload's twin does not depend on what else is selected).

Worker processes are forked from a warm server per device that has already imported
torch, triton, flashinfer_bench, ... (`hopperbench.worker_pool`, whose docstring states
the isolation guarantees), one long-lived process per track and side (a session) that
builds and compiles its side on its first job and runs all of that side's jobs;
`--no-preload` starts a fresh interpreter per job instead, which builds and compiles itself.
Either way workers get CUTE_DSL_ARCH=sm_90a unless it is set (`WORKER_DEFAULTS`),
so that no CuTe-DSL compile asks the CUDA driver for the architecture.
Each device's workers are pinned to their own share of the CPU cores (`--no-pin-cpus`
turns that off); the shares are recorded in the environment record.

The environment record is collected once, when the run starts (in a child process,
so that the runner holds no CUDA context), and kept in the journal's header with the
plan (the workloads and sides to record); a resume keeps both and notes its time, and runs
only at the commit the run started at (every row is recorded under that one commit).
Each finished result is appended to `<output stem>.journal.jsonl` at once (fsync), so
a killed run resumes with `--resume` where it stopped; the JSON and CSV are written
from the journal at the end, or, for an interrupted run (Ctrl-C, SIGTERM), at once
with what it recorded, marked partial. `--finalize` writes them from an existing
journal without running anything. Worker logs go to `<output stem>.logs/`, the stored
reference outputs to `<output stem>.scratch/` (removed when the run completes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from queue import Queue
from typing import Any

from hopperbench.environment import (
    EnvironmentRecord,
    EnvironmentRequest,
    collect_environment,
    guard_summary,
    source_commit,
)
from hopperbench.paths import BENCHMARK_DATA_DIR, CANONICAL_RESULTS, REPO_ROOT
from hopperbench.results import (
    GraphStatus,
    Journal,
    JournalHeader,
    JournalMismatchError,
    PlannedRow,
    PlannedTrack,
    ResultsFile,
    RowId,
    SideRecord,
    SideResult,
    Status,
    WorkloadKey,
    csv_path_for,
    format_completeness,
    format_summary_table,
    merge_plans,
    plan_from_records,
    row_id,
    write_journal_results,
)
from hopperbench.sides import HUMAN, REFERENCE, Side, SideContext, SideKind, known_side_names, sides_for
from hopperbench.tracks import TRACKS, Track, UnknownTrackError, get_track, parse_track_list
from hopperbench.worker import WorkerJob, reference_output_path
from hopperbench.worker_pool import (
    DEFAULT_PRELOAD,
    DEFAULT_PRELOAD_IF_FORK_SAFE,
    CpuSplitError,
    ForkServerLauncher,
    JobExit,
    JobFiles,
    Launcher,
    LaunchStopped,
    SubprocessLauncher,
    WorkerPoolError,
    available_cpus,
    describe_exit,
    physical_cores,
    split_cpus,
)
from hopperbench.workloads import MIN_UUID_PREFIX, OFFLIST, WORKLOAD_LIST_PROTOCOL_KEY, WORKLOAD_LISTS, row_name

PROG = "compare_human_best"
LOG_TAIL_CHARS = 2000


class CliError(Exception):
    """Bad input or a missing prerequisite; printed as one line, exit code 2."""


class RunInterrupted(BaseException):
    """SIGTERM or SIGINT arrived during a run (a BaseException, like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# ------------------------------------------------------------------------------------------
# Arguments


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, not argparse's usage block
        raise CliError(message)


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _comma_list(text: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError("empty list")
    return items


def _device_list(text: str) -> list[int]:
    parse = _count(0)
    devices = [parse(item) for item in _comma_list(text)]
    if len(set(devices)) != len(devices):
        raise argparse.ArgumentTypeError(f"device listed twice in {text!r}")
    return devices


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Time our kernels, the contest winners and the references on this GPU.")
    p.add_argument("--track", default="all", help="all, or a comma list of: gdn_prefill, moe, dsa_attention")
    p.add_argument("--warmup", type=_count(0), default=3, help="warm-up calls per trial (default 3)")
    p.add_argument("--iterations", type=_count(1), default=50, help="timed calls per trial (default 50)")
    p.add_argument("--trials", type=_count(1), default=3, help="input sets per workload (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthesized inputs (default 0)")
    p.add_argument("--max-workloads", type=_count(1), default=None, help="at most N workloads per track")
    p.add_argument(
        "--workloads",
        type=_comma_list,
        default=None,
        metavar="UUID,...",
        help=f"only these workloads (full uuids, or unique prefixes of >= {MIN_UUID_PREFIX} characters)",
    )
    p.add_argument(
        "--workload-list",
        choices=WORKLOAD_LISTS,
        default="listed",
        help="the tracks' listed workloads (default), or their off-list ones (not into the canonical results)",
    )
    p.add_argument("--output", type=Path, default=None, help="results JSON (default runs/<timestamp>/results.json)")
    p.add_argument("--resume", action="store_true", help="continue the run whose journal is beside --output")
    p.add_argument("--timeout", type=_positive_seconds, default=300.0, help="seconds per worker process (default 300)")
    p.add_argument(
        "--allow-unpinned",
        action="append",
        type=_comma_list,
        default=[],
        metavar="TRACK",
        help="run this track's human side even if its submodule is off its pin (repeatable or comma list)",
    )
    p.add_argument("--sides", type=_comma_list, default=None, help="ours,human,reference,<library> (default all)")
    p.add_argument("--devices", type=_device_list, default=None, help="GPU indices to spread workloads over")
    p.add_argument("--data-dir", type=Path, default=None, help="official workload data (default benchmark_data/)")
    p.add_argument("--reference-warmup", type=_count(0), default=None, help="override the tracks' reference warm-up")
    p.add_argument(
        "--reference-iterations",
        type=_count(0),
        default=None,
        help="override the tracks' reference iterations (0 = untimed)",
    )
    p.add_argument("--keep-scratch", action="store_true", help="keep the stored reference outputs after the run")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--finalize",
        action="store_true",
        help="write the JSON and CSV of the journal beside --output without running anything (no GPU needed)",
    )
    mode.add_argument(
        "--dry-run",
        action="store_true",
        help="check the command line and print the plan without running or writing anything (no GPU needed)",
    )
    mode.add_argument(
        "--list",
        action="store_true",
        help="print the selected workloads (track, index, uuid, axes, data source) and exit (no GPU needed)",
    )
    p.add_argument(
        "--environment-from",
        type=Path,
        default=None,
        metavar="RESULTS.json",
        help="with --finalize: attach this results file's environment to a journal that records none",
    )
    p.add_argument(
        "--no-preload",
        action="store_true",
        help="start a fresh interpreter per job instead of forking it from a warm per-device server",
    )
    p.add_argument(
        "--no-pin-cpus",
        action="store_true",
        help="do not pin each device's workers to their own share of the CPU cores",
    )
    return p


# ------------------------------------------------------------------------------------------
# Prerequisites, replaceable in tests


def check_cuda_devices(requested: list[int] | None) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES value per worker slot (None = inherit); raises CliError without CUDA."""
    import torch

    if not torch.cuda.is_available():
        raise CliError(
            "no CUDA device is visible (torch.cuda.is_available() is False); this benchmark needs an NVIDIA GPU"
        )
    if requested is None:
        return [None]
    count = torch.cuda.device_count()
    too_high = [d for d in requested if d >= count]
    if too_high:
        raise CliError(f"--devices {','.join(map(str, too_high))}: only {count} CUDA device(s) are visible")
    # Indices are relative to what this process sees; keep an inherited CUDA_VISIBLE_DEVICES meaningful.
    inherited = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return [inherited[d] if d < len(inherited) else str(d) for d in requested]


def timer_protocol() -> dict[str, Any]:
    """The CUPTI timer's protocol record; raises CliError when CUPTI cannot be used."""
    import importlib.util

    from hopperbench.timing import cupti_timer

    version = cupti_timer.cupti_python_version()
    if importlib.util.find_spec("cupti") is None or version is None:
        raise CliError(f"cupti-python is not installed; the timer needs cupti-python>={cupti_timer.MIN_CUPTI_MAJOR}")
    if int(version.split(".")[0]) < cupti_timer.MIN_CUPTI_MAJOR:
        raise CliError(
            f"cupti-python {version} is too old; the timer needs major version >= {cupti_timer.MIN_CUPTI_MAJOR}"
        )
    return {**cupti_timer.PROTOCOL, "cupti_python": version}


def run_guard(tracks: list[Track], allow_unpinned: set[str]) -> dict[str, Any]:
    from hopperbench.human_best import ManifestError
    from hopperbench.integrity import GitError, IntegrityError, guard

    try:
        return guard(tracks, allow_unpinned, REPO_ROOT)
    except (IntegrityError, GitError, ManifestError) as e:
        raise CliError(str(e)) from None


def load_track_workloads(track: str, data_dir: Path | None) -> list[Any]:
    from hopperbench.definitions import DefinitionError
    from hopperbench.workloads import WorkloadError, load_workloads

    try:
        return load_workloads(track, data_dir)
    except (WorkloadError, DefinitionError) as e:
        raise CliError(str(e)) from None


def load_track_offlist(track: str) -> list[Any]:
    from hopperbench.definitions import DefinitionError
    from hopperbench.workloads import WorkloadError, load_offlist

    try:
        return load_offlist(track)
    except (WorkloadError, DefinitionError) as e:
        raise CliError(str(e)) from None


def select_track_workloads(workloads: list[Any], uuids: list[str] | None, max_count: int | None) -> list[Any]:
    from hopperbench.workloads import WorkloadSelectionError, select_workloads

    try:
        return select_workloads(workloads, uuids, max_count)
    except WorkloadSelectionError as e:
        raise CliError(str(e)) from None


def collect_environment_isolated(request: EnvironmentRequest, cuda_visible: str | None) -> EnvironmentRecord:
    """Collect in a child process (so this one holds no CUDA context); without GPU probes if it fails.

    The request and the record pass through a folder outside the checkout: a file written inside it
    (a log folder the checkout does not ignore) would change the tree id the record hashes.
    """
    with tempfile.TemporaryDirectory(prefix="hopperbench-env-") as folder:
        request_file, record_file = Path(folder) / "request.json", Path(folder) / "record.json"
        request_file.write_text(request.model_dump_json(), encoding="utf-8")
        command = [sys.executable, "-m", "hopperbench.environment", str(request_file), str(record_file)]
        try:
            subprocess.run(command, env=_child_env(cuda_visible), cwd=REPO_ROOT, timeout=300, capture_output=True,
                           check=True)  # fmt: skip
            return EnvironmentRecord.model_validate_json(record_file.read_text(encoding="utf-8"))
        except Exception:
            return collect_environment(request.model_copy(update={"probe_gpu": False}))


@dataclass(frozen=True)
class RunnerHooks:
    """What the runner needs from the machine; tests replace these to run without a GPU."""

    worker_command: Sequence[str] = (sys.executable, "-m", "hopperbench.worker")
    check_devices: Callable[[list[int] | None], list[str | None]] = check_cuda_devices
    timer_protocol: Callable[[], dict[str, Any]] = timer_protocol
    guard: Callable[[list[Track], set[str]], dict[str, Any]] = run_guard
    load_workloads: Callable[[str, Path | None], list[Any]] = load_track_workloads
    load_offlist: Callable[[str], list[Any]] = load_track_offlist
    select_workloads: Callable[[list[Any], list[str] | None, int | None], list[Any]] = select_track_workloads
    sides_for: Callable[[Track, SideContext], list[Side]] = sides_for
    collect_environment: Callable[[EnvironmentRequest, str | None], EnvironmentRecord] = (
        collect_environment_isolated
    )
    # Where the worker process runs (the package must be importable from there).
    worker_cwd: Path = REPO_ROOT
    show_progress: bool = True
    # What each device's fork server imports before it forks jobs.
    preload_modules: tuple[str, ...] = DEFAULT_PRELOAD
    preload_if_fork_safe: tuple[str, ...] = DEFAULT_PRELOAD_IF_FORK_SAFE
    available_cpus: Callable[[], set[int]] = available_cpus
    physical_cores: Callable[[set[int]], list[list[int]]] = physical_cores
    # The commit this checkout records results under (a resume must be at the journal's).
    source_commit: Callable[[], str | None] = source_commit


# ------------------------------------------------------------------------------------------
# The plan: everything checked, nothing written yet


@dataclass(frozen=True)
class TrackPlan:
    track: Track
    workloads: list[Any]  # rows: the selected workloads, then their twins
    sides: list[Side]  # the reference first
    reference: ReferenceTiming


@dataclass
class RunPlan:
    tracks: list[TrackPlan]
    output: Path
    resume: bool
    seed: int
    trials: int
    warmup: int
    iterations: int
    timeout: float
    slots: list[str | None]
    header: JournalHeader
    finished: dict[tuple[RowId, str], SideRecord] = field(default_factory=dict)
    guard_results: dict[str, Any] = field(default_factory=dict)
    keep_scratch: bool = False
    # Per slot, the CPU cores its workers are pinned to; None = not pinned.
    cpu_sets: list[list[int]] | None = None
    preload: bool = True

    @property
    def journal(self) -> Journal:
        return Journal(Journal.path_for(self.output))

    @property
    def scratch_dir(self) -> Path:
        return self.output.with_name(self.output.stem + ".scratch")

    @property
    def logs_dir(self) -> Path:
        return self.output.with_name(self.output.stem + ".logs")


def _default_output() -> Path:
    return REPO_ROOT / "runs" / datetime.now().strftime("%Y%m%d-%H%M%S") / "results.json"


def _select_workloads(
    tracks: list[Track], args: argparse.Namespace, data_dir: Path | None, hooks: RunnerHooks
) -> dict[str, list[Any]]:
    """Per track with something selected, its rows: the selected workloads, then their twins;
    --workloads' prefixes resolved to full uuids."""
    from hopperbench.workloads import WorkloadSelectionError, resolve_uuids

    if args.workload_list == OFFLIST:
        everything = {t.name: hooks.load_offlist(t.name) for t in tracks}
    else:
        everything = {t.name: hooks.load_workloads(t.name, data_dir) for t in tracks}
    by_name = {t.name: t for t in tracks}
    if args.workloads is None:
        return {
            name: with_twins(by_name[name], ws, hooks.select_workloads(ws, None, args.max_workloads))
            for name, ws in everything.items()
        }
    owner = {w.uuid: name for name, ws in everything.items() for w in ws}
    try:
        uuids, unknown = resolve_uuids(args.workloads, list(owner))
    except WorkloadSelectionError as e:
        raise CliError(str(e)) from None
    if unknown:
        raise CliError(f"unknown workload uuid(s) {', '.join(unknown)} (not in the lists of {', '.join(everything)})")
    selected = {}
    for name, ws in everything.items():
        mine = [u for u in uuids if owner[u] == name]
        if mine:
            selected[name] = with_twins(by_name[name], ws, hooks.select_workloads(ws, mine, args.max_workloads))
    return selected


def with_twins(track: Track, everything: Sequence[Any], selected: list[Any]) -> list[Any]:
    """`selected`, then the twin of each selected workload in the track's `absent_input_sample`,
    drawn from the whole list `everything` among the workloads whose inputs give the sampled input."""
    sample = track.absent_input_sample
    if sample is None:
        return selected
    from hopperbench.synth import absent_optional_inputs

    gives = [w for w in everything if sample.input not in absent_optional_inputs(track.name, w)]
    sampled = {w.uuid for w in sample.select(gives, track.size_classes)}
    return [*selected, *(w.without(sample.input) for w in selected if w.uuid in sampled)]


def _requested_sides(args: argparse.Namespace, tracks: list[Track]) -> set[str] | None:
    if args.sides is None:
        return None
    known = known_side_names(tracks)
    unknown = [s for s in args.sides if s not in known]
    if unknown:
        raise CliError(f"unknown side(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    return set(args.sides)


def _side_wanted(side: Side, wanted: set[str] | None) -> bool:
    """The reference always runs (every other side is checked against it); candidates only when
    named, since a default run publishes ours against the others."""
    if side.name == REFERENCE:
        return True
    if wanted is None:
        return side.kind != SideKind.CANDIDATE
    return side.name in wanted


def _cpu_shares(slot_count: int, args: argparse.Namespace, hooks: RunnerHooks) -> list[list[int]] | None:
    if args.no_pin_cpus:
        return None
    try:
        cpus = hooks.available_cpus()
        return split_cpus(cpus, slot_count, hooks.physical_cores(cpus))
    except CpuSplitError as e:
        raise CliError(f"{e}; pass --no-pin-cpus to run unpinned") from None


def _selected_tracks(args: argparse.Namespace) -> list[Track]:
    try:
        tracks = parse_track_list(args.track)
    except UnknownTrackError as e:
        raise CliError(str(e)) from None
    if args.workload_list == OFFLIST:
        _check_offlist_tracks(tracks)
    return tracks


def _check_offlist_tracks(tracks: list[Track]) -> None:
    """--workload-list offlist: every selected track must have off-list workloads."""
    lacking = [t.name for t in tracks if not t.offlist_path.is_file()]
    if lacking:
        having = [t.name for t in TRACKS.values() if t.offlist_path.is_file()]
        raise CliError(
            f"--workload-list {OFFLIST}: no off-list workloads for {', '.join(lacking)};"
            f" pass --track {','.join(having) or '(no track has any)'}"
        )


def _check_offlist_output(args: argparse.Namespace, output: Path) -> None:
    """Off-list rows get a results file of their own: the canonical run holds the listed workloads only."""
    if args.workload_list == OFFLIST and output.resolve() == CANONICAL_RESULTS.resolve():
        raise CliError(
            f"--workload-list {OFFLIST} cannot write {CANONICAL_RESULTS.relative_to(REPO_ROOT)}:"
            " the canonical run holds the listed workloads only"
        )


def _data_dir(args: argparse.Namespace) -> Path:
    if args.data_dir is not None and not args.data_dir.is_dir():
        raise CliError(f"--data-dir {args.data_dir} is not a folder")
    return args.data_dir if args.data_dir is not None else BENCHMARK_DATA_DIR


def check_output_writable(output: Path) -> None:
    """Refuse an --output whose files could not be created, before anything is: the nearest
    existing folder above it must be writable (the missing ones are created there), and no
    component of its folder may be a file."""
    if output.is_dir():
        raise CliError(f"--output {output} is a folder; name a .json file")
    existing = output.parent
    while not os.path.lexists(existing) and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise CliError(f"--output {output}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == output.parent else f" (where {output.parent} would be created)"
        raise CliError(f"--output {output}: cannot write in {existing}{where}")


def _journal_error(journal: Journal, error: Exception) -> CliError:
    """One line that names the journal (results.py's messages already do; others get it prepended)."""
    if isinstance(error, OSError):
        return CliError(f"cannot read {journal.path}: {error.strerror or error}")
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    return CliError(message if str(journal.path) in message else f"{journal.path}: {message}")


def _check_same_commit(journal: Journal, recorded: JournalHeader, commit: str | None) -> None:
    """A resume runs at the commit the journal was started at: the results record one commit for
    every row (ours' version, the CSV's `commit`), so rows from another would be mislabelled."""
    started = recorded.environment.repo_commit if recorded.environment is not None else None
    if started is not None and commit is not None and started != commit:
        raise CliError(
            f"cannot resume {journal.path}: it was started at commit {started[:10]} and this checkout is "
            f"{commit[:10]}; resume it at {started[:10]} or start a new run"
        )


def _check_resumable(
    journal: Journal, header: JournalHeader, timer_checked: bool, commit: str | None = None
) -> list[SideRecord]:
    """The journal's records if `header` may continue it. Before the timer is known (`timer_checked`
    False) its protocol entry is taken as the journal's own, so that every other difference is
    reported without the CUPTI check; that first pass also checks the checkout's `commit`."""
    try:
        if timer_checked:
            return journal.check_resumable(header)
        recorded, _ = journal.read()
        protocol = {**header.protocol, "timer": recorded.protocol.get("timer")}
        records = journal.check_resumable(header.model_copy(update={"protocol": protocol}))
    except (JournalMismatchError, ValueError, OSError) as e:
        raise _journal_error(journal, e) from None
    _check_same_commit(journal, recorded, commit)
    return records


def plan_run(args: argparse.Namespace, hooks: RunnerHooks, check_machine: bool = True) -> RunPlan:
    """Check every input and build the plan; nothing is written.

    The checks that need no GPU come first (flags, tracks, sides, data folder, output, workloads,
    the human_best guard, the journal to resume), so that any machine can validate a command line;
    the CUDA device and CUPTI checks come last, and only with `check_machine` (not for --dry-run,
    whose plan then has the requested devices as its slots and no timer in its protocol).
    """
    if args.environment_from is not None:
        raise CliError("--environment-from only applies with --finalize")
    tracks = _selected_tracks(args)
    try:
        allow_unpinned = {get_track(t).name for group in args.allow_unpinned for t in group}
    except UnknownTrackError as e:
        raise CliError(str(e)) from None
    data_dir = _data_dir(args)
    wanted_sides = _requested_sides(args, tracks)

    if args.resume and args.output is None:
        raise CliError("--resume needs --output, the results JSON of the run to continue")
    output = (args.output if args.output is not None else _default_output()).absolute()
    if output.suffix != ".json":
        raise CliError(f"--output must name a .json file, got {output.name}")
    _check_offlist_output(args, output)
    check_output_writable(output)
    journal = Journal(Journal.path_for(output))
    if args.resume and not journal.exists():
        raise CliError(f"nothing to resume: {journal.path} does not exist")
    if args.resume and not os.access(journal.path, os.W_OK):
        raise CliError(f"cannot resume {journal.path}: it is not writable")
    if not args.resume:
        existing = [p for p in (output, csv_path_for(output), journal.path) if p.exists()]
        if existing:
            raise CliError(f"{existing[0]} already exists; pass --resume to continue that run or another --output")

    workloads = _select_workloads(tracks, args, data_dir, hooks)
    tracks = [t for t in tracks if t.name in workloads]
    requested_slots: list[str | None] = [None] if args.devices is None else [str(d) for d in args.devices]
    cpu_sets = _cpu_shares(len(requested_slots), args, hooks)
    protocol: dict[str, Any] = {
        "timer": None,  # hooks.timer_protocol(), below
        "warmup": args.warmup,
        "iterations": args.iterations,
        "trials": args.trials,
        "side_warmup": SIDE_WARMUP,
        "twin_warmup": TWIN_WARMUP,
    }
    if args.workload_list == OFFLIST:
        # Only off-list runs record it: a listed run's protocol stays what earlier runs recorded.
        protocol[WORKLOAD_LIST_PROTOCOL_KEY] = OFFLIST
    run_human = wanted_sides is None or HUMAN in wanted_sides
    guard_results = hooks.guard(tracks, allow_unpinned) if run_human else {}
    ctx = SideContext(guard_results=guard_results)

    # Every track's reference protocol, selected or not, so that a run resumes with any --track.
    reference_timing = {t.name: _reference_timing(t, args, wanted_sides) for t in TRACKS.values()}
    protocol["reference"] = {name: timing.record() for name, timing in reference_timing.items()}
    plans = []
    for track in tracks:
        sides = [s for s in hooks.sides_for(track, ctx) if _side_wanted(s, wanted_sides)]
        sides.sort(key=lambda s: s.name != REFERENCE)  # stable: the reference first, the rest as resolved
        plans.append(TrackPlan(track, workloads[track.name], sides, reference_timing[track.name]))

    planned = {
        tp.track.name: PlannedTrack(
            workloads=[PlannedRow(uuid=w.uuid, absent_inputs=_row_id(tp, w)[2]) for w in tp.workloads],
            sides=[s.name for s in tp.sides],
        )
        for tp in plans
    }
    header = JournalHeader(seed=args.seed, protocol=protocol, plan=planned)
    records = (
        _check_resumable(journal, header, timer_checked=False, commit=hooks.source_commit()) if args.resume else []
    )

    # Last, the machine: CUDA devices, then CUPTI.
    slots = requested_slots
    if check_machine:
        slots = hooks.check_devices(args.devices)
        if len(slots) != len(requested_slots):
            cpu_sets = _cpu_shares(len(slots), args, hooks)
        header.protocol["timer"] = hooks.timer_protocol()
        if args.resume:
            records = _check_resumable(journal, header, timer_checked=True)
    # An unavailable side is looked at again: its kernel or checkout may exist now.
    finished = {r.key: r for r in records if r.result.status != Status.UNAVAILABLE}
    return RunPlan(
        tracks=plans,
        output=output,
        resume=args.resume,
        seed=args.seed,
        trials=args.trials,
        warmup=args.warmup,
        iterations=args.iterations,
        timeout=args.timeout,
        slots=slots,
        header=header,
        finished=finished,
        guard_results=guard_results,
        keep_scratch=args.keep_scratch,
        cpu_sets=cpu_sets,
        preload=not args.no_preload,
    )


# What every process of a side does before its first job (worker.JobRunner.warm_up).
SIDE_WARMUP = (
    "one untimed call on trial 0 of the run's largest workload of the track (by its size axis), once "
    "per side process, before its first job: autotuners choose there, as in a serving engine's warm-up"
)
# And before its first job that withholds optional inputs (GDN's no-state twins). Recorded apart from
# SIDE_WARMUP because it concerns a track's twins only: `tools/merge_track_runs.py` does not compare it
# across tracks (a track's rows, twins included, always come from one run).
TWIN_WARMUP = (
    "one more untimed call, before the process's first job that withholds optional inputs, on the run's "
    "largest workload withholding the same ones: an autotuner keyed on argument types (Triton's) tunes "
    "that variant there, not on whichever twin comes first"
)


def largest_workload(track: Track, workloads: Sequence[Any], withheld: tuple[str, ...] = ()) -> Any | None:
    """The workload a side's process warms up on before a job whose calls withhold `withheld`: the
    largest of the run's workloads that withhold the same inputs, by the track's size axis (the first
    of equals), or None for a track without size classes (or workloads without that axis). Per set of
    withheld inputs because an autotuner may key on the arguments' types (Triton's does): a call
    without GDN's state is another kernel variant, tuned on whichever shape meets it first."""
    workloads = [w for w in workloads if tuple(w.withheld_inputs) == tuple(withheld)]
    if track.size_classes is None or not workloads:
        return None
    axis = track.size_classes.axis
    if any(axis not in w.axes for w in workloads):
        return None
    return max(workloads, key=lambda w: int(w.axes[axis]))


def _first(*values: int | None) -> int:
    return next(v for v in values if v is not None)


@dataclass(frozen=True)
class ReferenceTiming:
    """The reference side's counts (flag, else the track's default, else the kernels') and the
    track's time budget per trial, which caps them for slow calls (`cupti_timer.budgeted_counts`)."""

    warmup: int
    iterations: int
    time_budget_s: float | None

    def record(self) -> dict[str, Any]:
        return {"warmup": self.warmup, "iterations": self.iterations, "time_budget_s": self.time_budget_s}


def _reference_timing(track: Track, args: argparse.Namespace, wanted_sides: set[str] | None) -> ReferenceTiming:
    warmup = _first(args.reference_warmup, track.timing.reference_warmup, args.warmup)
    iterations = _first(args.reference_iterations, track.timing.reference_iterations, args.iterations)
    if wanted_sides is not None and REFERENCE not in wanted_sides:
        iterations = 0  # it still runs for the stored outputs, just untimed
    return ReferenceTiming(warmup, iterations, track.timing.reference_time_budget_s)


# ------------------------------------------------------------------------------------------
# Running worker processes


# Set for every worker unless the caller's environment sets them (and recorded in the results):
# the CuTe-DSL architecture all our kernels compile for (each kernel's GPU_ARCH), the value an H200
# reports. Without CUTE_DSL_ARCH in the environment when cutlass is imported, CuTe-DSL detects the
# architecture on its first compile by calling cuInit; with it, a compile never touches the CUDA
# driver (a process that called cuInit cannot fork CUDA-capable children, see worker_pool).
# Triton's on-disk autotuning cache is left off (TRITON_CACHE_AUTOTUNING unset): its key omits the token
# count for some libraries, so it would carry one shape's choice into every later process; each side's
# process autotunes in its warm-up call instead. fla turns that cache on for its own kernels
# (FLA_CACHE_RESULTS, default on), which is why its side pins its configurations (fla_gdn.PINNED_CONFIGS).
WORKER_DEFAULTS = {"CUTE_DSL_ARCH": "sm_90a"}


def worker_settings() -> dict[str, str]:
    """The values of WORKER_DEFAULTS' variables that workers get (the caller's where set)."""
    return {name: os.environ.get(name, value) for name, value in WORKER_DEFAULTS.items()}


def _child_env(cuda_visible: str | None) -> dict[str, str]:
    env = {**os.environ, **worker_settings()}
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    return env


def _slot_label(cuda_visible: str | None) -> str:
    return cuda_visible if cuda_visible is not None else "inherited"


def _tail(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return text[-LOG_TAIL_CHARS:].strip()


def make_launcher(plan: RunPlan, slot: int, hooks: RunnerHooks) -> Launcher:
    """The launcher of one device slot: a fork server, or a fresh process per job (--no-preload)."""
    cuda_visible = plan.slots[slot]
    cpus = plan.cpu_sets[slot] if plan.cpu_sets is not None else None
    env = _child_env(cuda_visible)
    if not plan.preload:
        return SubprocessLauncher(hooks.worker_command, env, hooks.worker_cwd, cpus)
    return ForkServerLauncher(
        hooks.worker_command,
        hooks.preload_modules,
        env,
        hooks.worker_cwd,
        cpus,
        log_path=plan.logs_dir / f"fork-server-{_slot_label(cuda_visible)}.log",
        # The imports a fresh worker would do inside its own timeout.
        startup_timeout=max(plan.timeout, 60.0),
        preload_if_fork_safe=hooks.preload_if_fork_safe,
    )


def execute_job(job: WorkerJob, launcher: Launcher, timeout: float, logs_dir: Path) -> SideResult:
    """Run one job (in its side's session of the fork server, or a process of its own) and turn
    whatever happened into a SideResult."""
    folder = logs_dir / job.track / row_name(job.workload["uuid"], job.workload.get("withheld_inputs", ()))
    folder.mkdir(parents=True, exist_ok=True)
    files = JobFiles(
        job=folder / f"{job.side.name}.job.json",
        result=folder / f"{job.side.name}.result.json",
        log=folder / f"{job.side.name}.log",
        session=f"{job.track}/{job.side.name}",
    )
    files.job.write_text(job.model_dump_json(indent=2), encoding="utf-8")
    files.result.unlink(missing_ok=True)
    outcome = launcher.run(files, timeout)
    return _job_result(job, files, outcome, timeout).model_copy(update={"wall_s": round(outcome.wall_s, 3)})


def _job_result(job: WorkerJob, files: JobFiles, outcome: JobExit, timeout: float) -> SideResult:
    def failed(status: Status, message: str) -> SideResult:
        return SideResult(side=job.side.name, status=status, pinned=job.side.pinned, message=message)

    if outcome.timed_out:
        eager = _checkpointed_result(files)
        if eager is not None:  # killed during its graph replays: the eager timing stands
            return eager.model_copy(
                update={"graph_status": GraphStatus.FAILED,
                        "graph_message": f"graph replays did not finish within {timeout:g} s (killed); log {files.log}"}
            )  # fmt: skip
        return failed(Status.TIMEOUT, f"no result after {timeout:g} s (killed); log {files.log}")
    if files.result.is_file():
        try:
            return SideResult.model_validate_json(files.result.read_text(encoding="utf-8"))
        except ValueError as e:
            return failed(Status.CRASH, f"unreadable result ({e.__class__.__name__}); log {files.log}")
    if outcome.launcher_failure is not None or outcome.returncode is None:
        return failed(Status.CRASH, f"{outcome.launcher_failure}; log {files.log}\n{_tail(files.log)}")
    returncode = outcome.returncode
    reason = describe_exit(returncode) if returncode != 0 else "exited without writing a result"
    return failed(Status.CRASH, f"worker {reason}; log {files.log}\n{_tail(files.log)}")


def _checkpointed_result(files: JobFiles) -> SideResult | None:
    """The eager result a worker wrote before its graph replays, if it got that far."""
    try:
        result = SideResult.model_validate_json(files.result.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return result if result.timed and result.graph_status is None else None


class RunState:
    """Journal appends and progress, shared by the device threads."""

    def __init__(self, plan: RunPlan, total: int, show_progress: bool) -> None:
        from tqdm import tqdm

        self.plan = plan
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.progress = tqdm(total=total, unit="job", disable=not show_progress, file=sys.stderr)

    def record(self, key: WorkloadKey, result: SideResult) -> SideRecord:
        record = SideRecord(workload=key, result=result)
        with self.lock:
            if self.stopping.is_set():  # an interrupted run records nothing more
                raise LaunchStopped
            self.plan.journal.append(record)
            self.progress.set_postfix_str(f"{key.track} {key.index} {result.side}: {result.status}", refresh=False)
            self.progress.update(1)
        return record


def _workload_key(plan: RunPlan, tp: TrackPlan, workload: Any) -> WorkloadKey:
    from hopperbench.synth import absent_optional_inputs
    from hopperbench.workloads import data_source_label

    return WorkloadKey(
        track=tp.track.name,
        definition=tp.track.definition_name,
        uuid=workload.uuid,
        index=workload.index,
        axes=dict(workload.axes),
        data_source=data_source_label(workload),
        seed=plan.seed,
        absent_inputs=sorted(absent_optional_inputs(tp.track.name, workload)),
        recipe_variant=workload.recipe_variant,
    )


def _row_id(tp: TrackPlan, workload: Any) -> RowId:
    from hopperbench.synth import absent_optional_inputs

    return row_id(tp.track.name, workload.uuid, sorted(absent_optional_inputs(tp.track.name, workload)))


def _pending_sides(plan: RunPlan, tp: TrackPlan, workload: Any) -> list[Side]:
    row = _row_id(tp, workload)
    return [s for s in tp.sides if (row, s.name) not in plan.finished]


def _reference_outputs_stored(plan: RunPlan, track: str, workload: Any) -> bool:
    return all(
        reference_output_path(plan.scratch_dir, track, workload.row_name, t).is_file() for t in range(plan.trials)
    )


def run_workload(plan: RunPlan, tp: TrackPlan, workload: Any, launcher: Launcher, state: RunState) -> None:
    """The reference of one workload, then its other pending sides, on one device."""
    key = _workload_key(plan, tp, workload)
    pending = _pending_sides(plan, tp, workload)
    if not pending:
        return

    largest = largest_workload(tp.track, tp.workloads, workload.withheld_inputs)

    def job(side: Side, warmup: int, iterations: int, time_budget_s: float | None = None) -> WorkerJob:
        return WorkerJob(
            track=tp.track.name,
            side=side,
            workload=workload.model_dump(mode="json"),
            warmup_workload=(
                largest.model_dump(mode="json") if largest is not None and side.name != REFERENCE else None
            ),
            seed=plan.seed,
            trials=plan.trials,
            warmup=warmup,
            iterations=iterations,
            time_budget_s=time_budget_s,
            scratch_dir=plan.scratch_dir,
        )

    def execute(side: Side, warmup: int, iterations: int, time_budget_s: float | None = None) -> SideResult:
        return execute_job(job(side, warmup, iterations, time_budget_s), launcher, plan.timeout, plan.logs_dir)

    reference_side = tp.sides[0]
    others = [s for s in pending if s.name != REFERENCE]
    finished_reference = plan.finished.get((_row_id(tp, workload), REFERENCE))
    if finished_reference is None:
        timing = tp.reference
        reference = execute(reference_side, timing.warmup, timing.iterations, timing.time_budget_s)
        state.record(key, reference)
    else:
        reference = finished_reference.result
        if any(s.available for s in others) and not _reference_outputs_stored(plan, tp.track.name, workload):
            # Resumed after the scratch folder went away: recompute the outputs, keep the journaled timing.
            reference = execute(reference_side, 0, 0)
    # The others need the stored outputs, not a timed reference: a reference whose timing
    # failed after storing them still lets them be checked.
    outputs_stored = _reference_outputs_stored(plan, tp.track.name, workload)

    for side in others:
        if not side.available:
            result = SideResult(side=side.name, status=Status.UNAVAILABLE, message=side.reason, pinned=side.pinned)
        elif not outputs_stored:
            why = (
                f"reference side {reference.status}: {reference.message}"
                if reference.message
                else "no reference outputs"
            )
            result = SideResult(side=side.name, status=Status.NO_REFERENCE, message=why, pinned=side.pinned)
        else:
            result = execute(side, plan.warmup, plan.iterations)
        state.record(key, result)


def run_plan(plan: RunPlan, hooks: RunnerHooks) -> None:
    """Every pending job, one at a time per device; on any exception (an interrupt included) the
    running jobs are killed, nothing more is recorded, and the exception propagates."""
    work = [(tp, w) for tp in plan.tracks for w in tp.workloads]
    total = sum(len(_pending_sides(plan, tp, w)) for tp, w in work)
    state = RunState(plan, total, hooks.show_progress)
    launchers = [make_launcher(plan, slot, hooks) for slot in range(len(plan.slots))]
    free: Queue[Launcher] = Queue()
    for launcher in launchers:
        free.put(launcher)

    def on_free_device(tp: TrackPlan, workload: Any) -> None:
        launcher = free.get()  # one worker at a time per device
        try:
            run_workload(plan, tp, workload, launcher, state)
        finally:
            free.put(launcher)

    pool = ThreadPoolExecutor(max_workers=len(launchers))
    try:
        futures = [pool.submit(on_free_device, tp, w) for tp, w in work]
        # Wake on the first failure (a fork server that cannot start), not after the jobs before it.
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in done:
            future.result()
    except BaseException:
        state.stopping.set()
        for launcher in launchers:
            launcher.stop()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for launcher in launchers:
            launcher.close()
        state.progress.close()


# ------------------------------------------------------------------------------------------
# Results from the journal: at the end of a run, when it is interrupted, and --finalize


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _print_results(results: ResultsFile, output: Path) -> None:
    print(format_summary_table(results.summary))
    partial = format_completeness(results.completeness) if results.completeness is not None else None
    if partial:
        print(partial)
    print(f"results: {output} and {csv_path_for(output)}")


def _read_journal(journal: Journal) -> tuple[JournalHeader, list[SideRecord]]:
    try:
        return journal.read()
    except (JournalMismatchError, ValueError, OSError) as e:
        raise _journal_error(journal, e) from None


def _environment_of(results_json: Path) -> EnvironmentRecord:
    """The environment record of another results JSON."""
    try:
        data = json.loads(results_json.read_text(encoding="utf-8"))
    except OSError as e:
        raise CliError(f"--environment-from {results_json}: {e.strerror or e}") from None
    except ValueError:
        raise CliError(f"--environment-from {results_json} is not JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("environment"), dict):
        raise CliError(f"--environment-from {results_json} has no environment record")
    try:
        return EnvironmentRecord.model_validate(data["environment"])
    except ValueError:
        raise CliError(f"--environment-from {results_json}: its environment record is not valid") from None


def finalize(args: argparse.Namespace) -> int:
    """--finalize: the JSON and CSV of an existing journal, nothing run, no GPU needed."""
    if args.resume:
        raise CliError("--finalize writes an existing journal's results and cannot be combined with --resume")
    if args.output is None:
        raise CliError("--finalize needs --output, the results JSON whose journal to write out")
    output = args.output.absolute()
    if output.suffix != ".json":
        raise CliError(f"--output must name a .json file, got {output.name}")
    journal = Journal(Journal.path_for(output))
    if not journal.exists():
        raise CliError(f"nothing to finalize: {journal.path} does not exist")
    header, records = _read_journal(journal)
    if args.environment_from is not None:
        if header.environment is not None:
            raise CliError(
                f"{journal.path} records its own environment; --environment-from is for journals without one"
            )
        environment = _environment_of(args.environment_from)
        source = f"{args.environment_from} (attached at finalize)"
    elif header.environment is None:
        raise CliError(
            f"{journal.path} records no environment; pass --environment-from RESULTS.json to attach another run's"
        )
    else:
        environment, source = header.environment, "journal header"
    _print_results(write_journal_results(output, header, records, environment, source), output)
    return 0


# ------------------------------------------------------------------------------------------
# --list and --dry-run: no GPU, nothing written


def list_workloads(args: argparse.Namespace, hooks: RunnerHooks) -> int:
    """--list: one tab-separated line per selected row: track, index, uuid, axes, data source (a
    twin's with `; without <input>`, an off-list row's with `; recipe variant <name>`)."""
    from hopperbench.workloads import data_source_label

    tracks = _selected_tracks(args)
    workloads = _select_workloads(tracks, args, _data_dir(args), hooks)
    for track in tracks:
        for w in workloads.get(track.name, []):
            axes = " ".join(f"{name}={value}" for name, value in w.axes.items())
            without = f"; without {', '.join(w.withheld_inputs)}" if w.withheld_inputs else ""
            variant = f"; recipe variant {w.recipe_variant}" if w.recipe_variant else ""
            print(f"{track.name}\t{w.index}\t{w.uuid}\t{axes}\t{data_source_label(w)}{without}{variant}")
    return 0


def format_plan(plan: RunPlan, devices: list[int] | None) -> str:
    """--dry-run's report: per track its workloads, the sides that would run and the unavailable ones."""
    jobs = sum(len(tp.workloads) * len(tp.sides) for tp in plan.tracks)
    pending = sum(len(_pending_sides(plan, tp, w)) for tp in plan.tracks for w in tp.workloads)
    mode = f"resume {plan.journal.path}, {pending} of {jobs} jobs to run" if plan.resume else f"{jobs} jobs"
    lines = [f"dry run: nothing run or written; output {plan.output} ({mode})"]
    for tp in plan.tracks:
        twins = [w for w in tp.workloads if w.withheld_inputs]
        without = sorted({name for w in twins for name in w.withheld_inputs})
        also = f", {len(twins)} of them also without {', '.join(without)}" if twins else ""
        lines.append(f"{tp.track.name}: {len(tp.workloads) - len(twins)} workload(s){also}")
        lines.extend(_offlist_lines(tp))
        lines.append(f"  runs: {', '.join(s.name for s in tp.sides if s.available) or '-'}")
        for side in tp.sides:
            if not side.available:
                lines.append(f"  unavailable: {side.name}: {side.reason or 'no reason given'}")
    where = f" (--devices {','.join(map(str, devices))})" if devices is not None else ""
    lines.append(f"not checked: the CUDA device(s){where} and CUPTI; a run checks them before it writes anything")
    return "\n".join(lines)


def _offlist_lines(tp: TrackPlan) -> list[str]:
    """One line per off-list row of the plan: uuid, axes, recipe variant, the inputs a twin withholds
    (none for listed rows)."""
    lines = []
    for w in tp.workloads:
        if w.recipe_variant is not None:
            axes = " ".join(f"{name}={value}" for name, value in w.axes.items())
            without = f", without {', '.join(w.withheld_inputs)}" if w.withheld_inputs else ""
            lines.append(f"  off-list {w.index}: {w.uuid} ({axes}, recipe variant {w.recipe_variant}{without})")
    return lines


# ------------------------------------------------------------------------------------------
# main


def _environment_request(plan: RunPlan) -> EnvironmentRequest:
    return EnvironmentRequest(
        seed=plan.seed,
        protocol=plan.header.protocol,
        data_sources={tp.track.name: sorted({w.data_source for w in tp.workloads}) for tp in plan.tracks},
        human_guard=guard_summary(plan.guard_results),
        devices=[int(s) for s in plan.slots if s is not None and s.isdigit()],
        cpu_affinity=(
            {_slot_label(slot): cpus for slot, cpus in zip(plan.slots, plan.cpu_sets, strict=True)}
            if plan.cpu_sets is not None
            else None
        ),
        worker_launch="fork-server" if plan.preload else "subprocess",
        worker_env=worker_settings(),
    )


def open_journal(plan: RunPlan, hooks: RunnerHooks) -> JournalHeader:
    """Create the journal with the environment in its header, or, resuming, note the resume in it.

    A resume keeps the header's environment; a journal written before the header held one
    gets this run's.
    """
    if not plan.resume:
        environment = hooks.collect_environment(_environment_request(plan), plan.slots[0])
        header = plan.header.model_copy(update={"environment": environment})
        plan.journal.create(header)
        return header
    header, records = _read_journal(plan.journal)
    environment = header.environment or hooks.collect_environment(_environment_request(plan), plan.slots[0])
    earlier_plan = header.plan if header.plan is not None else plan_from_records(records)
    header = header.model_copy(
        update={
            "environment": environment,
            "plan": merge_plans(earlier_plan, plan.header.plan),
            "resumed_at": [*header.resumed_at, _now()],
        }
    )
    plan.journal.rewrite_header(header)
    return header


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGINT raise RunInterrupted in the main thread, once: a second signal while
    the partial results are written is ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def interrupt(signum: int, frame: Any) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise RunInterrupted(signum)

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _stop_early(plan: RunPlan, why: str, exit_code: int) -> int:
    """Write what the journal holds as partial results, say why the run stopped, return exit_code."""
    print(f"{PROG}: {why}", file=sys.stderr)
    if not plan.journal.exists():
        print(f"{PROG}: nothing was recorded", file=sys.stderr)
        return exit_code
    header, records = plan.journal.read()
    if header.environment is None:
        print(f"{PROG}: {plan.journal.path} kept; --finalize --environment-from writes its results", file=sys.stderr)
        return exit_code
    results = write_journal_results(plan.output, header, records, header.environment, "journal header")
    _print_results(results, plan.output)
    print(f"{PROG}: continue with --resume --output {plan.output}", file=sys.stderr)
    return exit_code


def execute_run(plan: RunPlan, hooks: RunnerHooks) -> int:
    try:
        plan.output.parent.mkdir(parents=True, exist_ok=True)
        plan.logs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # checked by plan_run; a folder that changed since
        print(f"{PROG}: error: cannot create {e.filename or plan.logs_dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    with _signals_interrupt():
        try:
            open_journal(plan, hooks)
            run_plan(plan, hooks)
        except (RunInterrupted, KeyboardInterrupt) as e:
            signum = e.signum if isinstance(e, RunInterrupted) else signal.SIGINT
            return _stop_early(plan, f"interrupted by {signal.Signals(signum).name}", 128 + signum)
        except WorkerPoolError as e:
            return _stop_early(plan, str(e), 1)
        except Exception as e:  # a bug: keep what was recorded, then show the traceback
            _stop_early(plan, f"stopped by {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", 1)
            raise
    header, records = plan.journal.read()
    assert header.environment is not None  # open_journal put it there
    results = write_journal_results(plan.output, header, records, header.environment, "journal header")
    if not plan.keep_scratch:
        shutil.rmtree(plan.scratch_dir, ignore_errors=True)
    _print_results(results, plan.output)
    return 0


def main(argv: Sequence[str] | None = None, hooks: RunnerHooks | None = None) -> int:
    hooks = hooks or RunnerHooks()
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        if args.finalize:
            return finalize(args)
        if args.list:
            return list_workloads(args, hooks)
        if args.dry_run:
            print(format_plan(plan_run(args, hooks, check_machine=False), args.devices))
            return 0
        plan = plan_run(args, hooks)
    except CliError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return execute_run(plan, hooks)
