"""The published report of a run: pure functions over the rows of a results JSON.

- `headline`: per track, the baseline (the track's FlashInfer baseline, `Track.flashinfer_baseline`,
  where it has one and it passed: GDN's `flashinfer_gdn`; otherwise the library side with the
  best geometric mean graph-replay latency, `rank_libraries`, named) and the speedup over it of the
  strongest other library, the human winner and ours, and ours over the human winner. Each speedup
  is the geometric mean of per-workload ratios baseline latency / side latency over the workloads
  where both passed (graph: where both were graph-timed), eager and CUDA-graph replay side by side,
  with how many workloads entered it.
- `human_best_view` / `libraries_view`: the two published per-workload CSVs.
- `size_rows`: per track and size class (`Track.size_classes`), ours over the baseline and over the
  human winner, with the smallest per-workload ratio beside each geometric mean.
- `pass_counts`: per track, how many workloads each side passed, failed, or could not run.
- `repeat_markdown`: per track, how far a repeat of the run moved (`hopperbench.repeatability`).

The headline, the by-size table and the pass counts are over the rows that gave the optional input
a track samples the absence of (`Track.absent_input_sample`, GDN's `state`): `headline_rows`. The
rows without it (the sample's twins, and official workloads whose files give none) are a table of
their own, `absent_input_rows`, in the by-size table's columns. The views hold every row.

Nothing here reads a file; `sides_table` and the baselines read the track registry.
"""

from __future__ import annotations

import csv
import io
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hopperbench import repeatability
from hopperbench.environment import EnvironmentRecord
from hopperbench.results import (
    ResultsFile,
    SideResult,
    Status,
    WorkloadRow,
    csv_cell,
    definition_var_axes,
    absent_input_rows,
    geometric_mean,
    headline_rows,
    library_pin,
    row_order,
    side_kind,
    state_given,
)
from hopperbench.sides import HUMAN, OURS, canonical_side_order

# Graph status of a passed side that was not replayed from a graph (None in the record).
NOT_ATTEMPTED = "not attempted"


# ------------------------------------------------------------------------------------------
# Ratios


@dataclass(frozen=True)
class Ratio:
    """A geometric mean of per-workload ratios (and the smallest of them), or why there is none (`note`)."""

    geomean: float | None
    workloads: int
    note: str | None = None
    minimum: float | None = None


@dataclass(frozen=True)
class Comparison:
    """`side` against `base`: base latency / side latency, eager and graph."""

    side: str | None
    base: str | None
    eager: Ratio
    graph: Ratio


@dataclass(frozen=True)
class Baseline:
    side: str | None
    # "FlashInfer" (the track's FlashInfer baseline), "fastest library" or "none".
    kind: str
    note: str = ""


@dataclass(frozen=True)
class TrackHeadline:
    track: str
    workloads: int
    baseline: Baseline
    other_library: Comparison
    human: Comparison
    ours: Comparison
    ours_vs_human: Comparison


def _eager_ms(result: SideResult | None) -> float | None:
    return result.latency_ms if result is not None and result.timed else None


def _graph_ms(result: SideResult | None) -> float | None:
    return result.graph_ms if result is not None and result.timed and result.graph_timed else None


def _most_common(values: Iterable[str]) -> str | None:
    counts = Counter(values)
    if not counts:
        return None
    # Most frequent; ties broken by name so that the text never depends on row order.
    return min(counts, key=lambda v: (-counts[v], v))


def why_no_time(rows: Sequence[WorkloadRow], side: str, graph: bool) -> str:
    """Why `side` has no (graph) time on `rows`: not run, its commonest failing status, or, for a
    side that passed, its commonest graph status other than PASSED."""
    results = [r.sides[side] for r in rows if side in r.sides]
    if not results:
        return "not run"
    if not any(r.timed for r in results):
        return _most_common(r.status.value for r in results) or "not run"
    if graph:
        statuses = (
            r.graph_status.value if r.graph_status is not None else NOT_ATTEMPTED
            for r in results
            if r.timed and not r.graph_timed
        )
        return _most_common(statuses) or "no graph time"
    return "no time"


def ratio(rows: Sequence[WorkloadRow], base: str | None, side: str | None, graph: bool = False) -> Ratio:
    """Geometric mean over `rows` of base latency / side latency where both were timed (graph:
    where both were graph-timed); with a note saying why when no workload entered it."""
    if base is None or side is None:
        return Ratio(None, 0, "no baseline" if base is None else "no such side")
    pick = _graph_ms if graph else _eager_ms
    values = []
    for row in rows:
        b, s = pick(row.sides.get(base)), pick(row.sides.get(side))
        if b is not None and s is not None and b > 0 and s > 0:
            values.append(b / s)
    if values:
        return Ratio(geometric_mean(values), len(values), minimum=min(values))
    side_has = any(pick(r.sides.get(side)) is not None for r in rows)
    base_has = any(pick(r.sides.get(base)) is not None for r in rows)
    if not side_has:
        return Ratio(None, 0, why_no_time(rows, side, graph))
    if not base_has:
        return Ratio(None, 0, f"{base} {why_no_time(rows, base, graph)}")
    return Ratio(None, 0, "no common workload")


def compare(rows: Sequence[WorkloadRow], base: str | None, side: str | None) -> Comparison:
    return Comparison(side, base, ratio(rows, base, side), ratio(rows, base, side, graph=True))


# ------------------------------------------------------------------------------------------
# Baseline


def library_sides(rows: Sequence[WorkloadRow]) -> list[str]:
    return [n for n in canonical_side_order({s for r in rows for s in r.sides}) if side_kind(n) == "library"]


def passed_count(rows: Sequence[WorkloadRow], side: str) -> int:
    return sum(1 for r in rows if side in r.sides and r.sides[side].timed)


def rank_libraries(rows: Sequence[WorkloadRow], names: Sequence[str]) -> list[tuple[str, float]]:
    """The libraries of `names` that passed somewhere, fastest first: by the geometric mean of their
    graph-replay latency (the kernels' time, without the host gaps an eager span holds), then the
    sides never graph-timed by their eager latency. Each mean is over the workloads where all the
    sides it ranks were timed (over each one's own when there is none in common); ties by name."""
    timed = [n for n in names if passed_count(rows, n) > 0]
    graphed = [n for n in timed if any(_graph_ms(r.sides.get(n)) is not None for r in rows)]
    eager_only = [n for n in timed if n not in graphed]

    def ranked(group: Sequence[str], pick: Callable[[SideResult | None], float | None]) -> list[tuple[str, float]]:
        common = [r for r in rows if all(pick(r.sides.get(n)) is not None for n in group)]

        def mean(name: str) -> float:
            values = [v for v in (pick(r.sides.get(name)) for r in common or rows) if v is not None and v > 0]
            return geometric_mean(values) or math.inf

        return sorted(((n, mean(n)) for n in group), key=lambda item: (item[1], item[0]))

    return ranked(graphed, _graph_ms) + ranked(eager_only, _eager_ms)


def flashinfer_baseline(track: str) -> str | None:
    """The track's FlashInfer baseline of the Hopper edition (a library side), where FlashInfer has
    an SM90 kernel; None for a track without one or not in the registry."""
    from hopperbench.tracks import TRACKS

    entry = TRACKS.get(track)
    return entry.flashinfer_baseline if entry is not None else None


def choose_baseline(track: str, rows: Sequence[WorkloadRow]) -> Baseline:
    """The track's FlashInfer baseline where it passed on any workload (the workload counts say on
    how many each mean is), else the fastest library side, else none."""
    designated = flashinfer_baseline(track)
    if designated is not None and passed_count(rows, designated) > 0:
        return Baseline(designated, "FlashInfer")
    ranked = rank_libraries(rows, library_sides(rows))
    note = ""
    if designated is not None:
        note = f"{designated} {why_no_time(rows, designated, graph=False)}"
    if ranked:
        return Baseline(ranked[0][0], "fastest library", note)
    return Baseline(None, "none", note or "no library side passed")


def track_headline(track: str, rows: Sequence[WorkloadRow]) -> TrackHeadline:
    baseline = choose_baseline(track, rows)
    others = [n for n, _ in rank_libraries(rows, library_sides(rows)) if n != baseline.side]
    other = others[0] if others else None
    return TrackHeadline(
        track=track,
        workloads=len(rows),
        baseline=baseline,
        other_library=(
            compare(rows, baseline.side, other)
            if other is not None
            else Comparison(None, baseline.side, Ratio(None, 0, "none"), Ratio(None, 0, "none"))
        ),
        human=compare(rows, baseline.side, HUMAN),
        ours=compare(rows, baseline.side, OURS),
        ours_vs_human=compare(rows, HUMAN, OURS),
    )


def rows_by_track(rows: Iterable[WorkloadRow]) -> dict[str, list[WorkloadRow]]:
    """Rows grouped by track: registry order first, then any other track by name."""
    from hopperbench.tracks import TRACKS

    groups: dict[str, list[WorkloadRow]] = {}
    for row in rows:
        groups.setdefault(row.track, []).append(row)
    order = [t for t in TRACKS if t in groups] + sorted(t for t in groups if t not in TRACKS)
    return {t: groups[t] for t in order}


def headline(results: ResultsFile) -> list[TrackHeadline]:
    return [track_headline(track, rows) for track, rows in rows_by_track(headline_rows(results.rows)).items()]


def format_ratio(r: Ratio) -> str:
    if r.geomean is None:
        return f"n/a ({r.note})" if r.note else "n/a"
    return f"{r.geomean:.2f}× ({r.workloads})"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


HEADLINE_HEADER = (
    "track", "baseline", "other library", "library eager", "library graph", "human eager", "human graph",
    "ours eager", "ours graph", "ours / human eager", "ours / human graph",
)  # fmt: skip


def headline_markdown(headlines: Sequence[TrackHeadline]) -> list[str]:
    body = []
    for h in headlines:
        base = h.baseline
        base_cell = "none passed" if base.side is None else f"`{base.side}` ({base.kind})"
        if base.note and base.side is not None:
            base_cell += f"; {base.note}"
        other = h.other_library
        body.append(
            [
                f"`{h.track}` ({h.workloads})",
                base_cell,
                f"`{other.side}`" if other.side else "–",
                *(("–", "–") if other.side is None else (format_ratio(other.eager), format_ratio(other.graph))),
                format_ratio(h.human.eager),
                format_ratio(h.human.graph),
                format_ratio(h.ours.eager),
                format_ratio(h.ours.graph),
                format_ratio(h.ours_vs_human.eager),
                format_ratio(h.ours_vs_human.graph),
            ]
        )
    return _table(HEADLINE_HEADER, body)


# ------------------------------------------------------------------------------------------
# By size


@dataclass(frozen=True)
class SizeRow:
    """Ours against the track's baseline and against the human winner on one size class."""

    track: str
    axis: str  # the workload axis the classes split
    size: str  # the class's label, e.g. "41-200"
    workloads: int
    baseline: str | None
    versus_baseline: Comparison
    versus_human: Comparison


def size_rows(track: str, rows: Sequence[WorkloadRow]) -> list[SizeRow]:
    """One SizeRow per size class of the track (none for a track without classes); the baseline is
    the headline's, chosen over all of the track's rows."""
    from hopperbench.tracks import TRACKS

    entry = TRACKS.get(track)
    classes = entry.size_classes if entry is not None else None
    if classes is None:
        return []
    baseline = choose_baseline(track, rows).side
    groups: list[list[WorkloadRow]] = [[] for _ in classes.labels()]
    for row in rows:
        groups[classes.index(int(row.axes[classes.axis]))].append(row)
    return [
        SizeRow(track, classes.axis, label, len(group), baseline, compare(group, baseline, OURS),
                compare(group, HUMAN, OURS))  # fmt: skip
        for label, group in zip(classes.labels(), groups)
        if group
    ]


def format_ratio_with_minimum(r: Ratio) -> str:
    if r.geomean is None or r.minimum is None:
        return format_ratio(r)
    return f"{r.geomean:.2f}× ({r.workloads}; min {r.minimum:.2f}×)"


SIZE_HEADER = (
    "track", "size", "workloads", "ours / baseline eager", "ours / baseline graph", "ours / human eager",
    "ours / human graph",
)  # fmt: skip


def size_markdown(results: ResultsFile) -> list[str]:
    """The by-size table of the headline's rows: per size class, geometric mean (workloads;
    smallest per-workload ratio)."""
    return size_table(headline_rows(results.rows)) or ["No track of the run has size classes."]


def absent_input_markdown(results: ResultsFile) -> list[str]:
    """The by-size table of the rows without their track's sampled input, then their pass counts;
    empty when the run has none."""
    rows = absent_input_rows(results.rows)
    if not rows:
        return []
    return [*size_table(rows), "", *(f"- {line}" for line in pass_lines(rows))]


def size_table(rows: Sequence[WorkloadRow]) -> list[str]:
    """Per track and size class, ours over the baseline and the human winner; empty when no track of
    `rows` has size classes."""
    body = []
    for track, track_rows in rows_by_track(rows).items():
        for size in size_rows(track, track_rows):
            body.append(
                [
                    f"`{track}`",
                    f"{size.size} (`{size.axis}`)",
                    str(size.workloads),
                    format_ratio_with_minimum(size.versus_baseline.eager),
                    format_ratio_with_minimum(size.versus_baseline.graph),
                    format_ratio_with_minimum(size.versus_human.eager),
                    format_ratio_with_minimum(size.versus_human.graph),
                ]
            )
    return _table(SIZE_HEADER, body) if body else []


# ------------------------------------------------------------------------------------------
# Pass counts


def pass_counts(rows: Sequence[WorkloadRow]) -> dict[str, dict[str, Counter[str]]]:
    """Per track, per side (canonical order): how many of its records have each status."""
    out: dict[str, dict[str, Counter[str]]] = {}
    for track, track_rows in rows_by_track(rows).items():
        names = canonical_side_order({s for r in track_rows for s in r.sides})
        counts: dict[str, Counter[str]] = {n: Counter() for n in names}
        for row in track_rows:
            for name, result in row.sides.items():
                counts[name][result.status.value] += 1
        out[track] = counts
    return out


def pass_line(track: str, workloads: int, counts: Mapping[str, Counter[str]]) -> str:
    """`gdn_prefill` (100 workloads): ours 100 passed; human 94 passed, 6 FAILED; ..."""
    parts = []
    for side, statuses in counts.items():
        passed = statuses.get(Status.PASSED.value, 0)
        others = ", ".join(f"{n} {s}" for s, n in sorted(statuses.items()) if s != Status.PASSED.value)
        parts.append(f"{side} {passed} passed" + (f", {others}" if others else ""))
    return f"`{track}` ({workloads} workloads): " + "; ".join(parts) + "."


def pass_lines(rows: Sequence[WorkloadRow]) -> list[str]:
    grouped = rows_by_track(rows)
    return [pass_line(t, len(grouped[t]), c) for t, c in pass_counts(rows).items()]


# ------------------------------------------------------------------------------------------
# The published views


def _axis_columns(rows: Sequence[WorkloadRow]) -> list[str]:
    axes = definition_var_axes()
    return axes + sorted({a for r in rows for a in r.axes} - set(axes))


def _workload_cells(row: WorkloadRow) -> dict[str, Any]:
    return {
        "track": row.track,
        "workload_index": row.index,
        "uuid": row.uuid,
        "data_source": row.data_source,
        "state_given": state_given(row.track, row.absent_inputs),
        **row.axes,
    }


def _graph_status(result: SideResult | None) -> str | None:
    if result is None:
        return None
    return result.graph_status.value if result.graph_status is not None else None


def _ratio_cell(base: float | None, side: float | None) -> float | None:
    return base / side if base is not None and side is not None and base > 0 and side > 0 else None


def _csv(columns: Sequence[str], records: Iterable[Mapping[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    for record in records:
        writer.writerow({k: csv_cell(record.get(k)) for k in columns})
    return out.getvalue()


WORKLOAD_VIEW_LEAD = ("track", "workload_index", "uuid", "data_source", "state_given")
HUMAN_VIEW_TAIL = (
    "ours_eager_ms", "ours_graph_ms", "human_eager_ms", "human_graph_ms", "eager_speedup", "graph_speedup",
    "ours_status", "ours_graph_status", "human_status", "human_graph_status",
)  # fmt: skip
LIBRARY_VIEW_TAIL = (
    "library", "library_version", "baseline",
    "ours_eager_ms", "ours_graph_ms", "library_eager_ms", "library_graph_ms", "eager_speedup", "graph_speedup",
    "ours_status", "ours_graph_status", "library_status", "library_graph_status",
)  # fmt: skip


def human_best_view_columns(rows: Sequence[WorkloadRow] = ()) -> list[str]:
    return [*WORKLOAD_VIEW_LEAD, *_axis_columns(rows), *HUMAN_VIEW_TAIL]


def library_view_columns(rows: Sequence[WorkloadRow] = ()) -> list[str]:
    return [*WORKLOAD_VIEW_LEAD, *_axis_columns(rows), *LIBRARY_VIEW_TAIL]


def _sorted_rows(rows: Sequence[WorkloadRow]) -> list[WorkloadRow]:
    """Track by track, in index order, a workload's own row before its twin."""
    return [r for track_rows in rows_by_track(rows).values() for r in sorted(track_rows, key=row_order)]


def _versus_cells(ours: SideResult | None, other: SideResult | None, other_label: str) -> dict[str, Any]:
    """The cells of one view line that compare ours with `other` (columns named `<other_label>_...`):
    both sides' eager and graph times, speedups other / ours, and their statuses."""
    return {
        "ours_eager_ms": _eager_ms(ours),
        "ours_graph_ms": _graph_ms(ours),
        f"{other_label}_eager_ms": _eager_ms(other),
        f"{other_label}_graph_ms": _graph_ms(other),
        "eager_speedup": _ratio_cell(_eager_ms(other), _eager_ms(ours)),
        "graph_speedup": _ratio_cell(_graph_ms(other), _graph_ms(ours)),
        "ours_status": ours.status.value if ours else None,
        "ours_graph_status": _graph_status(ours),
        f"{other_label}_status": other.status.value if other else None,
        f"{other_label}_graph_status": _graph_status(other),
    }


def human_best_view(rows: Sequence[WorkloadRow]) -> str:
    """`results/h200_vs_human_best.csv`: one line per row (a twin's is its own, `state_given`
    false), ours against the human winner (speedup = human / ours, where both were timed)."""
    records = []
    for row in _sorted_rows(rows):
        records.append({**_workload_cells(row), **_versus_cells(row.sides.get(OURS), row.sides.get(HUMAN), "human")})
    return _csv(human_best_view_columns(rows), records)


def libraries_view(rows: Sequence[WorkloadRow]) -> str:
    """`results/h200_vs_libraries.csv`: one line per (row, library side), ours against it
    (speedup = library / ours); `baseline` true for the track's headline baseline."""
    baselines = {t: choose_baseline(t, r).side for t, r in rows_by_track(headline_rows(rows)).items()}
    records = []
    for row in _sorted_rows(rows):
        ours = row.sides.get(OURS)
        for name, result in row.sides.items():
            if side_kind(name) != "library":
                continue
            records.append(
                {
                    **_workload_cells(row),
                    "library": name,
                    "library_version": library_pin(row.track, name),
                    "baseline": name == baselines.get(row.track),
                    **_versus_cells(ours, result, "library"),
                }
            )
    return _csv(library_view_columns(rows), records)


# ------------------------------------------------------------------------------------------
# Environment and registry text


def environment_line(env: EnvironmentRecord, track_environments: Mapping[str, EnvironmentRecord] | None = None) -> str:
    """GPU, commit, date and protocol of a run, in one line.

    `track_environments`: each track of the run and the environment its rows were measured in
    (`ResultsFile.track_environments`). Tracks measured at different commits or dates are named
    beside their commit and date; GPU, protocol and seed are `env`'s, which every track shares
    (`tools/merge_track_runs.py` refuses a track measured under others)."""
    tracks = _in_registry_order(track_environments or {})
    groups = _commit_groups(tracks)
    parts = []
    if env.gpu_name:
        parts.append(env.gpu_name + (f" ({env.sm_count} SMs)" if env.sm_count else ""))
    if len(groups) > 1:
        parts.append("commit " + ", ".join(_commit_group_text(e, names) for e, names in groups))
    else:
        when = groups[0][0] if groups else env
        if when.repo_commit:
            parts.append(f"commit `{when.repo_commit[:10]}`" + (" (dirty)" if when.repo_dirty else ""))
        if when.timestamp:
            parts.append(when.timestamp[:10])
    protocol = env.protocol or {}
    counts = [f"{k} {protocol[k]}" for k in ("warmup", "iterations", "trials") if protocol.get(k) is not None]
    if counts:
        parts.append("protocol " + " / ".join(counts))
    timer = protocol.get("timer")
    if isinstance(timer, Mapping) and timer.get("name"):
        parts.append(f"timer `{timer['name']}`")
    if env.seed is not None:
        parts.append(f"seed {env.seed}")
    sources = _data_sources(env, tracks)
    if sources:
        parts.append("data " + ", ".join(sources))
    return ("; ".join(parts) or "no environment recorded") + "."


def _in_registry_order(by_track: Mapping[str, EnvironmentRecord]) -> dict[str, EnvironmentRecord]:
    from hopperbench.tracks import TRACKS

    order = [t for t in TRACKS if t in by_track] + sorted(t for t in by_track if t not in TRACKS)
    return {t: by_track[t] for t in order}


def _commit_key(env: EnvironmentRecord) -> tuple[str | None, bool, str | None]:
    """What the environment line says of when a track was measured: commit, dirty, date."""
    return (env.repo_commit[:10] if env.repo_commit else None, bool(env.repo_dirty), (env.timestamp or "")[:10] or None)


def _commit_groups(tracks: Mapping[str, EnvironmentRecord]) -> list[tuple[EnvironmentRecord, list[str]]]:
    """The tracks grouped by commit, dirtiness and date, in order of each group's first track."""
    groups: dict[tuple[str | None, bool, str | None], tuple[EnvironmentRecord, list[str]]] = {}
    for track, env in tracks.items():
        groups.setdefault(_commit_key(env), (env, []))[1].append(track)
    return list(groups.values())


def _commit_group_text(env: EnvironmentRecord, tracks: Sequence[str]) -> str:
    commit, dirty, date = _commit_key(env)
    details = [", ".join(tracks), *([date] if date else []), *(["dirty"] if dirty else [])]
    return f"`{commit or 'unrecorded'}` ({'; '.join(details)})"


def _data_sources(env: EnvironmentRecord, tracks: Mapping[str, EnvironmentRecord]) -> list[str]:
    """Where the workloads came from: each track's own entry in its environment, or every entry of `env`."""
    if not tracks:
        return sorted({s for v in env.data_sources.values() for s in v})
    return sorted({s for track, e in tracks.items() for s in e.data_sources.get(track, [])})


def sides_table() -> list[str]:
    """Per track, each library side of the registry: name, pin and what one timed call contains."""
    from hopperbench.tracks import TRACKS

    body = []
    for track in TRACKS.values():
        for lib in track.libraries:
            pin = lib.package or lib.submodule or "–"
            baseline = " (baseline)" if track.flashinfer_baseline == lib.name else ""
            body.append(
                [
                    f"`{track.name}`",
                    f"`{lib.name}`{baseline}",
                    f"`{pin}`",
                    (lib.timed_call or lib.description).replace("|", "\\|"),
                ]
            )
    return _table(("track", "side", "pin", "one timed call"), body)


# ------------------------------------------------------------------------------------------
# Repeatability


REPEAT_HEADER = (
    "track", "GPU", "rows judged", f"within {repeatability.TOLERANCE:.0%}",
    "over: side, rows (of them no-state twins), largest change", "graph-span geomean change per side (rows)",
)  # fmt: skip


def same_gpu(first: EnvironmentRecord, second: EnvironmentRecord) -> str:
    """Whether two runs had the same board: "same", "another" or "not recorded" (older records)."""
    if first.gpu_uuid is None or second.gpu_uuid is None:
        return "not recorded"
    return "same" if first.gpu_uuid == second.gpu_uuid else "another"


def repeat_markdown(first: ResultsFile, second: ResultsFile) -> list[str]:
    """Per track of the canonical run: the judged rows (`repeatability.compare`), how many stayed
    within the tolerance, the sides of those that did not, and each side's geometric-mean change of
    its graph span (marked where it is over `repeatability.GEOMEAN`); a track the repeat lacks (its
    rows were replaced since: `tools/merge_track_runs.py --repeat`) says so."""
    from hopperbench.tracks import TRACKS

    rows = repeatability.compare(first, second)
    canonical = {r.track for r in first.rows}
    repeated = {r.track for r in second.rows}
    body = []
    for track in [t for t in TRACKS if t in canonical] + sorted(canonical - set(TRACKS)):
        if track not in repeated:
            commit = first.track_environment(track).repo_commit
            since = f" (canonical at `{commit[:10]}`)" if commit else ""
            body.append([f"`{track}`", "-", "0", "-", f"not repeated since its canonical run{since}", "-"])
            continue
        judged = [c for c in rows if c.track == track and c.judged]
        if not judged:
            continue
        over = [c for c in judged if c.over(repeatability.TOLERANCE)]
        over_cells = []
        for side in dict.fromkeys(c.side for c in over):
            mine = [c for c in over if c.side == side]
            twins = sum(1 for c in mine if c.absent_inputs)
            largest = max((c.largest_graph_change for c in mine), key=abs)
            over_cells.append(f"`{side}` {len(mine)} ({twins}), {largest:+.1%}")
        mean_cells = [
            f"`{m.side}` {m.change:+.2%} ({m.rows})" + (" **over**" if abs(m.change) > repeatability.GEOMEAN else "")
            for m in repeatability.side_means(judged)
        ]
        gpu = same_gpu(first.track_environment(track), second.track_environment(track))
        body.append([f"`{track}`", gpu, str(len(judged)), str(len(judged) - len(over)),
                     "; ".join(over_cells) or "none", "; ".join(mean_cells)])  # fmt: skip
    return _table(REPEAT_HEADER, body) if body else []
