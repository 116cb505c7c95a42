"""How far a run's numbers move when the same command runs again: a canonical run against its repeat.

Rows are paired by `row_id` (a workload, or its twin without an optional input) and side. Judged:
the graph span and the graph busy time of each row whose graph span reaches `min_ms` in either run
must change by at most `tolerance`, and per (track, side) the geometric mean of the graph spans'
ratios by at most `geomean`. Eager spans carry the host's launch gaps: they are compared and shown
with their spread over trials, never judged; neither is the reference, which is timed eagerly only.

`tools/compare_runs.py` prints every pair; `report.repeat_markdown` is README's per-track summary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hopperbench.results import ResultsFile, SideResult, geometric_mean

TOLERANCE = 0.03  # per judged row, graph span and graph busy time
GEOMEAN = 0.01  # per (track, side), graph span
MIN_MS = 0.02  # rows faster than this in both runs are not judged


@dataclass(frozen=True)
class Comparison:
    """One (track, row, side) timed in both runs."""

    track: str
    index: int
    uuid: str
    side: str
    first_ms: float
    second_ms: float
    first_spread: float
    second_spread: float
    # Graph span and graph busy time of each run; None unless both runs replayed the side.
    first_graph_ms: float | None = None
    second_graph_ms: float | None = None
    first_graph_busy_ms: float | None = None
    second_graph_busy_ms: float | None = None
    # Each trial's graph span in each run (its median is the row's): which trial moved.
    first_graph_trials_ms: tuple[float, ...] = ()
    second_graph_trials_ms: tuple[float, ...] = ()
    # Whether the row's graph numbers are judged (both replayed, span >= min_ms in either run).
    judged: bool = False
    # The optional inputs the row's calls passed as None (a twin's withheld input among them).
    absent_inputs: tuple[str, ...] = ()

    @property
    def change(self) -> float:
        """Eager span: (second - first) / first."""
        return (self.second_ms - self.first_ms) / self.first_ms

    @property
    def graph_change(self) -> float | None:
        return _relative(self.first_graph_ms, self.second_graph_ms)

    @property
    def graph_busy_change(self) -> float | None:
        return _relative(self.first_graph_busy_ms, self.second_graph_busy_ms)

    @property
    def largest_graph_change(self) -> float:
        """The graph span's or busy time's change, whichever is larger in size (0 without either)."""
        return max((c for c in (self.graph_change, self.graph_busy_change) if c is not None), key=abs, default=0.0)

    def over(self, tolerance: float) -> bool:
        """A judged row whose graph span or graph busy time moved by more than `tolerance` (a fraction)."""
        return self.judged and abs(self.largest_graph_change) > tolerance


def _relative(first: float | None, second: float | None) -> float | None:
    if first is None or second is None or first <= 0:
        return None
    return (second - first) / first


def _spread(result: SideResult) -> float:
    assert result.latency_ms is not None
    if result.min_ms is None or result.max_ms is None:
        return 0.0
    return (result.max_ms - result.min_ms) / result.latency_ms


def compare(first: ResultsFile, second: ResultsFile, min_ms: float = MIN_MS) -> list[Comparison]:
    """Rows timed in both runs, in the first run's order."""
    others = {r.row_id: r for r in second.rows}
    out = []
    for row in first.rows:
        other = others.get(row.row_id)
        if other is None:
            continue
        for side, a in row.sides.items():
            b = other.sides.get(side)
            if b is None or not (a.timed and b.timed):
                continue
            assert a.latency_ms is not None and b.latency_ms is not None
            graph = a.graph_timed and b.graph_timed
            out.append(
                Comparison(
                    track=row.track,
                    index=row.index,
                    uuid=row.uuid,
                    side=side,
                    first_ms=a.latency_ms,
                    second_ms=b.latency_ms,
                    first_spread=_spread(a),
                    second_spread=_spread(b),
                    first_graph_ms=a.graph_ms if graph else None,
                    second_graph_ms=b.graph_ms if graph else None,
                    first_graph_busy_ms=a.graph_busy_ms if graph else None,
                    second_graph_busy_ms=b.graph_busy_ms if graph else None,
                    first_graph_trials_ms=tuple(a.per_trial_graph_ms) if graph else (),
                    second_graph_trials_ms=tuple(b.per_trial_graph_ms) if graph else (),
                    judged=graph and max(a.graph_ms or 0.0, b.graph_ms or 0.0) >= min_ms,
                    absent_inputs=row.row_id[2],
                )
            )
    return out


@dataclass(frozen=True)
class SideMean:
    """A side's geometric mean of second / first graph span over its judged rows, minus one."""

    track: str
    side: str
    rows: int
    change: float


def side_means(rows: Sequence[Comparison]) -> list[SideMean]:
    groups: dict[tuple[str, str], list[float]] = {}
    for c in rows:
        if c.judged and c.first_graph_ms and c.second_graph_ms:
            groups.setdefault((c.track, c.side), []).append(c.second_graph_ms / c.first_graph_ms)
    means = []
    for (track, side), ratios in groups.items():
        mean = geometric_mean(ratios)
        assert mean is not None  # every group holds a ratio
        means.append(SideMean(track, side, len(ratios), mean - 1))
    return means
