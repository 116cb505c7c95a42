"""Render the committed results into README.md and per-track speedup plots.

    uv run tools/render_results.py            # rewrite README.md between the markers, write the PNGs
    uv run tools/render_results.py --check    # exit 1 if README.md is not what the CSVs say

Reads every results CSV under `results/` except `results/checks/` (and the JSON beside each, for the
environment line), writes markdown tables between `<!-- results:begin -->` and
`<!-- results:end -->` in README.md, and one per-workload speedup plot per CSV and
track beside the CSV. First a table of each track's latest complete run, then every file, newest run
first. No results table in the README is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from hopperbench.environment import EnvironmentRecord
from hopperbench.paths import REPO_ROOT, RESULTS_DIR
from hopperbench.results import (
    SpeedupSummary,
    Status,
    TrackSummary,
    WorkloadRow,
    format_axes,
    read_csv_rows,
    summarize,
)
from hopperbench.sides import canonical_side_order

BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
CHECKS_DIR = "checks"


class RenderError(Exception):
    """Something the renderer cannot work with; one line, exit code 2."""


def _environment(csv_path: Path) -> EnvironmentRecord | None:
    json_path = csv_path.with_suffix(".json")
    if not json_path.is_file():
        return None
    data = json.loads(json_path.read_text(encoding="utf-8"))
    return EnvironmentRecord.model_validate(data.get("environment", {}))


def completeness_line(csv_path: Path) -> str | None:
    """A warning line for a partial run (interrupted, or finalized from an incomplete journal)."""
    json_path = csv_path.with_suffix(".json")
    if not json_path.is_file():
        return None
    completeness = json.loads(json_path.read_text(encoding="utf-8")).get("completeness") or {}
    if not completeness.get("partial"):
        return None
    return (
        f"**Partial run:** {completeness.get('complete')} of {completeness.get('planned')} recorded workloads have "
        "every side; see `results/README.md` for what was planned."
    )


def environment_line(env: EnvironmentRecord | None) -> str:
    if env is None:
        return "_No environment record beside this CSV._"
    parts = []
    if env.gpu_name:
        gpu = env.gpu_name
        details = [f"{env.sm_count} SMs" if env.sm_count else None]
        details.append(f"L2 {env.l2_cache_bytes / 2**20:.0f} MiB" if env.l2_cache_bytes else None)
        shown = [d for d in details if d]
        parts.append(f"{gpu} ({', '.join(shown)})" if shown else gpu)
    if env.driver_version:
        parts.append(f"driver {env.driver_version}")
    if env.cuda_version:
        parts.append(f"CUDA {env.cuda_version}")
    for package in ("torch", "triton", "nvidia-cutlass-dsl", "cupti-python"):
        if env.packages.get(package):
            parts.append(f"{package} {env.packages[package]}")
    if env.repo_commit:
        parts.append(f"commit {env.repo_commit[:10]}{' (dirty)' if env.repo_dirty else ''}")
    protocol = env.protocol
    if protocol:
        counts = (protocol.get("warmup"), protocol.get("iterations"), protocol.get("trials"))
        parts.append("warmup {} / iterations {} / trials {}".format(*counts))
    if env.seed is not None:
        parts.append(f"seed {env.seed}")
    if env.empty_kernel_span_ms is not None:
        parts.append(f"empty-kernel span {env.empty_kernel_span_ms * 1000:.1f} µs")
    if env.timestamp:
        parts.append(env.timestamp)
    return "; ".join(parts) + "."


class RunFile(NamedTuple):
    """One results CSV as the renderer uses it, read once: its rows, their summary, the environment
    record and the partial-run warning (None for a complete run) of the JSON beside it."""

    path: Path
    rows: list[WorkloadRow]
    summary: dict[str, TrackSummary]
    env: EnvironmentRecord | None
    partial_line: str | None


def load_run(csv_path: Path) -> RunFile:
    rows = read_csv_rows(csv_path)
    return RunFile(csv_path, rows, summarize(rows), _environment(csv_path), completeness_line(csv_path))


def newest_first(runs: Sequence[RunFile]) -> list[RunFile]:
    """The files by their run's timestamp (environment record), newest first; files without one last,
    by name."""
    stamped = [r for r in runs if r.env is not None and r.env.timestamp]
    unstamped = sorted((r for r in runs if r.env is None or not r.env.timestamp), key=lambda r: r.path)
    return sorted(stamped, key=lambda r: (r.env.timestamp, r.path.name), reverse=True) + unstamped


def latest_table(runs_newest_first: Sequence[RunFile], results_dir: Path) -> list[str]:
    """One row per track: its newest complete run (no partial file), with that run's summary."""
    rows: list[list[str]] = []
    seen: set[str] = set()
    for run in runs_newest_first:
        if run.partial_line is not None:
            continue
        env = run.env
        for track, t in run.summary.items():
            if track in seen:
                continue
            seen.add(track)
            rows.append(
                [
                    track,
                    f"`{run.path.relative_to(results_dir).as_posix()}`",
                    (env.timestamp or "")[:10] if env else "",
                    (env.repo_commit or "")[:10] if env else "",
                    f"{t.passed.get('ours', 0)}/{t.workloads}",
                    _speedup(t.vs_human),
                    _speedup(t.vs_best_reference),
                    "–" if t.ours_over_floor is None else _speedup(t.ours_over_floor),
                ]
            )
    header = ["track", "latest complete run", "date", "commit", "ours passed", "ours vs human",
              "ours vs best reference", "ours / floor"]  # fmt: skip
    return _table(header, sorted(rows))


def _speedup(s: SpeedupSummary) -> str:
    return "–" if s.geomean is None else f"{s.geomean:.2f}× ({s.workloads})"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def summary_table(summary: dict[str, TrackSummary]) -> list[str]:
    sides = canonical_side_order({s for t in summary.values() for s in t.passed})
    header = [
        "track",
        "workloads",
        *(f"{s} passed" for s in sides),
        "ours vs human",
        "ours vs reference",
        "ours vs best reference",
        "ours / floor",
        "GPU busy: vs human",
        "GPU busy: vs best reference",
    ]
    # A run that timed candidates of ours (only when asked for) shows them against ours.
    with_candidates = any(t.candidates_vs_ours for t in summary.values())
    if with_candidates:
        header.append("candidates vs ours")
    rows = []
    for t in summary.values():
        passed = [f"{t.passed[s]}/{t.workloads}" if s in t.passed else "–" for s in sides]
        rows.append(
            [
                t.track,
                str(t.workloads),
                *passed,
                _speedup(t.vs_human),
                _speedup(t.vs_reference),
                _speedup(t.vs_best_reference),
                "–" if t.ours_over_floor is None else _speedup(t.ours_over_floor),
                _speedup(t.vs_human_busy),
                _speedup(t.vs_best_reference_busy),
            ]
        )
        if with_candidates:
            rows[-1].append(", ".join(f"{n} {_speedup(v)}" for n, v in t.candidates_vs_ours.items()) or "–")
    return _table(header, rows) + input_group_table(summary)


def input_group_table(summary: dict[str, TrackSummary]) -> list[str]:
    """The speedups per set of absent optional inputs, for tracks whose workloads differ in it."""
    rows = [
        [
            t.track, label, str(g.workloads), _speedup(g.vs_human), _speedup(g.vs_best_reference),
            _speedup(g.vs_human_busy), _speedup(g.vs_best_reference_busy),
        ]
        for t in summary.values()
        for label, g in t.by_absent_inputs.items()
    ]  # fmt: skip
    if not rows:
        return []
    header = ["track", "inputs", "workloads", "ours vs human", "ours vs best reference", "GPU busy: vs human",
              "GPU busy: vs best reference"]  # fmt: skip
    return ["", "By the optional inputs a workload passes (a missing one is None):", ""] + _table(header, rows)


def _latency(row: WorkloadRow, side: str) -> str:
    result = row.sides.get(side)
    if result is None:
        return "–"
    if result.status != Status.PASSED:
        return result.status.value
    return "passed" if result.latency_ms is None else f"{result.latency_ms:.4g}"


def _absent(absent: Sequence[str] | None) -> str:
    if absent is None:
        return "?"
    return " ".join(absent) or "–"


def workload_table(rows: Sequence[WorkloadRow]) -> list[str]:
    sides = canonical_side_order({s for r in rows for s in r.sides})
    header = [
        "#",
        "uuid",
        "axes",
        "absent inputs",
        "data",
        *(f"{s} ms" for s in sides),
        "best ref",
        "vs human",
        "vs reference",
        "vs best ref",
        "floor ms",
        "ours / floor",
        "ours TB/s",
    ]
    body = [
        [
            str(r.index),
            r.uuid[:8],
            format_axes(r.axes).replace(";", " "),
            _absent(r.absent_inputs),
            r.data_source,
            *(_latency(r, s) for s in sides),
            r.best_reference or "–",
            _x(r.speedup_vs_human),
            _x(r.speedup_vs_reference),
            _x(r.speedup_vs_best_reference),
            "–" if r.floor_ms is None else f"{r.floor_ms:.4g}",
            _x(r.ours_over_floor),
            "–" if r.ours_tb_per_s is None else f"{r.ours_tb_per_s:.2f}",
        ]
        for r in rows
    ]
    return _table(header, body)


def plot_path(csv_path: Path, track: str) -> Path:
    return csv_path.with_name(f"{csv_path.stem}_{track}_speedup.png")


def write_plot(path: Path, track: str, rows: Sequence[WorkloadRow], title_suffix: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    series = {
        "ours vs human": [r.speedup_vs_human for r in rows],
        "ours vs best reference": [r.speedup_vs_best_reference for r in rows],
    }
    positions = list(range(len(rows)))
    width = 0.4
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * len(rows) + 2), 3.6))
    for offset, (label, values) in zip((-width / 2, width / 2), series.items()):
        xs = [p + offset for p, v in zip(positions, values) if v is not None]
        ys = [v for v in values if v is not None]
        ax.bar(xs, ys, width=width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(positions, [str(r.index) for r in rows], fontsize=6)
    ax.set_xlabel("workload index")
    ax.set_ylabel("speedup (other / ours)")
    ax.set_title(f"{track}{title_suffix}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, metadata={"Software": None})
    plt.close(fig)


def render(results_dir: Path, readme_dir: Path, write_plots: bool) -> str:
    """The markdown for between the markers; writes the plots when asked."""
    # results/checks/ holds the harness's own self-checks (e.g. repeatability runs), not benchmark results.
    csvs = [p for p in results_dir.rglob("*.csv") if CHECKS_DIR not in p.relative_to(results_dir).parts]
    if not csvs:
        return "_No results committed yet._"
    runs = newest_first([load_run(p) for p in csvs])
    out: list[str] = [
        "**Latest complete run per track** (`ours` there is the `kernel.py` of that run's commit; "
        "`results/README.md` says which version):",
        "",
        *latest_table(runs, results_dir),
        "",
    ]
    for run in runs:
        env = run.env
        out += [f"### {run.path.relative_to(results_dir).as_posix()}", "", environment_line(env), ""]
        if run.partial_line is not None:
            out += [run.partial_line, ""]
        out += summary_table(run.summary) + [""]
        for track in run.summary:
            track_rows = [r for r in run.rows if r.track == track]
            png = plot_path(run.path, track)
            if write_plots:
                write_plot(png, track, track_rows, f" on {env.gpu_name}" if env and env.gpu_name else "")
            link = Path(os.path.relpath(png, readme_dir)).as_posix()
            out += [f"<details><summary>{track}: per workload</summary>", "", f"![{track} speedups]({link})", ""]
            out += workload_table(track_rows) + ["", "</details>", ""]
    return "\n".join(out).rstrip()


def replace_between_markers(text: str, content: str) -> str:
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < 0 or end < begin:
        raise RenderError(f"README has no {BEGIN} ... {END} block")
    return text[: begin + len(BEGIN)] + "\n" + content + "\n" + text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--readme", type=Path, default=REPO_ROOT / "README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md is stale; write nothing")
    args = parser.parse_args(argv)
    try:
        current = args.readme.read_text(encoding="utf-8")
        content = render(args.results_dir, args.readme.resolve().parent, write_plots=not args.check)
        updated = replace_between_markers(current, content)
    except (RenderError, OSError, ValueError) as e:
        print(f"render_results: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.check:
        if updated != current:
            print(f"render_results: {args.readme} is stale; run uv run tools/render_results.py", file=sys.stderr)
            return 1
        return 0
    if updated != current:
        args.readme.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
