"""The result schema of a run, its journal, and its JSON and CSV files.

A run produces one `SideRecord` per (track, row, side). Records are appended
to a journal as they finish, so a killed run loses at most the job in flight; the
final JSON and CSV are rebuilt from the journal. A `WorkloadRow` gathers the sides
of one row and derives the speedups; `summarize` reduces rows per track.

A row is a workload with the optional inputs its calls passed as None (`row_id`): a workload of
a track's `absent_input_sample` has two rows in a run, its own and its twin's without that input.

A file's tracks may come from different runs: a track re-run on its own is merged into the
canonical file with its own environment (`ResultsFile.track_runs`, `tools/merge_track_runs.py`).

Speedup = other side's latency / our latency, computed only where both sides passed.
"""

from __future__ import annotations

import csv
import io
import math
import os
import statistics
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from hopperbench.environment import EnvironmentRecord
from hopperbench.sides import HUMAN, OURS, REFERENCE, canonical_side_order
from hopperbench.tracks import is_candidate_side


class Status(StrEnum):
    PASSED = "PASSED"
    FAILED = "FAILED"
    RUNTIME_ERROR = "RUNTIME_ERROR"
    CRASH = "CRASH"
    TIMEOUT = "TIMEOUT"
    NO_REFERENCE = "NO_REFERENCE"
    UNAVAILABLE = "UNAVAILABLE"


class GraphStatus(StrEnum):
    """The outcome of timing a side's call replayed from a CUDA graph."""

    PASSED = "PASSED"
    NOT_CAPTURABLE = "NOT_CAPTURABLE"
    FAILED = "FAILED"


# Errors can be inf or NaN; JSON has no such numbers, so they travel as "Infinity"/"NaN" strings.
_MODEL_CONFIG = ConfigDict(extra="forbid", ser_json_inf_nan="strings")


class TrialFloor(BaseModel):
    """The roofline floor of the inputs of one timed trial (`hopperbench.floors.trial_floor`).

    Machine-independent: the empty-kernel span is added per machine by `attach_floors`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bytes_min: float = Field(ge=0)
    core_us: float = Field(ge=0)  # max(memory time, compute time)


class SideResult(BaseModel):
    """What one side did on one workload."""

    model_config = _MODEL_CONFIG

    side: str
    status: Status
    latency_ms: float | None = None  # median over trials of the per-trial medians
    min_ms: float | None = None  # min over trials of the per-trial medians
    max_ms: float | None = None  # max over trials of the per-trial medians
    per_trial_ms: list[float] = Field(default_factory=list)
    # GPU-busy time inside the span (`span.iteration_busy`): median over trials of the per-trial
    # medians, and those medians. latency_ms - busy_ms is idle time inside the call (host work
    # between launches, a host sync), which moves with the host. None/empty in older records.
    busy_ms: float | None = None
    per_trial_busy_ms: list[float] = Field(default_factory=list)
    # How many timed calls each trial's median is over (fewer than the protocol's iterations only
    # for a call slowed down to a time budget); empty in records that predate it.
    per_trial_iterations: list[int] = Field(default_factory=list)
    # The floor of each timed trial's inputs, aligned with per_trial_ms; empty when the worker
    # recorded none (records written before it existed, or inputs the floor model cannot read).
    per_trial_floor: list[TrialFloor] = Field(default_factory=list)
    # The same call replayed from a CUDA graph captured once per trial on that trial's inputs,
    # timed under the same protocol (flush outside the replay): host launch gaps drop out.
    # graph_status PASSED: graph_ms / graph_busy_ms hold the medians over trials of the per-trial
    # medians; NOT_CAPTURABLE: the capture failed (graph_message says why; never timed eagerly in
    # its place); FAILED: the replay's outputs did not pass the gate; None: not attempted (the side
    # failed, or the definition's reference, which is timed eagerly only).
    graph_status: GraphStatus | None = None
    graph_ms: float | None = None
    graph_busy_ms: float | None = None
    per_trial_graph_ms: list[float] = Field(default_factory=list)
    per_trial_graph_busy_ms: list[float] = Field(default_factory=list)
    graph_message: str | None = None
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    relative_l2: float | None = None
    matched_ratio: float | None = None
    message: str | None = None
    pinned: bool | None = None
    # Wall time of the job's process as the runner saw it (for a fresh process: start-up included).
    wall_s: float | None = None

    @property
    def passed(self) -> bool:
        return self.status == Status.PASSED

    @property
    def timed(self) -> bool:
        return self.passed and self.latency_ms is not None and self.latency_ms > 0

    @property
    def graph_timed(self) -> bool:
        return self.graph_status == GraphStatus.PASSED and self.graph_ms is not None and self.graph_ms > 0


class WorkloadKey(BaseModel):
    """The identity and description of one workload, repeated on every record of it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    track: str
    definition: str
    uuid: str
    index: int
    axes: dict[str, int]
    data_source: str
    seed: int
    # The definition's optional inputs this workload passed as None (sorted; e.g. GDN's `state`):
    # it changes what a call must do (a kernel that zero-fills a missing state pays for it), so the
    # summary splits speedups by it. None: not recorded (journals written before the field existed).
    absent_inputs: list[str] | None = None
    # The input recipe's variant of an off-list workload (`WorkloadSpec.recipe_variant`, e.g. MoE's
    # routing pattern); None for a listed workload.
    recipe_variant: str | None = None

    @property
    def row_id(self) -> RowId:
        return row_id(self.track, self.uuid, self.absent_inputs)


# A row's identity: track, workload uuid, and the optional inputs its calls passed as None.
RowId = tuple[str, str, tuple[str, ...]]


def row_id(track: str, uuid: str, absent_inputs: Sequence[str] | None) -> RowId:
    """The identity of a row. Absent inputs that were not recorded (None) read as none: the
    journals and files that do not record them hold no twins."""
    return (track, uuid, tuple(absent_inputs or ()))


class SideRecord(BaseModel):
    """One journal line: a finished (track, row, side)."""

    model_config = ConfigDict(extra="forbid")

    workload: WorkloadKey
    result: SideResult

    @property
    def key(self) -> tuple[RowId, str]:
        """(row, side): what one record finishes."""
        return (self.workload.row_id, self.result.side)


class WorkloadRow(BaseModel):
    """All sides of one row (a workload, or its twin without an optional input), with the speedups
    derived from them."""

    model_config = _MODEL_CONFIG

    track: str
    definition: str
    uuid: str
    index: int
    axes: dict[str, int]
    data_source: str
    seed: int
    absent_inputs: list[str] | None = None
    recipe_variant: str | None = None
    sides: dict[str, SideResult]
    speedup_vs_human: float | None = None
    speedup_vs_reference: float | None = None
    # The fastest passing side among the reference and the library sides.
    best_reference: str | None = None
    speedup_vs_best_reference: float | None = None
    human_pinned: bool | None = None
    # The roofline floor of the inputs the run timed (hopperbench.floors with the exact inputs of
    # each trial, never the axes-only expectation) and ours against it; set by `attach_floors`.
    # floor_ms: median over trials of the trial's floor plus the empty-kernel span;
    # floor_bytes: mean over trials of the bytes the trial's inputs force through HBM;
    # ours_over_floor: median over trials of ours' latency / the trial's floor.
    # None when no trial floors are known (e.g. an old journal of MoE, whose routing ran on the GPU).
    floor_ms: float | None = None
    floor_bytes: float | None = None
    ours_over_floor: float | None = None
    # Median over trials of the trial's bytes / ours' latency on it: the bandwidth our kernel
    # achieves on the bytes it must move.
    ours_tb_per_s: float | None = None

    @property
    def row_id(self) -> RowId:
        return row_id(self.track, self.uuid, self.absent_inputs)

    @classmethod
    def from_sides(cls, workload: WorkloadKey, sides: Mapping[str, SideResult]) -> WorkloadRow:
        ordered = {name: sides[name] for name in canonical_side_order(sides)}
        best = _fastest(r for name, r in ordered.items() if is_reference_side(name))
        human = ordered.get(HUMAN)
        return cls(
            **workload.model_dump(),
            sides=ordered,
            speedup_vs_human=speedup(ordered.get(OURS), human),
            speedup_vs_reference=speedup(ordered.get(OURS), ordered.get(REFERENCE)),
            best_reference=best.side if best else None,
            speedup_vs_best_reference=speedup(ordered.get(OURS), best),
            human_pinned=human.pinned if human else None,
        )


def attach_floors(rows: Sequence[WorkloadRow], t_lat_us: float) -> list[WorkloadRow]:
    """The rows with their floor fields set from per-trial floors (t_lat_us: the measured span of
    an empty kernel, added to every trial's floor).

    A row's trial floors are those its sides recorded (every side of a row timed the same
    inputs, so ours' come first but any side's serve); without them the four fields are None:
    the axes-only estimate describes the average input, not the instance that was timed."""
    if not t_lat_us >= 0:
        raise ValueError(f"t_lat_us must be >= 0, got {t_lat_us}")
    out = []
    for row in rows:
        trial_floors = recorded_trial_floors(row)
        out.append(row.model_copy(update=floor_fields(trial_floors, row.sides.get(OURS), t_lat_us)))
    return out


def recorded_trial_floors(row: WorkloadRow) -> list[TrialFloor] | None:
    """The per-trial floors a side of `row` recorded, ours first; None if none did."""
    ours = row.sides.get(OURS)
    candidates = ([ours] if ours is not None else []) + [r for name, r in row.sides.items() if name != OURS]
    return next((list(r.per_trial_floor) for r in candidates if r.per_trial_floor), None)


def floor_fields(
    trial_floors: Sequence[TrialFloor] | None, ours: SideResult | None, t_lat_us: float
) -> dict[str, float | None]:
    """floor_ms, floor_bytes, ours_over_floor, ours_tb_per_s from per-trial floors.

    Ours is compared trial by trial, so only when its per-trial latencies align with the floors."""
    fields: dict[str, float | None] = dict.fromkeys(FLOOR_FIELDS)
    if not trial_floors:
        return fields
    floor_ms = [(f.core_us + t_lat_us) / 1e3 for f in trial_floors]
    fields["floor_ms"] = statistics.median(floor_ms)
    fields["floor_bytes"] = statistics.fmean(f.bytes_min for f in trial_floors)
    ours_ms = ours.per_trial_ms if ours is not None and ours.timed else []
    if len(ours_ms) == len(trial_floors) and all(ms > 0 for ms in ours_ms) and all(ms > 0 for ms in floor_ms):
        fields["ours_over_floor"] = statistics.median(o / f for o, f in zip(ours_ms, floor_ms))
        fields["ours_tb_per_s"] = statistics.median(
            f.bytes_min / (o * 1e-3) / 1e12 for o, f in zip(ours_ms, trial_floors)
        )
    return fields


def speedup(ours: SideResult | None, other: SideResult | None) -> float | None:
    """other / ours latency, when both passed and were timed."""
    if ours is None or other is None or not (ours.timed and other.timed):
        return None
    assert ours.latency_ms is not None and other.latency_ms is not None
    return other.latency_ms / ours.latency_ms


def is_reference_side(name: str) -> bool:
    """The reference or a library side: what "best reference" is chosen from (never ours, human or a candidate)."""
    return name not in (OURS, HUMAN) and not is_candidate_side(name)


def busy_speedup(ours: SideResult | None, other: SideResult | None) -> float | None:
    """other / ours GPU-busy time (host gaps inside the span excluded), when both were timed and recorded it:
    the kernel-against-kernel view beside `speedup`'s spans, which hold each side's host time too."""
    if ours is None or other is None or not (ours.timed and other.timed):
        return None
    if ours.busy_ms is None or other.busy_ms is None or ours.busy_ms <= 0:
        return None
    return other.busy_ms / ours.busy_ms


def _fastest(results: Iterable[SideResult]) -> SideResult | None:
    timed = [r for r in results if r.timed]
    return min(timed, key=lambda r: r.latency_ms or math.inf) if timed else None


def row_order(row: WorkloadRow) -> tuple[str, int, str, tuple[str, ...]]:
    """Rows in track then index order, a workload's own row before its twin."""
    track, uuid, absent = row.row_id
    return (track, row.index, uuid, absent)


def build_rows(records: Iterable[SideRecord]) -> list[WorkloadRow]:
    """Group records by row (the last record of a key wins), in `row_order`."""
    workloads: dict[RowId, WorkloadKey] = {}
    sides: dict[RowId, dict[str, SideResult]] = {}
    for record in records:
        rid = record.workload.row_id
        workloads[rid] = record.workload
        sides.setdefault(rid, {})[record.result.side] = record.result
    rows = [WorkloadRow.from_sides(workloads[k], sides[k]) for k in workloads]
    return sorted(rows, key=row_order)


# ------------------------------------------------------------------------------------------
# Summary


class SpeedupSummary(BaseModel):
    model_config = _MODEL_CONFIG

    geomean: float | None
    workloads: int  # how many workloads entered the mean (both sides passed)


NO_SPEEDUP = SpeedupSummary(geomean=None, workloads=0)


class InputGroupSummary(BaseModel):
    """The speedups over the workloads of a track that passed the same optional inputs as None."""

    model_config = ConfigDict(extra="forbid")

    workloads: int
    vs_human: SpeedupSummary
    vs_best_reference: SpeedupSummary
    vs_human_busy: SpeedupSummary = NO_SPEEDUP
    vs_best_reference_busy: SpeedupSummary = NO_SPEEDUP


class TrackSummary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    track: str
    workloads: int
    vs_human: SpeedupSummary
    vs_reference: SpeedupSummary
    vs_best_reference: SpeedupSummary
    # The same two on GPU-busy time (`busy_speedup`; absent from runs before busy_ms was recorded), the
    # best reference being the one with the least busy time.
    vs_human_busy: SpeedupSummary = NO_SPEEDUP
    vs_best_reference_busy: SpeedupSummary = NO_SPEEDUP
    # Geometric mean of ours / floor over the workloads where ours was timed (None without floors).
    ours_over_floor: SpeedupSummary | None = None
    # Per candidate side: geometric mean of ours' latency / the candidate's (> 1: the candidate is
    # faster), over the workloads where both passed.
    candidates_vs_ours: dict[str, SpeedupSummary] = Field(default_factory=dict)
    # Keyed by `absent_inputs_label`, only when the track's workloads differ in their absent
    # optional inputs: one mean over both kinds of call hides which one a speedup comes from.
    by_absent_inputs: dict[str, InputGroupSummary] = Field(default_factory=dict)
    passed: dict[str, int]
    # Ran (or should have run) and did not pass: every status but PASSED and UNAVAILABLE.
    failed: dict[str, int]
    unavailable: dict[str, int]


def geometric_mean(values: Sequence[float]) -> float | None:
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _speedup_summary(values: Iterable[float | None]) -> SpeedupSummary:
    present = [v for v in values if v is not None]
    return SpeedupSummary(geomean=geometric_mean(present), workloads=len(present))


def _busy_vs_human(row: WorkloadRow) -> float | None:
    return busy_speedup(row.sides.get(OURS), row.sides.get(HUMAN))


def _busy_vs_best_reference(row: WorkloadRow) -> float | None:
    """Against the reference or library side with the least GPU-busy time: on spans the best one can be a
    side whose span is host time (e.g. the PyTorch reference), which says nothing about its kernels."""
    ours = row.sides.get(OURS)
    ratios = [
        busy_speedup(ours, result)
        for name, result in row.sides.items()
        if is_reference_side(name)
    ]
    present = [r for r in ratios if r is not None]
    return min(present) if present else None


def absent_inputs_label(absent: Sequence[str] | None) -> str:
    if absent is None:
        return "not recorded"
    return "all inputs" if not absent else "no " + ", ".join(absent)


def _by_absent_inputs(rows: Sequence[WorkloadRow]) -> dict[str, InputGroupSummary]:
    groups: dict[str, list[WorkloadRow]] = {}
    for row in rows:
        groups.setdefault(absent_inputs_label(row.absent_inputs), []).append(row)
    if len(groups) < 2:
        return {}
    return {
        label: InputGroupSummary(
            workloads=len(group),
            vs_human=_speedup_summary(r.speedup_vs_human for r in group),
            vs_best_reference=_speedup_summary(r.speedup_vs_best_reference for r in group),
            vs_human_busy=_speedup_summary(_busy_vs_human(r) for r in group),
            vs_best_reference_busy=_speedup_summary(_busy_vs_best_reference(r) for r in group),
        )
        for label, group in sorted(groups.items())
    }


def sampled_input(track: str) -> str | None:
    """The optional input whose absence the track samples (`Track.absent_input_sample`), or None."""
    from hopperbench.tracks import TRACKS

    entry = TRACKS.get(track)
    sample = entry.absent_input_sample if entry is not None else None
    return sample.input if sample is not None else None


def _lacks_sampled_input(row: WorkloadRow) -> bool:
    name = sampled_input(row.track)
    return name is not None and name in (row.absent_inputs or ())


def headline_rows(rows: Iterable[WorkloadRow]) -> list[WorkloadRow]:
    """The rows of the headline, by-size table and pass counts: every row that gave its track's
    sampled optional input (every row of a track without a sample)."""
    return [r for r in rows if not _lacks_sampled_input(r)]


def absent_input_rows(rows: Iterable[WorkloadRow]) -> list[WorkloadRow]:
    """The rows without their track's sampled optional input (GDN: the no-state table)."""
    return [r for r in rows if _lacks_sampled_input(r)]


def summarize(rows: Sequence[WorkloadRow]) -> dict[str, TrackSummary]:
    by_track: dict[str, list[WorkloadRow]] = {}
    for row in rows:
        by_track.setdefault(row.track, []).append(row)
    summary: dict[str, TrackSummary] = {}
    for track, all_rows in by_track.items():
        # The track's means and counts are the headline's; the rows without the sampled input
        # (GDN's no-state twins) are summarised apart, in `by_absent_inputs`.
        track_rows = headline_rows(all_rows)
        side_names = canonical_side_order({s for r in track_rows for s in r.sides})
        passed = {s: 0 for s in side_names}
        failed = {s: 0 for s in side_names}
        unavailable = {s: 0 for s in side_names}
        for row in track_rows:
            for name, result in row.sides.items():
                if result.status == Status.PASSED:
                    passed[name] += 1
                elif result.status == Status.UNAVAILABLE:
                    unavailable[name] += 1
                else:
                    failed[name] += 1
        summary[track] = TrackSummary(
            track=track,
            workloads=len(track_rows),
            vs_human=_speedup_summary(r.speedup_vs_human for r in track_rows),
            vs_reference=_speedup_summary(r.speedup_vs_reference for r in track_rows),
            vs_best_reference=_speedup_summary(r.speedup_vs_best_reference for r in track_rows),
            vs_human_busy=_speedup_summary(_busy_vs_human(r) for r in track_rows),
            vs_best_reference_busy=_speedup_summary(_busy_vs_best_reference(r) for r in track_rows),
            ours_over_floor=(
                _speedup_summary(r.ours_over_floor for r in track_rows)
                if any(r.floor_ms is not None for r in track_rows)
                else None
            ),
            candidates_vs_ours={
                name: _speedup_summary(speedup(r.sides.get(name), r.sides.get(OURS)) for r in track_rows)
                for name in side_names
                if is_candidate_side(name)
            },
            by_absent_inputs=_by_absent_inputs(all_rows),
            passed=passed,
            failed=failed,
            unavailable=unavailable,
        )
    return summary


def _fmt_speedup(s: SpeedupSummary) -> str:
    return "-" if s.geomean is None else f"{s.geomean:.3g}x ({s.workloads})"


def format_summary_table(summary: Mapping[str, TrackSummary]) -> str:
    """A plain-text table for the terminal: speedup geometric means and pass counts per side."""
    header = ["track", "workloads", "vs human", "vs reference", "vs best ref", "ours/floor", "candidates vs ours",
              "passed / failed / unavailable"]  # fmt: skip
    lines = [header]
    for s in summary.values():
        counts = ", ".join(f"{n} {s.passed[n]}/{s.failed[n]}/{s.unavailable[n]}" for n in s.passed)
        lines.append(
            [
                s.track,
                str(s.workloads),
                _fmt_speedup(s.vs_human),
                _fmt_speedup(s.vs_reference),
                _fmt_speedup(s.vs_best_reference),
                "-" if s.ours_over_floor is None else _fmt_speedup(s.ours_over_floor),
                ", ".join(f"{n} {_fmt_speedup(v)}" for n, v in s.candidates_vs_ours.items()) or "-",
                counts,
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    for s in summary.values():
        table.append(
            f"{s.track} on GPU busy time: vs human {_fmt_speedup(s.vs_human_busy)},"
            f" vs best ref {_fmt_speedup(s.vs_best_reference_busy)}"
        )
        for label, group in s.by_absent_inputs.items():
            table.append(
                f"{s.track} with {label} ({group.workloads}): vs human {_fmt_speedup(group.vs_human)},"
                f" vs best ref {_fmt_speedup(group.vs_best_reference)}; on GPU busy time"
                f" {_fmt_speedup(group.vs_human_busy)}, {_fmt_speedup(group.vs_best_reference_busy)}"
            )
    return "\n".join(table)


# ------------------------------------------------------------------------------------------
# Journal


class PlannedRow(BaseModel):
    """One row a run set out to record: a workload and the optional inputs its calls pass as None.

    In a journal a row without absent inputs is its bare uuid, so that a plan without twins reads
    the same to every reader of journals."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uuid: str
    absent_inputs: tuple[str, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _from_uuid(cls, data: Any) -> Any:
        return {"uuid": data} if isinstance(data, str) else data

    @model_serializer(mode="wrap")
    def _as_uuid(self, handler: SerializerFunctionWrapHandler) -> Any:
        return handler(self) if self.absent_inputs else self.uuid


class PlannedTrack(BaseModel):
    """What a run set out to record for one track."""

    model_config = ConfigDict(extra="forbid")

    workloads: list[PlannedRow]  # every row: the workloads, then their twins
    sides: list[str]


class JournalHeader(BaseModel):
    """First line of a journal: what must match for a run to be resumed, and what it was run on.

    Only seed and protocol must match for a resume; the other fields are optional so that
    journals written before they existed still read.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["header"] = "header"
    seed: int
    protocol: dict[str, Any]
    # Collected once, when the run started; a resume keeps it.
    environment: EnvironmentRecord | None = None
    # Per track, the rows (workloads and their twins) and sides planned (a resume adds what it plans).
    plan: dict[str, PlannedTrack] | None = None
    resumed_at: list[str] = Field(default_factory=list)  # ISO times, one per resume


def merge_plans(*plans: Mapping[str, PlannedTrack] | None) -> dict[str, PlannedTrack]:
    """The union of plans, per track, in first-seen order."""
    merged: dict[str, tuple[dict[PlannedRow, None], dict[str, None]]] = {}
    for plan in plans:
        for track, planned in (plan or {}).items():
            workloads, sides = merged.setdefault(track, ({}, {}))
            workloads.update(dict.fromkeys(planned.workloads))
            sides.update(dict.fromkeys(planned.sides))
    return {t: PlannedTrack(workloads=list(w), sides=list(s)) for t, (w, s) in merged.items()}


def plan_from_records(records: Iterable[SideRecord]) -> dict[str, PlannedTrack]:
    """A plan for a journal that did not store one: what it recorded, every side seen in a track."""
    return merge_plans(
        *(
            {
                r.workload.track: PlannedTrack(
                    workloads=[PlannedRow(uuid=r.workload.uuid, absent_inputs=r.workload.row_id[2])],
                    sides=[r.result.side],
                )
            }
            for r in records
        )
    )


class JournalMismatchError(ValueError):
    pass


class Journal:
    """Append-only JSONL of finished records, fsynced line by line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @staticmethod
    def path_for(output_json: Path) -> Path:
        return output_json.with_name(output_json.stem + ".journal.jsonl")

    def exists(self) -> bool:
        return self.path.is_file()

    def create(self, header: JournalHeader) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "x", encoding="utf-8") as f:
            f.write(header.model_dump_json() + "\n")
            f.flush()
            os.fsync(f.fileno())

    def append(self, record: SideRecord) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(record.model_dump_json() + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> tuple[JournalHeader, list[SideRecord]]:
        header, records, _ = self._parse()
        return header, records

    def _parse(self) -> tuple[JournalHeader, list[SideRecord], list[str]]:
        """Header, records, and the records' lines as written."""
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise JournalMismatchError(f"{self.path} is not UTF-8 text (byte {e.start})") from None
        if not lines:
            raise JournalMismatchError(f"{self.path} is empty")
        try:
            header = JournalHeader.model_validate_json(lines[0])
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(map(str, first["loc"]))
            raise JournalMismatchError(
                f"{self.path}:1 is not a journal header ({where + ': ' if where else ''}{first['msg']})"
            ) from None
        records: list[SideRecord] = []
        kept: list[str] = []
        for number, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            try:
                records.append(SideRecord.model_validate_json(line))
                kept.append(line)
            except ValueError:
                # A run killed mid-write leaves a torn last line; anything else is corruption.
                if number == len(lines):
                    break
                raise JournalMismatchError(f"{self.path}:{number} is not a valid record") from None
        return header, records, kept

    def rewrite_header(self, header: JournalHeader) -> None:
        """Replace the header, keeping every record as written; a torn last line is dropped, so
        that the next append starts a line of its own."""
        _, _, kept = self._parse()
        atomic_write_text(self.path, "".join(line + "\n" for line in [header.model_dump_json(), *kept]))

    def check_resumable(self, expected: JournalHeader) -> list[SideRecord]:
        """The journal's records, after checking it was written under the same seed and protocol."""
        header, records = self.read()
        if header.seed != expected.seed:
            raise JournalMismatchError(
                f"cannot resume {self.path}: it used seed {header.seed}, this run seed {expected.seed}"
            )
        if header.protocol != expected.protocol:
            differing = sorted(
                k
                for k in header.protocol.keys() | expected.protocol.keys()
                if header.protocol.get(k) != expected.protocol.get(k)
            )
            raise JournalMismatchError(
                f"cannot resume {self.path}: its timing protocol differs in {', '.join(differing)}"
            )
        return records


# ------------------------------------------------------------------------------------------
# JSON and CSV files

FLOOR_FIELDS = ("floor_ms", "floor_bytes", "ours_over_floor", "ours_tb_per_s")


class TrackCompleteness(BaseModel):
    model_config = ConfigDict(extra="forbid")

    planned: int  # rows: workloads and twins
    complete: int  # rows with a record of every planned side
    sides: list[str]


class Completeness(BaseModel):
    """How much of the plan the rows cover; `partial` when a run stopped early."""

    model_config = ConfigDict(extra="forbid")

    partial: bool
    planned: int
    complete: int
    tracks: dict[str, TrackCompleteness]
    # "journal header", or "journal records" for a journal that did not store its plan.
    plan_source: str

    @classmethod
    def of_tracks(cls, tracks: dict[str, TrackCompleteness], plan_source: str) -> Completeness:
        """The totals over `tracks`; partial when any planned workload is incomplete."""
        planned = sum(t.planned for t in tracks.values())
        complete = sum(t.complete for t in tracks.values())
        return cls(
            partial=complete < planned, planned=planned, complete=complete, tracks=tracks, plan_source=plan_source
        )


def assess_completeness(plan: Mapping[str, PlannedTrack] | None, records: Iterable[SideRecord]) -> Completeness:
    records = list(records)
    recorded: dict[RowId, set[str]] = {}
    for record in records:
        recorded.setdefault(record.workload.row_id, set()).add(record.result.side)
    source = "journal header" if plan is not None else "journal records"
    tracks = {}
    for track, planned in (plan if plan is not None else plan_from_records(records)).items():
        wanted = set(planned.sides)
        complete = sum(
            wanted <= recorded.get(row_id(track, row.uuid, row.absent_inputs), set()) for row in planned.workloads
        )
        tracks[track] = TrackCompleteness(planned=len(planned.workloads), complete=complete, sides=planned.sides)
    return Completeness.of_tracks(tracks, source)


def format_completeness(completeness: Completeness) -> str | None:
    """One line for the terminal when the results are partial."""
    if not completeness.partial:
        return None
    per_track = ", ".join(f"{name} {t.complete}/{t.planned}" for name, t in completeness.tracks.items())
    return (
        f"partial: {completeness.complete} of {completeness.planned} workloads have every planned side recorded"
        f" ({per_track})"
    )


class TrackRun(BaseModel):
    """The run a track's rows were measured in, where that is not the file's own: a track re-run on
    its own and merged into the file (`tools/merge_track_runs.py`)."""

    model_config = ConfigDict(extra="forbid")

    environment: EnvironmentRecord
    environment_source: str | None = None
    resumed_at: list[str] = Field(default_factory=list)


class ResultsFile(BaseModel):
    """The run's JSON: how it was measured, every row, and the per-track summary."""

    model_config = ConfigDict(extra="forbid")

    # The environment of every track not in `track_runs`.
    environment: EnvironmentRecord
    # Where `environment` came from: "journal header", or "<path> (attached at finalize)".
    environment_source: str | None = None
    resumed_at: list[str] = Field(default_factory=list)
    # Per track measured in another run than `environment`'s: that run's environment, its source and
    # resumes. Empty (and absent in files written before it existed): one run measured every track.
    track_runs: dict[str, TrackRun] = Field(default_factory=dict)
    # Absent in files written before it existed.
    completeness: Completeness | None = None
    rows: list[WorkloadRow]
    summary: dict[str, TrackSummary]

    def track_environment(self, track: str) -> EnvironmentRecord:
        """The environment the track's rows were measured in."""
        run = self.track_runs.get(track)
        return run.environment if run is not None else self.environment

    def track_environments(self) -> dict[str, EnvironmentRecord]:
        """Each track of the rows, in row order, and the environment it was measured in."""
        return {track: self.track_environment(track) for track in dict.fromkeys(r.track for r in self.rows)}


def format_axes(axes: Mapping[str, int]) -> str:
    return ";".join(f"{k}={v}" for k, v in axes.items())


# CSV cell of `absent_inputs` in the old wide CSV: "-" when every input was given.
ALL_INPUTS_GIVEN = "-"


def format_absent_inputs(absent: Sequence[str] | None) -> str | None:
    if absent is None:
        return None
    return ";".join(absent) if absent else ALL_INPUTS_GIVEN


def parse_absent_inputs(text: str | None) -> list[str] | None:
    if not text:
        return None
    return [] if text == ALL_INPUTS_GIVEN else text.split(";")


def parse_axes(text: str) -> dict[str, int]:
    if not text:
        return {}
    pairs = (item.split("=", 1) for item in text.split(";"))
    return {k: int(v) for k, v in pairs}


def csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


# ------------------------------------------------------------------------------------------
# The tidy CSV: one row per (track, workload, side), the same columns for every track and run
# (results/SCHEMA.md describes each column).

# The optional input whose presence the `state_given` column records.
STATE_INPUT = "state"

TIDY_LEAD_COLUMNS = ("track", "definition", "workload_index", "uuid", "data_source", "state_given", "recipe_variant")
# Lead columns that CSVs written before them lack (read as empty).
TIDY_LATER_COLUMNS = frozenset({"recipe_variant"})
TIDY_SIDE_COLUMNS = (
    "side", "side_kind", "side_version", "status", "message",
    "eager_ms", "eager_min_ms", "eager_max_ms", "eager_busy_ms",
    "graph_status", "graph_ms", "graph_busy_ms", "graph_message",
    "max_abs_err", "max_rel_err", "relative_l2", "matched_ratio",
    "floor_ms", "floor_bytes", "over_floor",
    "trials", "iterations", "seed", "gpu", "commit",
)  # fmt: skip
# Tidy column -> SideResult field, for the columns that are one field of the side's result.
_TIDY_RESULT_FIELDS = {
    "message": "message",
    "eager_ms": "latency_ms",
    "eager_min_ms": "min_ms",
    "eager_max_ms": "max_ms",
    "eager_busy_ms": "busy_ms",
    "graph_ms": "graph_ms",
    "graph_busy_ms": "graph_busy_ms",
    "graph_message": "graph_message",
    "max_abs_err": "max_abs_err",
    "max_rel_err": "max_rel_err",
    "relative_l2": "relative_l2",
    "matched_ratio": "matched_ratio",
}
_TIDY_FLOAT_FIELDS = frozenset(_TIDY_RESULT_FIELDS) - {"message", "graph_message"}


def _definition_json(track_name: str) -> dict[str, Any]:
    """A registry track's definition JSON as authored (read directly: no flashinfer-bench import)."""
    import json

    from hopperbench.tracks import TRACKS

    return json.loads(TRACKS[track_name].definition_path.read_text(encoding="utf-8"))


def definition_var_axes() -> list[str]:
    """Every `var` axis of every registry track's definition, tracks in registry order and each
    definition's axes in its own order, each name once: the tidy CSV's axis columns."""
    from hopperbench.tracks import TRACKS

    names: list[str] = []
    for track in TRACKS:
        axes = _definition_json(track).get("axes", {})
        names += [n for n, a in axes.items() if a.get("type") == "var" and n not in names]
    return names


def track_has_state_input(track: str) -> bool:
    """Whether the track's definition has an optional `state` input (GDN); False for a track not in
    the registry."""
    from hopperbench.tracks import TRACKS

    if track not in TRACKS:
        return False
    inputs = _definition_json(track).get("inputs", {})
    return bool(inputs.get(STATE_INPUT, {}).get("optional"))


def state_given(track: str, absent_inputs: Sequence[str] | None) -> bool | None:
    """Whether the workload passed `state` (tidy column `state_given`); None where the track has no
    optional state or the record does not say."""
    if absent_inputs is None or not track_has_state_input(track):
        return None
    return STATE_INPUT not in absent_inputs


def side_kind(name: str) -> str:
    """ours / candidate / human / reference / library."""
    if name == OURS:
        return "ours"
    if name == HUMAN:
        return "human"
    if name == REFERENCE:
        return "reference"
    if is_candidate_side(name):
        return "candidate"
    return "library"


def library_pin(track: str, name: str) -> str | None:
    """A library side's pin from the registry: its `package` requirement, else its `submodule`."""
    from hopperbench.tracks import TRACKS

    entry = TRACKS.get(track)
    for lib in entry.libraries if entry is not None else ():
        if lib.name == name:
            return lib.package or lib.submodule
    return None


def human_pinned_commit(track: str) -> str | None:
    """The commit human_best/manifest.toml pins for the track's winner (None if unreadable)."""
    from hopperbench.human_best import ManifestError, load_manifest
    from hopperbench.tracks import TRACKS

    entry = TRACKS.get(track)
    if entry is None:
        return None
    try:
        manifest = load_manifest()
    except (ManifestError, OSError):
        return None
    human = manifest.get(entry.human_key)
    return human.commit if human is not None else None


def side_version(track: str, name: str, result: SideResult, repo_commit: str | None) -> str | None:
    """ours/candidate: `repo_commit`, the commit the row's track was measured at; human: the pinned
    commit if it ran; library: its pin; reference: "definition"."""
    kind = side_kind(name)
    if kind in ("ours", "candidate"):
        return repo_commit
    if kind == "reference":
        return "definition"
    if kind == "human":
        return human_pinned_commit(track) if result.status != Status.UNAVAILABLE else None
    return library_pin(track, name)


def tidy_columns(rows: Sequence[WorkloadRow] = ()) -> list[str]:
    """The tidy CSV's header: lead columns, one per definition var axis (then any axis of `rows`
    that no registry definition has, sorted: never in a run of the registry's tracks), side columns."""
    axes = definition_var_axes()
    extra = sorted({a for r in rows for a in r.axes} - set(axes))
    return [*TIDY_LEAD_COLUMNS, *axes, *extra, *TIDY_SIDE_COLUMNS]


def _iterations(result: SideResult, environment: EnvironmentRecord | None) -> int | None:
    if result.per_trial_iterations:
        return min(result.per_trial_iterations)
    if result.timed and environment is not None:
        iterations = environment.protocol.get("iterations")
        return iterations if isinstance(iterations, int) else None
    return None


def tidy_records(
    rows: Sequence[WorkloadRow],
    environment: EnvironmentRecord | None = None,
    track_environments: Mapping[str, EnvironmentRecord] | None = None,
) -> list[dict[str, Any]]:
    """The tidy CSV's rows as dicts of typed values (None = empty cell), one per (workload, side).

    A row's `gpu`, `commit`, `iterations` and ours' `side_version` come from the environment its
    track was measured in: `track_environments[track]`, else `environment`."""
    default = environment or EnvironmentRecord()
    per_track = track_environments or {}
    out = []
    for row in rows:
        env = per_track.get(row.track, default)
        given = state_given(row.track, row.absent_inputs)
        for name, result in row.sides.items():
            record: dict[str, Any] = {
                "track": row.track,
                "definition": row.definition,
                "workload_index": row.index,
                "uuid": row.uuid,
                "data_source": row.data_source,
                "state_given": given,
                "recipe_variant": row.recipe_variant,
                **row.axes,
                "side": name,
                "side_kind": side_kind(name),
                "side_version": side_version(row.track, name, result, env.repo_commit),
                "status": result.status.value,
                "graph_status": result.graph_status.value if result.graph_status is not None else None,
                "floor_ms": row.floor_ms,
                "floor_bytes": row.floor_bytes,
                "over_floor": (
                    result.latency_ms / row.floor_ms
                    if result.timed and result.latency_ms and row.floor_ms
                    else None
                ),
                "trials": len(result.per_trial_ms) if result.per_trial_ms else None,
                "iterations": _iterations(result, env),
                "seed": row.seed,
                "gpu": env.gpu_name,
                "commit": env.repo_commit,
            }
            for column, field in _TIDY_RESULT_FIELDS.items():
                record[column] = getattr(result, field)
            out.append(record)
    return out


def rows_to_csv(
    rows: Sequence[WorkloadRow],
    environment: EnvironmentRecord | None = None,
    track_environments: Mapping[str, EnvironmentRecord] | None = None,
) -> str:
    """The tidy CSV of `rows` (see results/SCHEMA.md); environments as in `tidy_records`."""
    columns = tidy_columns(rows)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for record in tidy_records(rows, environment, track_environments):
        writer.writerow({k: csv_cell(record.get(k)) for k in columns})
    return out.getvalue()


def _float_or_none(text: str) -> float | None:
    return float(text) if text != "" else None


class TidyFormatError(ValueError):
    """A CSV that is not in the tidy format (e.g. the wide CSV of runs before it)."""


def read_tidy_csv(path: Path) -> list[dict[str, str]]:
    """The tidy CSV's lines as {column: cell text}; refuses a CSV of another format."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        required = [c for c in (*TIDY_LEAD_COLUMNS, *TIDY_SIDE_COLUMNS) if c not in TIDY_LATER_COLUMNS]
        missing = [c for c in required if c not in (reader.fieldnames or [])]
        if missing:
            raise TidyFormatError(f"{path} is not a tidy results CSV (no column {missing[0]!r})")
        return list(reader)


def read_csv_rows(path: Path) -> list[WorkloadRow]:
    """WorkloadRows back from a tidy results CSV. The CSV keeps no per-trial lists, so a row's
    ours_over_floor is ours' over_floor cell (latency / floor) and ours_tb_per_s is not restored.

    A CSV in the wide format of earlier runs is read through the JSON beside it, if any."""
    try:
        lines = read_tidy_csv(path)
    except TidyFormatError:
        json_path = path.with_suffix(".json")
        if json_path.is_file():
            return read_results(json_path).rows
        raise
    lead = set(TIDY_LEAD_COLUMNS) | set(TIDY_SIDE_COLUMNS)
    workloads: dict[tuple[str, str, str], tuple[WorkloadKey, dict[str, str]]] = {}
    sides: dict[tuple[str, str, str], dict[str, SideResult]] = {}
    ours_over_floor: dict[tuple[str, str, str], float | None] = {}
    for line in lines:
        given = line["state_given"]
        wkey = (line["track"], line["uuid"], given)  # a workload and its no-state twin differ in state_given
        if line["side"] == OURS:
            ours_over_floor[wkey] = _float_or_none(line["over_floor"])
        if wkey not in workloads:
            workloads[wkey] = (
                WorkloadKey(
                    track=line["track"],
                    definition=line["definition"],
                    uuid=line["uuid"],
                    index=int(line["workload_index"]),
                    axes={k: int(v) for k, v in line.items() if k not in lead and v not in ("", None)},
                    data_source=line["data_source"],
                    seed=int(line["seed"]),
                    absent_inputs=None if given == "" else ([] if given == "true" else [STATE_INPUT]),
                    recipe_variant=line.get("recipe_variant") or None,
                ),
                line,
            )
        values: dict[str, Any] = {}
        for column, field in _TIDY_RESULT_FIELDS.items():
            text = line[column]
            values[field] = _float_or_none(text) if column in _TIDY_FLOAT_FIELDS else (text or None)
        sides.setdefault(wkey, {})[line["side"]] = SideResult(
            side=line["side"],
            status=Status(line["status"]),
            graph_status=GraphStatus(line["graph_status"]) if line["graph_status"] else None,
            **values,
        )
    rows = []
    for wkey, (workload, first) in workloads.items():
        row = WorkloadRow.from_sides(workload, sides[wkey])
        rows.append(
            row.model_copy(
                update={
                    "floor_ms": _float_or_none(first["floor_ms"]),
                    "floor_bytes": _float_or_none(first["floor_bytes"]),
                    "ours_over_floor": ours_over_floor.get(wkey),
                }
            )
        )
    return sorted(rows, key=row_order)


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder and rename, so readers never see half a file."""
    atomic_write_texts({path: text})


def atomic_write_texts(texts: Mapping[Path, str]) -> None:
    """Write every file to a temporary file beside it first, then rename them all: a failure while
    writing (a full disk) replaces none of them, so files that belong together stay together."""
    written: dict[Path, Path] = {}
    try:
        for path, text in texts.items():
            written[path] = _write_temporary(path, text)
        for path, tmp in written.items():
            os.replace(tmp, path)
    except BaseException:
        for tmp in written.values():
            tmp.unlink(missing_ok=True)
        raise


def _write_temporary(path: Path, text: str) -> Path:
    """`text` in a new temporary file in `path`'s folder, synced to disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            # mkstemp creates the file 0600; results are for everyone to read.
            os.fchmod(f.fileno(), 0o644)
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def csv_path_for(output_json: Path) -> Path:
    return output_json.with_suffix(".csv")


def write_results(
    output_json: Path,
    environment: EnvironmentRecord,
    rows: Sequence[WorkloadRow],
    *,
    completeness: Completeness | None = None,
    environment_source: str | None = None,
    resumed_at: Sequence[str] = (),
) -> ResultsFile:
    """Write the JSON and, beside it with the same stem, the CSV. Returns what was written.

    Rows get their roofline floors when the environment holds the empty-kernel span
    (`attach_floors`)."""
    if environment.empty_kernel_span_ms is not None:
        rows = attach_floors(rows, environment.empty_kernel_span_ms * 1e3)
    results = ResultsFile(
        environment=environment,
        environment_source=environment_source,
        resumed_at=list(resumed_at),
        completeness=completeness,
        rows=list(rows),
        summary=summarize(rows),
    )
    write_results_file(output_json, results)
    return results


def write_results_file(output_json: Path, results: ResultsFile) -> None:
    """The JSON of `results` and, beside it with the same stem, its tidy CSV; neither file is
    replaced unless both can be written."""
    csv_text = rows_to_csv(results.rows, results.environment, results.track_environments())
    atomic_write_texts({output_json: results.model_dump_json(indent=2) + "\n", csv_path_for(output_json): csv_text})


def write_journal_results(
    output_json: Path,
    header: JournalHeader,
    records: Sequence[SideRecord],
    environment: EnvironmentRecord,
    environment_source: str,
) -> ResultsFile:
    """The JSON and CSV of a journal's records, finished or not, with how complete they are."""
    return write_results(
        output_json,
        environment,
        build_rows(records),
        completeness=assess_completeness(header.plan, records),
        environment_source=environment_source,
        resumed_at=header.resumed_at,
    )


def read_results(output_json: Path) -> ResultsFile:
    return ResultsFile.model_validate_json(output_json.read_text(encoding="utf-8"))
