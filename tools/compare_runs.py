"""Compare two runs of the same workloads: the runner's repeatability check.

    uv run tools/compare_runs.py results/checks/RUN1.json results/checks/RUN2.json [--tolerance 5] [--min-ms 0.05]

For every (track, workload, side) timed in both runs it prints both median latencies, their
relative difference, each run's spread over trials ((max - min) / median), the share of the span
in which the GPU was busy and the change of that busy time between the runs (runs that recorded
it: a low share means host time, and a span that moves while its busy time stays put moved on the
host). The last line also gives the largest busy-time change of all rows. Rows whose
latency is below --min-ms in both runs are shown but not judged (the issue's bar applies to
workloads above 50 us). Exit 1 if any judged row differs by more than --tolerance percent, 2 if
the files cannot be read or share no timed row, 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from hopperbench.results import ResultsFile, SideResult, read_results


@dataclass(frozen=True)
class Comparison:
    track: str
    index: int
    uuid: str
    side: str
    first_ms: float
    second_ms: float
    first_spread: float
    second_spread: float
    judged: bool
    # busy_ms / latency_ms of each run; None where the run predates the busy time.
    first_busy: float | None = None
    second_busy: float | None = None
    # (second busy_ms - first busy_ms) / first busy_ms; None unless both runs recorded it.
    busy_change: float | None = None

    @property
    def change(self) -> float:
        """(second - first) / first."""
        return (self.second_ms - self.first_ms) / self.first_ms


def _spread(result: SideResult) -> float:
    assert result.latency_ms is not None
    if result.min_ms is None or result.max_ms is None:
        return 0.0
    return (result.max_ms - result.min_ms) / result.latency_ms


def _busy_share(result: SideResult) -> float | None:
    if result.busy_ms is None or not result.latency_ms:
        return None
    return result.busy_ms / result.latency_ms


def _busy_change(a: SideResult, b: SideResult) -> float | None:
    if not a.busy_ms or b.busy_ms is None:
        return None
    return (b.busy_ms - a.busy_ms) / a.busy_ms


def compare(first: ResultsFile, second: ResultsFile, min_ms: float) -> list[Comparison]:
    """Rows timed in both runs, in the first run's order."""
    others = {(r.track, r.uuid): r for r in second.rows}
    out = []
    for row in first.rows:
        other = others.get((row.track, row.uuid))
        if other is None:
            continue
        for side, a in row.sides.items():
            b = other.sides.get(side)
            if b is None or not (a.timed and b.timed):
                continue
            assert a.latency_ms is not None and b.latency_ms is not None
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
                    judged=max(a.latency_ms, b.latency_ms) >= min_ms,
                    first_busy=_busy_share(a),
                    second_busy=_busy_share(b),
                    busy_change=_busy_change(a, b),
                )
            )
    return out


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def format_table(rows: Sequence[Comparison], tolerance: float) -> str:
    lines = [f"{'track':14} {'#':>3} {'side':18} {'run 1 ms':>10} {'run 2 ms':>10} {'change':>8} "
             f"{'spread 1':>8} {'spread 2':>8} {'busy 1':>6} {'busy 2':>6} {'busy chg':>8}  verdict"]  # fmt: skip
    for c in rows:
        verdict = "not judged (fast)" if not c.judged else ("ok" if abs(c.change) * 100 <= tolerance else "OVER")
        lines.append(
            f"{c.track:14} {c.index:>3} {c.side:18} {c.first_ms:>10.4g} {c.second_ms:>10.4g} {c.change:>+8.1%} "
            f"{c.first_spread:>8.1%} {c.second_spread:>8.1%} {_share(c.first_busy):>6} {_share(c.second_busy):>6}"
            f" {_signed(c.busy_change):>8}  {verdict}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--tolerance", type=float, default=5.0, help="allowed change in percent (default 5)")
    parser.add_argument("--min-ms", type=float, default=0.05, help="judge only rows at least this slow (default 0.05)")
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
    print(format_table(rows, args.tolerance))
    over = [c for c in rows if c.judged and abs(c.change) * 100 > args.tolerance]
    judged = sum(c.judged for c in rows)
    print(f"{judged - len(over)} of {judged} judged rows within {args.tolerance:g} %"
          + (f"; over: {', '.join(sorted({c.side for c in over}))}" if over else ""))  # fmt: skip
    busy_changes = [abs(c.busy_change) for c in rows if c.busy_change is not None]
    if busy_changes:
        print(f"GPU-busy time of {len(busy_changes)} rows within {max(busy_changes):.1%} between the runs")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
