"""Turn CUPTI activity records into per-iteration kernel spans.

Pure logic, no CUDA or CUPTI import, so it can be tested on recorded records. It
follows FlashInfer's `bench_gpu_time_with_cupti` (harness_facts.md §5.3, steps 9-10):
an iteration owns every GPU record (kernel, memcpy, memset) whose launching API call
(runtime or driver) started inside the iteration's host window `[t0, t1]`, matched by
CUPTI correlation id; its span runs from the earliest start to the latest end of those
records. Attribution is by correlation id only, never by GPU time, so work launched
before `t0` (the L2 flush) is excluded even if it executes inside the window, and
every idle gap between the call's first and last GPU activity is included.
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

NS_PER_MS = 1e6


class TimingError(RuntimeError):
    """The activity records cannot give a trustworthy span for the timed call."""


@dataclass(frozen=True)
class ApiRecord:
    """One CUDA runtime or driver API call as CUPTI recorded it (host timestamps, ns)."""

    start: int
    end: int
    correlation_id: int
    kind: int
    callback_id: int


@dataclass(frozen=True)
class GpuRecord:
    """One kernel, memcpy or memset as CUPTI recorded it (GPU timestamps, ns).

    `name` is the kernel name, or "MEMCPY" / "MEMSET" for copies and sets.
    `copy_kind`, `bytes` and `value` are 0 where they do not apply.
    """

    name: str
    start: int
    end: int
    correlation_id: int
    kind: int
    copy_kind: int = 0
    bytes: int = 0
    value: int = 0

    @property
    def work(self) -> tuple[str, int, int, int, int]:
        """What must be the same every iteration (start, end and correlation id are not)."""
        return (self.name, self.copy_kind, self.bytes, self.value, self.kind)


def _signature(work: tuple[str, int, int, int, int]) -> str:
    name, copy_kind, nbytes, value, kind = work
    return f"{name}_{copy_kind}_{nbytes}_{value}_{kind}"


@dataclass
class ActivityTrace:
    """Everything one timed run recorded: the host windows and the activity records.

    Serialisable to JSON so that a real run can be kept and replayed as a test fixture.
    `spans` and `busy` share one attribution of the records to iterations, made at the first
    of them from the complete trace (a trace that grows after that is attributed again): for a
    Python reference's ~10^5 records a trial it is most of the work after the timed calls.
    """

    windows: list[tuple[int, int]] = field(default_factory=list)
    api_records: list[ApiRecord] = field(default_factory=list)
    gpu_records: list[GpuRecord] = field(default_factory=list)
    _attributed: tuple[tuple[int, int, int], list[list[GpuRecord]]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def to_json(self) -> dict:
        return {
            "windows": [list(w) for w in self.windows],
            "api_records": [asdict(r) for r in self.api_records],
            "gpu_records": [asdict(r) for r in self.gpu_records],
        }

    @classmethod
    def from_json(cls, data: dict) -> ActivityTrace:
        return cls(
            windows=[(int(t0), int(t1)) for t0, t1 in data["windows"]],
            api_records=[ApiRecord(**r) for r in data["api_records"]],
            gpu_records=[GpuRecord(**r) for r in data["gpu_records"]],
        )

    @classmethod
    def load(cls, path: Path) -> ActivityTrace:
        return cls.from_json(json.loads(Path(path).read_text()))

    def per_iteration(self) -> list[list[GpuRecord]]:
        """`iteration_gpu_records` of this trace."""
        size = (len(self.windows), len(self.api_records), len(self.gpu_records))
        if self._attributed is None or self._attributed[0] != size:
            self._attributed = (size, iteration_gpu_records(self.windows, self.api_records, self.gpu_records))
        return self._attributed[1]

    def spans(self) -> list[float]:
        return [_span_ms(records) for records in self.per_iteration()]

    def busy(self) -> list[float]:
        return [_covered_ns(records) / NS_PER_MS for records in self.per_iteration()]


def _describe_difference(first: set[str], other: set[str]) -> str:
    missing = sorted(first - other)
    extra = sorted(other - first)
    parts = []
    if missing:
        parts.append(f"missing {missing}")
    if extra:
        parts.append(f"extra {extra}")
    return "; ".join(parts)


def api_calls_in_windows(
    windows: Sequence[tuple[int, int]], api_records: Sequence[ApiRecord]
) -> list[list[ApiRecord]]:
    """Per window [t0, t1], the API calls that started inside it, in (start, end) order."""
    api_sorted = sorted(api_records, key=lambda r: (r.start, r.end))
    api_starts = [r.start for r in api_sorted]
    return [api_sorted[bisect.bisect_left(api_starts, t0) : bisect.bisect_right(api_starts, t1)] for t0, t1 in windows]


def iteration_gpu_records(
    windows: Sequence[tuple[int, int]],
    api_records: Sequence[ApiRecord],
    gpu_records: Sequence[GpuRecord],
) -> list[list[GpuRecord]]:
    """The GPU records each iteration launched; raises TimingError as `iteration_spans` does."""
    calls_per_window = api_calls_in_windows(windows, api_records)
    gpu_by_correlation: dict[int, list[GpuRecord]] = defaultdict(list)
    for record in gpu_records:
        gpu_by_correlation[record.correlation_id].append(record)

    per_iteration: list[list[GpuRecord]] = []
    first_work: set[tuple[str, int, int, int, int]] | None = None
    for index, (t0, t1) in enumerate(windows):
        if t1 < t0:
            raise TimingError(f"iteration {index} has a window that ends before it starts ({t0} > {t1})")
        correlation_ids = {call.correlation_id for call in calls_per_window[index]}
        records = [g for cid in sorted(correlation_ids) for g in gpu_by_correlation.get(cid, ())]
        if not records:
            raise TimingError(f"iteration {index} launched no GPU work")
        work = {g.work for g in records}
        if first_work is None:
            first_work = work
        elif work != first_work:
            raise TimingError(
                f"iteration {index} launched different GPU work than iteration 0: "
                + _describe_difference({_signature(w) for w in first_work}, {_signature(w) for w in work})
            )
        per_iteration.append(records)
    return per_iteration


def iteration_spans(
    windows: Sequence[tuple[int, int]],
    api_records: Sequence[ApiRecord],
    gpu_records: Sequence[GpuRecord],
) -> list[float]:
    """Per-iteration span in ms: last GPU end minus first GPU start of the work the
    iteration's host window launched.

    Raises TimingError when an iteration launched no GPU work or when the set of
    GPU-work signatures (`name_copykind_bytes_value_kind`) differs between iterations.
    """
    return [_span_ms(records) for records in iteration_gpu_records(windows, api_records, gpu_records)]


def _span_ms(records: Sequence[GpuRecord]) -> float:
    return (max(g.end for g in records) - min(g.start for g in records)) / NS_PER_MS


def _covered_ns(records: Sequence[GpuRecord]) -> int:
    """Nanoseconds in which at least one of `records` ran (overlaps count once)."""
    covered, reached = 0, None
    for record in sorted(records, key=lambda r: r.start):
        if reached is None or record.start >= reached:
            covered += record.end - record.start
            reached = record.end
        elif record.end > reached:
            covered += record.end - reached
            reached = record.end
    return covered


def iteration_busy(
    windows: Sequence[tuple[int, int]],
    api_records: Sequence[ApiRecord],
    gpu_records: Sequence[GpuRecord],
) -> list[float]:
    """Per-iteration GPU-busy time in ms: how much of the span at least one of the call's GPU
    records was running. The rest of the span is idle time between them (host work between
    launches, launch latency, a host sync): a span far above its busy time is host-bound, and
    moves with the host. Not part of the contest's protocol; recorded beside it."""
    return [
        _covered_ns(records) / NS_PER_MS for records in iteration_gpu_records(windows, api_records, gpu_records)
    ]


@dataclass(frozen=True)
class SpanSummary:
    median_ms: float
    min_ms: float
    max_ms: float
    count: int


def summarize_spans(spans_ms: Sequence[float]) -> SpanSummary:
    """Median (the reported latency, as FlashInfer-Bench main), min and max of the spans."""
    if not spans_ms:
        raise TimingError("no spans to summarize")
    return SpanSummary(
        median_ms=statistics.median(spans_ms),
        min_ms=min(spans_ms),
        max_ms=max(spans_ms),
        count=len(spans_ms),
    )
