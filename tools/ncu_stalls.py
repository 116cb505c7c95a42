"""Where a kernel's warps wait, from an ncu source page: stall reasons, opcodes and the hottest SASS lines.

    ncu --set full --import-source no -o REP python3 ...          # on the GPU host
    ncu -i REP.ncu-rep --page source --csv --print-source sass > sass.csv
    uv run tools/ncu_stalls.py sass.csv [--top 15] [--by-role]

For each kernel in the CSV (ncu writes a "Kernel Name" line, then a header, then one row per SASS
instruction): the warp-stall samples by reason (share of all samples), the samples and the executed
warp instructions by opcode, and the instructions with the most samples with their two main
reasons. This is what NOTES.md cites when it says a kernel is bound by a dependency chain, by
barriers or by memory. `--by-role` splits a warp-specialized kernel at its `USETMAXREG` lines (each
role's code starts with its own register change) and summarizes the prologue and each role apart:
which role waits on which. Exit 2, with one line on stderr, if the file cannot be read or holds no
kernel.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
STALL_PREFIX = "stall_"
NOT_ISSUED = "(Not Issued)"


class StallsError(ValueError):
    """The CSV is not an ncu source page with SASS rows."""


@dataclass
class KernelSource:
    name: str
    header: list[str] = field(default_factory=list)
    rows: list[dict[str, str]] = field(default_factory=list)

    @property
    def stall_columns(self) -> list[str]:
        return [c for c in self.header if c.startswith(STALL_PREFIX) and NOT_ISSUED not in c]


def parse(lines: Iterable[Sequence[str]]) -> list[KernelSource]:
    """The kernels of an ncu `--page source --csv` export, in file order."""
    kernels: list[KernelSource] = []
    for row in lines:
        if not row:
            continue
        if row[0] == "Kernel Name":
            kernels.append(KernelSource(name=row[1] if len(row) > 1 else "?"))
        elif kernels and row[0] == "Address":
            kernels[-1].header = list(row)
        elif kernels and kernels[-1].header and len(row) == len(kernels[-1].header):
            kernels[-1].rows.append(dict(zip(kernels[-1].header, row)))
    kernels = [k for k in kernels if k.rows]
    if not kernels:
        raise StallsError("no kernel with SASS rows (expected ncu --page source --csv --print-source sass)")
    if SAMPLES not in kernels[0].header:
        raise StallsError(f"no {SAMPLES!r} column: collect the source counters (--set full)")
    return kernels


SETMAXNREG = "USETMAXREG"


def split_by_role(kernel: KernelSource) -> list[KernelSource]:
    """The kernel's SASS rows in address order cut before every `USETMAXREG` line: the prologue, then one part
    per role (named by the kernel and the register change that starts it). One part if there is none."""
    starts = [i for i, row in enumerate(kernel.rows) if opcode(row["Source"]) == SETMAXNREG]
    if not starts:
        return [kernel]
    bounds = [0, *starts, len(kernel.rows)]
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if lo == hi:
            continue
        first = kernel.rows[lo]["Source"].strip()
        label = first if opcode(first) == SETMAXNREG else "prologue"
        parts.append(KernelSource(name=f"{kernel.name[:100]} [{label}]", header=kernel.header, rows=kernel.rows[lo:hi]))
    return parts


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers: `@P0 HMMA.16816.F32 ...` -> HMMA."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


@dataclass(frozen=True)
class Summary:
    name: str
    instructions: int  # SASS lines
    samples: float
    executed: float  # warp instructions executed
    by_reason: list[tuple[str, float]]  # (reason, share of samples), largest first
    by_opcode: list[tuple[str, float, float]]  # (opcode, share of samples, executed), most samples first
    hottest: list[tuple[str, float, list[str]]]  # (SASS line, share of samples, two main reasons)


def summarize(kernel: KernelSource, top: int) -> Summary:
    samples = sum(number(r[SAMPLES]) for r in kernel.rows) or 1.0
    reasons: Counter[str] = Counter()
    sampled: Counter[str] = Counter()
    executed: Counter[str] = Counter()
    for row in kernel.rows:
        for column in kernel.stall_columns:
            reasons[column.removeprefix(STALL_PREFIX)] += number(row[column])
        op = opcode(row["Source"])
        sampled[op] += number(row[SAMPLES])
        executed[op] += number(row.get(EXECUTED, "0"))
    hottest = []
    for row in sorted(kernel.rows, key=lambda r: -number(r[SAMPLES]))[:top]:
        main = [c for c in sorted(kernel.stall_columns, key=lambda c: -number(row[c]))[:2] if number(row[c]) > 0]
        hottest.append((row["Source"].strip(), number(row[SAMPLES]) / samples, [c.removeprefix(STALL_PREFIX) for c in main]))
    return Summary(
        name=kernel.name,
        instructions=len(kernel.rows),
        samples=samples,
        executed=sum(executed.values()),
        by_reason=[(reason, value / samples) for reason, value in reasons.most_common()],
        by_opcode=[(op, sampled[op] / samples, executed[op]) for op, _ in sampled.most_common()],
        hottest=hottest,
    )


def render(summary: Summary, width: int = 12) -> str:
    lines = [
        f"{summary.name[:150]}",
        f"  {summary.instructions} SASS lines, {summary.samples:.0f} stall samples, {summary.executed:,.0f} warp instructions executed",
        "  stall reasons: " + ", ".join(f"{r} {100 * s:.1f}%" for r, s in summary.by_reason[:8] if s > 0),
        "  by opcode (samples, executed): "
        + ", ".join(f"{op} {100 * s:.1f}% {e:,.0f}" for op, s, e in summary.by_opcode[:width]),
        "  hottest lines:",
    ]
    lines += [f"    {100 * s:5.1f}%  {line[:64]:64s}  {' / '.join(reasons)}" for line, s, reasons in summary.hottest]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path, help="ncu -i REP --page source --csv --print-source sass > this file")
    parser.add_argument("--top", type=int, default=15, help="hottest SASS lines to list per kernel")
    parser.add_argument("--by-role", action="store_true", help="summarize each setmaxnreg role of a kernel apart")
    args = parser.parse_args(argv)
    try:
        with args.csv.open(newline="") as handle:
            kernels = parse(csv.reader(handle))
    except (OSError, StallsError, csv.Error) as error:
        print(f"ncu_stalls: {args.csv}: {error}", file=sys.stderr)
        return 2
    if args.by_role:
        kernels = [part for kernel in kernels for part in split_by_role(kernel)]
    print("\n\n".join(render(summarize(kernel, args.top)) for kernel in kernels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
