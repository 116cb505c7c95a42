"""Compare two runs of the same workloads: the repeatability check of a canonical run and its repeat.

    uv run tools/compare_runs.py results/h200/latest.json results/h200/repeat.json [--tolerance 3] [--geomean 1] [--min-ms 0.02]

For every (track, row, side) timed in both runs (a row: a workload, or its twin without an optional
input; rows are paired by `row_id`) it prints the eager span of each run with its spread over
trials ((max - min) / median), and, where both runs replayed the side from a CUDA graph, the graph
span and the graph GPU-busy time of each and their changes. Judged: the graph span and the graph
busy time of each row whose graph span is at least --min-ms (20 us) in either run must change
by at most --tolerance percent (3), and per side the geometric mean of the graph spans' ratios by at
most --geomean percent (1). Eager spans, which carry the host's launch gaps, are shown with their
spread and not judged; neither is the reference, which is timed eagerly only. Exit 1 if a judged
row or a side's mean is over, 2 if the files cannot be read or share no timed row, 0 otherwise.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from hopperbench.results import ResultsFile, SideResult, absent_inputs_label, read_results


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
    # Whether the row's graph numbers are judged (both replayed, span >= --min-ms in either run).
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

    def over(self, tolerance: float) -> bool:
        """A judged row whose graph span or graph busy time moved by more than `tolerance` (a fraction)."""
        changes = (self.graph_change, self.graph_busy_change)
        return self.judged and any(c is not None and abs(c) > tolerance for c in changes)


def _relative(first: float | None, second: float | None) -> float | None:
    if first is None or second is None or first <= 0:
        return None
    return (second - first) / first


def _spread(result: SideResult) -> float:
    assert result.latency_ms is not None
    if result.min_ms is None or result.max_ms is None:
        return 0.0
    return (result.max_ms - result.min_ms) / result.latency_ms


def compare(first: ResultsFile, second: ResultsFile, min_ms: float) -> list[Comparison]:
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
    return [
        SideMean(track, side, len(ratios), math.exp(sum(map(math.log, ratios)) / len(ratios)) - 1)
        for (track, side), ratios in groups.items()
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def format_table(rows: Sequence[Comparison], tolerance: float) -> str:
    lines = [f"{'track':14} {'#':>3} {'inputs':10} {'side':18} {'eager 1':>9} {'eager 2':>9} {'change':>7} "
             f"{'spread 1':>8} {'spread 2':>8} {'graph 1':>9} {'graph 2':>9} {'change':>7} "
             f"{'busy chg':>8}  verdict"]  # fmt: skip
    for c in rows:
        if c.first_graph_ms is None:
            verdict = "eager only (not judged)"
        elif not c.judged:
            verdict = "not judged (fast)"
        else:
            verdict = "OVER" if c.over(tolerance) else "ok"
        lines.append(
            f"{c.track:14} {c.index:>3} {absent_inputs_label(c.absent_inputs):10} {c.side:18} {c.first_ms:>9.4g} "
            f"{c.second_ms:>9.4g} {c.change:>+7.1%} {c.first_spread:>8.1%} {c.second_spread:>8.1%} "
            f"{_ms(c.first_graph_ms):>9} {_ms(c.second_graph_ms):>9} "
            f"{_signed(c.graph_change):>7} {_signed(c.graph_busy_change):>8}  {verdict}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--tolerance", type=float, default=3.0, help="per-row change allowed, percent (default 3)")
    parser.add_argument("--geomean", type=float, default=1.0, help="per-side mean change allowed, percent (default 1)")
    parser.add_argument("--min-ms", type=float, default=0.02, help="judge rows whose graph span reaches this (0.02)")
    args = parser.parse_args(argv)
    try:
        first, second = read_results(args.first), read_results(args.second)
    except (OSError, ValueError, ValidationError) as e:
        print(f"compare_runs: cannot read the results: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    rows = compare(first, second, args.min_ms)
    if not rows:
        print("compare_runs: the two runs share no timed (workload, side)", file=sys.stderr)
        return 2
    tolerance = args.tolerance / 100
    print(format_table(rows, tolerance))
    judged = [c for c in rows if c.judged]
    over = [c for c in judged if c.over(tolerance)]
    print(f"{len(judged) - len(over)} of {len(judged)} judged rows: graph span and busy time within {args.tolerance:g} %"
          + (f"; over: {', '.join(sorted({c.side for c in over}))}" if over else ""))  # fmt: skip
    means = side_means(rows)
    over_means = [m for m in means if abs(m.change) * 100 > args.geomean]
    for m in means:
        verdict = "OVER" if m in over_means else "ok"
        print(f"{m.track} {m.side}: graph span geomean change {m.change:+.2%} over {m.rows} rows ({verdict})")
    return 1 if over or over_means else 0


if __name__ == "__main__":
    sys.exit(main())
