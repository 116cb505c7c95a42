"""Compare two runs of the same workloads: the repeatability check of a canonical run and its repeat.

    uv run tools/compare_runs.py results/h200/latest.json results/h200/repeat.json [--tolerance 3] [--geomean 1] [--min-ms 0.02]

For every (track, row, side) timed in both runs (`hopperbench.repeatability`, which also says what
is judged) it prints the eager span of each run with its spread over trials ((max - min) / median),
and, where both runs replayed the side from a CUDA graph, the graph span and the graph GPU-busy time
of each and their changes, whether both ran on the same GPU board, then the verdicts (a row over the
tolerance with its graph span per trial in each run). Exit 1 if a judged row or a side's mean is over, 2 if
the files cannot be read or share no timed row, 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from hopperbench.repeatability import GEOMEAN, MIN_MS, TOLERANCE, Comparison, compare, side_means
from hopperbench.report import same_gpu
from hopperbench.results import absent_inputs_label, read_results


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _trials(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]" if values else "-"


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
    parser.add_argument("--tolerance", type=float, default=TOLERANCE * 100, help="per-row change allowed, percent (3)")
    parser.add_argument("--geomean", type=float, default=GEOMEAN * 100, help="per-side mean change allowed, percent (1)")
    parser.add_argument("--min-ms", type=float, default=MIN_MS, help="judge rows whose graph span reaches this (0.02)")
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
    for track in dict.fromkeys(c.track for c in rows):
        one, two = first.track_environment(track), second.track_environment(track)
        print(f"{track}: GPU {same_gpu(one, two)} ({one.gpu_uuid or '-'} -> {two.gpu_uuid or '-'})")
    judged = [c for c in rows if c.judged]
    over = [c for c in judged if c.over(tolerance)]
    print(f"{len(judged) - len(over)} of {len(judged)} judged rows: graph span and busy time within {args.tolerance:g} %"
          + (f"; over: {', '.join(sorted({c.side for c in over}))}" if over else ""))  # fmt: skip
    for c in over:
        print(f"  over: {c.track} {c.index} {absent_inputs_label(c.absent_inputs)} {c.side}, graph span per trial (ms): "
              f"{_trials(c.first_graph_trials_ms)} -> {_trials(c.second_graph_trials_ms)}")  # fmt: skip
    means = side_means(rows)
    over_means = [m for m in means if abs(m.change) * 100 > args.geomean]
    for m in means:
        verdict = "OVER" if m in over_means else "ok"
        print(f"{m.track} {m.side}: graph span geomean change {m.change:+.2%} over {m.rows} rows ({verdict})")
    return 1 if over or over_means else 0


if __name__ == "__main__":
    sys.exit(main())
