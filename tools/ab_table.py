"""A/B table of one runner file: each side against a base side, with the statistics a candidate's bar names.

    uv run tools/ab_table.py results/checks/RUN.json [--base ours] [--sides cand_a,cand_b]

For every workload where the base and a side were both timed, one line: both medians (the runner's latency_ms,
the median over trials of the per-trial medians), the **ratio of medians** (base / side: above 1 the side is faster),
the **paired ratios** of the trials (trial t of both sides ran the same inputs), their median and how many trials the
side was faster in. The two statistics differ where a row's trials run different inputs: the MoE workloads' trials
draw different routings whose latencies differ by up to 2x, so the ratio of medians is the ratio of one trial (the
one whose latency is the median on both sides), while the paired ratios use every trial. A bar names the one it uses.
Exit 2 if the file cannot be read, names no such side, or no row has both sides timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from hopperbench.results import ResultsFile, read_results


@dataclass(frozen=True)
class AbRow:
    track: str
    index: int
    axes: str
    side: str
    base_ms: float
    side_ms: float
    paired: tuple[float, ...]  # base / side per trial, in trial order

    @property
    def ratio_of_medians(self) -> float:
        return self.base_ms / self.side_ms

    @property
    def paired_median(self) -> float:
        return statistics.median(self.paired)

    @property
    def trials_faster(self) -> int:
        return sum(ratio > 1.0 for ratio in self.paired)


class AbTableError(ValueError):
    pass


def ab_rows(results: ResultsFile, base: str, sides: Sequence[str] | None) -> list[AbRow]:
    """Rows where `base` and a side (every other side of the file, or `sides`) were both timed, in file order."""
    present = {name for row in results.rows for name in row.sides}
    if base not in present:
        raise AbTableError(f"no side {base!r} in the file (sides: {', '.join(sorted(present))})")
    wanted = list(sides) if sides is not None else sorted(present - {base})
    missing = [name for name in wanted if name not in present]
    if missing:
        raise AbTableError(f"no side {', '.join(map(repr, missing))} in the file (sides: {', '.join(sorted(present))})")
    out = []
    for name in wanted:
        for row in results.rows:
            a, b = row.sides.get(base), row.sides.get(name)
            if a is None or b is None or not (a.timed and b.timed):
                continue
            assert a.latency_ms is not None and b.latency_ms is not None
            if len(a.per_trial_ms) != len(b.per_trial_ms):
                raise AbTableError(f"{row.track} #{row.index}: {base} and {name} timed different numbers of trials")
            out.append(
                AbRow(
                    track=row.track,
                    index=row.index,
                    # A twin shares its workload's axes: its absent inputs tell the two lines apart.
                    axes=",".join(f"{k}={v}" for k, v in row.axes.items())
                    + "".join(f" without {name}" for name in row.absent_inputs or ()),
                    side=name,
                    base_ms=a.latency_ms,
                    side_ms=b.latency_ms,
                    paired=tuple(x / y for x, y in zip(a.per_trial_ms, b.per_trial_ms)),
                )
            )
    return out


def format_table(rows: Sequence[AbRow], base: str) -> str:
    lines = [f"{'track':14} {'#':>3} {'axes':24} {'side':28} {base + ' ms':>10} {'side ms':>10} "
             f"{'ratio of medians':>16} {'paired median':>13} {'faster':>6}  paired per trial"]  # fmt: skip
    for r in rows:
        lines.append(
            f"{r.track:14} {r.index:>3} {r.axes:24} {r.side:28} {r.base_ms:>10.4g} {r.side_ms:>10.4g} "
            f"{r.ratio_of_medians:>16.3f} {r.paired_median:>13.3f} {r.trials_faster:>3}/{len(r.paired):<2}  "
            + " ".join(f"{x:.3f}" for x in r.paired)
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--base", default="ours", help="the side the others are compared with (default ours)")
    parser.add_argument("--sides", help="comma list of sides (default: every other side in the file)")
    args = parser.parse_args(argv)
    try:
        results = read_results(args.results)
        rows = ab_rows(results, args.base, args.sides.split(",") if args.sides else None)
    except (OSError, ValueError, ValidationError) as e:
        print(f"ab_table: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if not rows:
        print(f"ab_table: no workload has {args.base} and another side both timed", file=sys.stderr)
        return 2
    print(format_table(rows, args.base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
