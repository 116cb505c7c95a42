"""Merge a track's re-run into the canonical run, replacing that track's rows.

    uv run tools/merge_track_runs.py results/h200/latest.json results/h200/moe.json [more.json ...]

A kernel change re-runs its own track (`--track moe --output results/h200/moe.json`), not every
track. For each track of a newer run, every row of that track in the canonical file (GDN's no-state
twins included) is replaced by the newer run's rows of it, and the newer run's environment, its
source and resumes become the track's (`ResultsFile.track_runs`); the other tracks' rows stay as
they are. The summary and completeness are recomputed and the canonical JSON and the tidy CSV
beside it rewritten as the runner writes them (neither is replaced unless both can be). Then
`uv run tools/render_results.py` regenerates README.md's sections and the views.

`--repeat results/h200/repeat.json` also drops the merged tracks from the repeat run: it no longer
repeats their canonical rows (README's repeat table then says so) until the track is run again and
merged into it (`merge_track_runs.py results/h200/repeat.json <repeat of the track>.json`). A repeat
left with no rows is removed, its CSV with it; a repeat that does not exist yet is left so.

Refused with one line on stderr, exit code 2, nothing written:
- a file that cannot be read or is not a results JSON; the canonical file given as a newer run or as
  the repeat; a track in two newer runs; an off-list run (`--workload-list offlist`: rows beyond the listed
  workloads, kept in a results file of their own) on either side; a journal beside the canonical
  file or the repeat (its `--resume` or `--finalize` would write over the merge);
- a run that records no completeness; a newer run that is partial for its track;
- a newer run that lacks a row the canonical file has of its track, or a side: every side of the
  track's registry entry and every side the canonical rows have, candidates excepted (a candidate
  leaves the registry when it is promoted or dropped). An unavailable side is recorded as
  UNAVAILABLE, so it is not missing;
- a newer run measured on another GPU (name, SM count), with another seed, timing protocol (timer,
  warm-up, iterations, trials, side warm-up) or data source: its numbers would not compare with the
  kept tracks'. The twins' warm-up (`runner.TWIN_WARMUP`) and the reference side's timing are not
  compared: they concern the merged track's own rows only, which all come from its one run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from hopperbench.environment import EnvironmentRecord
from hopperbench.results import (
    Completeness,
    Journal,
    ResultsFile,
    TrackCompleteness,
    TrackRun,
    WorkloadRow,
    absent_inputs_label,
    csv_path_for,
    read_results,
    row_order,
    summarize,
    write_results_file,
)
from hopperbench.sides import canonical_side_order, known_side_names
from hopperbench.tracks import TRACKS, is_candidate_side
from hopperbench.workloads import OFFLIST, WORKLOAD_LIST_PROTOCOL_KEY

PROG = "merge_track_runs"
# Environment fields that decide whether two runs' numbers compare, besides protocol and data.
COMPARABLE_FIELDS = ("gpu_name", "sm_count", "seed")


class MergeError(Exception):
    """A merge that must not happen; one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, not argparse's usage block
        raise MergeError(message)


@dataclass(frozen=True)
class Run:
    """A results file and where it was read from."""

    path: Path
    results: ResultsFile

    def rows_of(self, track: str) -> list[WorkloadRow]:
        return [r for r in self.results.rows if r.track == track]

    def tracks(self) -> list[str]:
        """The tracks of its rows and of its plan, in that order."""
        planned = self.results.completeness.tracks if self.results.completeness is not None else {}
        return list(dict.fromkeys([*(r.track for r in self.results.rows), *planned]))


def load_run(path: Path) -> Run:
    try:
        return Run(path, read_results(path))
    except OSError as e:
        raise MergeError(f"cannot read {path}: {e.strerror or e}") from None
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise MergeError(f"{path} is not a results JSON ({where + ': ' if where else ''}{first['msg']})") from None
    except ValueError as e:  # not UTF-8
        raise MergeError(f"{path} is not a results JSON ({str(e).splitlines()[0]})") from None


def own_run(results: ResultsFile) -> TrackRun:
    """The run the file's own environment describes (that of every track not in `track_runs`)."""
    return TrackRun(
        environment=results.environment,
        environment_source=results.environment_source,
        resumed_at=list(results.resumed_at),
    )


def track_run(results: ResultsFile, track: str) -> TrackRun:
    """The run a file's track was measured in."""
    run = results.track_runs.get(track)
    return run if run is not None else own_run(results)


# ------------------------------------------------------------------------------------------
# Checks


def check_no_journal(run: Run) -> None:
    journal = Journal.path_for(run.path)
    if journal.exists():
        raise MergeError(f"{journal} exists: finish that run (--resume, --finalize) or remove its journal first")


def check_inputs(canonical: Run, newer: Sequence[Run]) -> dict[str, Run]:
    """Each track to merge and the newer run it comes from."""
    check_no_journal(canonical)
    chosen: dict[str, Run] = {}
    for run in (canonical, *newer):
        check_listed(run)
    for run in newer:
        if run.path.resolve() == canonical.path.resolve():
            raise MergeError(f"{run.path} is the canonical file itself")
        if not run.tracks():
            raise MergeError(f"{run.path} holds no rows")
        for track in run.tracks():
            if track in chosen:
                raise MergeError(f"{track} is in both {chosen[track].path} and {run.path}; merge one of them")
            chosen[track] = run
    if canonical.results.completeness is None:
        raise MergeError(f"{canonical.path} records no completeness (written before it existed)")
    return chosen


def check_listed(run: Run) -> None:
    """The run holds listed workloads only: an off-list run's rows never enter the canonical file."""
    environments = [run.results.environment, *(r.environment for r in run.results.track_runs.values())]
    lists = {env.protocol.get(WORKLOAD_LIST_PROTOCOL_KEY) for env in environments} - {None}
    variants = {r.recipe_variant for r in run.results.rows} - {None}
    if lists or variants:
        raise MergeError(
            f"{run.path} is an off-list run (--workload-list {', '.join(sorted(lists)) or OFFLIST}):"
            " the canonical run holds the listed workloads only"
        )


def check_complete(run: Run, track: str) -> TrackCompleteness:
    """The run's plan of `track`, every planned row of which has every planned side."""
    if run.results.completeness is None:
        raise MergeError(f"{run.path} records no completeness (written before it existed); re-run {track}")
    done = run.results.completeness.tracks.get(track)
    if done is None:
        raise MergeError(f"{run.path} has rows of {track} but no plan of it")
    if done.complete < done.planned:
        raise MergeError(
            f"{run.path} is partial for {track}: {done.complete} of {done.planned} rows have every planned side;"
            " finish it with --resume"
        )
    return done


def check_rows(canonical: Run, run: Run, track: str) -> None:
    """The newer run re-ran every row the canonical file has of `track` (workloads and twins)."""
    have = {r.row_id for r in run.rows_of(track)}
    missing = [r for r in canonical.rows_of(track) if r.row_id not in have]
    if missing:
        first = missing[0]
        raise MergeError(
            f"{run.path} lacks {len(missing)} of {canonical.path}'s {len(canonical.rows_of(track))} {track} rows"
            f" (first: workload {first.index} {first.uuid}, {absent_inputs_label(first.absent_inputs)});"
            " re-run every workload of the track"
        )


def required_sides(canonical: Run, track: str) -> list[str]:
    """The sides a merged track must have: its registry entry's and the canonical rows', candidates excepted."""
    registry = known_side_names([TRACKS[track]]) if track in TRACKS else []
    kept = {side for r in canonical.rows_of(track) for side in r.sides}
    return [s for s in canonical_side_order({*registry, *kept}) if not is_candidate_side(s)]


def check_sides(canonical: Run, run: Run, track: str, planned: TrackCompleteness) -> None:
    missing = [s for s in required_sides(canonical, track) if s not in planned.sides]
    if missing:
        raise MergeError(
            f"{run.path} lacks side {', '.join(missing)} of {track}: the canonical run keeps every side"
            " (an unavailable one is recorded as UNAVAILABLE); re-run the track without --sides"
        )


def measurement(env: EnvironmentRecord) -> dict[str, Any]:
    """What decides whether the numbers measured in `env` compare with another run's: GPU, seed and the
    protocol, without what concerns one track's own rows only (the merged track's rows, twins and
    reference included, all come from its one run): how its no-state twins warm up and how the
    reference side is timed."""
    protocol = dict(env.protocol)
    protocol.pop("reference", None)
    protocol.pop("twin_warmup", None)
    return {**{name: getattr(env, name) for name in COMPARABLE_FIELDS}, **protocol}


def _difference(name: str, kept: Any, new: Any) -> str:
    if isinstance(kept, dict | list) or isinstance(new, dict | list):
        return name
    return f"{name} ({new!r} against {kept!r})"


def distinct_environments(results: ResultsFile) -> list[EnvironmentRecord]:
    """Every environment the file's tracks were measured in (its own when it has no rows)."""
    out: list[EnvironmentRecord] = []
    for env in results.track_environments().values() or [results.environment]:
        if env not in out:
            out.append(env)
    return out


def check_comparable(canonical: Run, run: Run, track: str) -> None:
    """The newer run's track was measured as every kept track was: same GPU, seed, protocol, data source."""
    new = run.results.track_environment(track)
    for kept in distinct_environments(canonical.results):
        a, b = measurement(kept), measurement(new)
        differing = [_difference(k, a.get(k), b.get(k)) for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
        if differing:
            raise MergeError(
                f"{run.path}'s {track} run differs from {canonical.path} in {', '.join(differing)}:"
                " its numbers would not compare with the kept tracks'"
            )
    if canonical.rows_of(track):
        kept_sources = canonical.results.track_environment(track).data_sources.get(track)
        new_sources = new.data_sources.get(track)
        if kept_sources != new_sources:
            raise MergeError(
                f"{run.path}'s {track} workloads are {', '.join(new_sources or ['unrecorded'])}, {canonical.path}'s"
                f" {', '.join(kept_sources or ['unrecorded'])}: its numbers would not compare"
            )


def check_track(canonical: Run, run: Run, track: str) -> TrackCompleteness:
    """Every check of one track to merge; returns its plan."""
    planned = check_complete(run, track)
    check_rows(canonical, run, track)
    check_sides(canonical, run, track, planned)
    check_comparable(canonical, run, track)
    return planned


# ------------------------------------------------------------------------------------------
# Merge


def base_run(current: TrackRun, runs: Mapping[str, TrackRun]) -> TrackRun:
    """The run the file's own environment describes: the current one while a track was measured in
    it, else the one most tracks were measured in (the first track's on a tie)."""
    if current in runs.values() or not runs:
        return current
    distinct: list[TrackRun] = []
    for run in runs.values():
        if run not in distinct:
            distinct.append(run)
    return max(distinct, key=lambda run: sum(run == other for other in runs.values()))


def merged_completeness(
    canonical: Completeness, replaced: Mapping[str, TrackCompleteness], sources: Iterable[str]
) -> Completeness:
    """The canonical plan with the merged tracks' plans in their place, totals recomputed."""
    tracks = {name: replaced.get(name, done) for name, done in canonical.tracks.items()}
    tracks.update({name: done for name, done in replaced.items() if name not in tracks})
    return Completeness.of_tracks(tracks, "; ".join(dict.fromkeys(sources)))


def merge(canonical: Run, chosen: Mapping[str, Run], planned: Mapping[str, TrackCompleteness]) -> ResultsFile:
    """The canonical results with each chosen track's rows, run and plan taken from its newer run."""
    kept = [r for r in canonical.results.rows if r.track not in chosen]
    rows = sorted([*kept, *(r for track, run in chosen.items() for r in run.rows_of(track))], key=row_order)
    runs = {
        track: track_run(chosen[track].results, track) if track in chosen else track_run(canonical.results, track)
        for track in dict.fromkeys(r.track for r in rows)
    }
    assert canonical.results.completeness is not None  # check_inputs
    sources = [
        *([canonical.results.completeness.plan_source] if kept else []),
        *(run.results.completeness.plan_source for run in chosen.values() if run.results.completeness is not None),
    ]
    completeness = merged_completeness(canonical.results.completeness, planned, sources)
    return assemble(rows, runs, own_run(canonical.results), completeness)


def assemble(
    rows: list[WorkloadRow], runs: Mapping[str, TrackRun], current: TrackRun, completeness: Completeness | None
) -> ResultsFile:
    """A results file of `rows`, each track's run in `runs`: the file's own environment is `base_run`'s, the
    other tracks' runs go to `track_runs`; the summary is recomputed."""
    base = base_run(current, runs)
    return ResultsFile(
        environment=base.environment,
        environment_source=base.environment_source,
        resumed_at=list(base.resumed_at),
        track_runs={track: run for track, run in runs.items() if run != base},
        completeness=completeness,
        rows=rows,
        summary=summarize(rows),
    )


def without_tracks(run: Run, tracks: Iterable[str]) -> ResultsFile | None:
    """The run without the rows, runs and plans of `tracks`; None when no row is left."""
    dropped = set(tracks)
    rows = [r for r in run.results.rows if r.track not in dropped]
    if not rows:
        return None
    runs = {track: track_run(run.results, track) for track in dict.fromkeys(r.track for r in rows)}
    completeness = run.results.completeness
    if completeness is not None:
        kept = {name: done for name, done in completeness.tracks.items() if name not in dropped}
        completeness = Completeness.of_tracks(kept, completeness.plan_source)
    return assemble(rows, runs, own_run(run.results), completeness)


def load_repeat(path: Path, canonical: Run) -> Run:
    repeat = load_run(path)
    if repeat.path.resolve() == canonical.path.resolve():
        raise MergeError(f"{path} is the canonical file itself")
    check_no_journal(repeat)
    return repeat


def write_repeat(repeat: Run, tracks: Sequence[str]) -> list[str]:
    """Drops `tracks` from the repeat run (removing it when nothing is left); the tracks dropped."""
    dropped = [t for t in tracks if any(r.track == t for r in repeat.results.rows)]
    if not dropped:
        return []
    remaining = without_tracks(repeat, dropped)
    if remaining is None:
        csv_path_for(repeat.path).unlink(missing_ok=True)
        repeat.path.unlink()
    else:
        write_results_file(repeat.path, remaining)
    return dropped


def _commit(results: ResultsFile, track: str) -> str:
    commit = results.track_environment(track).repo_commit
    return commit[:10] if commit else "an unrecorded commit"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog=PROG, description=(__doc__ or "").splitlines()[0])
    parser.add_argument("canonical", type=Path, help="the canonical results JSON, rewritten in place")
    parser.add_argument("newer", type=Path, nargs="+", help="results JSON of a newer run of one or more tracks")
    parser.add_argument("--repeat", type=Path, help="the repeat run, from which the merged tracks are dropped")
    try:
        args = parser.parse_args(argv)
        canonical = load_run(args.canonical)
        # No repeat yet (a first canonical run) leaves nothing to drop.
        repeat = load_repeat(args.repeat, canonical) if args.repeat is not None and args.repeat.exists() else None
        chosen = check_inputs(canonical, [load_run(path) for path in args.newer])
        planned = {track: check_track(canonical, run, track) for track, run in chosen.items()}
        merged = merge(canonical, chosen, planned)
    except MergeError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        # The repeat first: should the canonical write fail, the repeat lacks a track it still
        # repeats, rather than judging rows the canonical run no longer has.
        dropped = write_repeat(repeat, list(chosen)) if repeat is not None else []
        write_results_file(args.canonical, merged)
    except OSError as e:
        print(f"{PROG}: error: cannot write {e.filename or args.canonical}: {e.strerror or e}", file=sys.stderr)
        return 1
    for track, run in chosen.items():
        print(f"{track}: {len(run.rows_of(track))} rows from {run.path} (commit {_commit(merged, track)})")
    if repeat is not None and dropped:
        gone = "" if repeat.path.exists() else " (nothing left: removed)"
        print(f"{repeat.path}: dropped {', '.join(dropped)}{gone}; run the track again and merge it there")
    print(f"results: {args.canonical} and {csv_path_for(args.canonical)}; now uv run tools/render_results.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
