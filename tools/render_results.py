"""Render the canonical run into README.md's generated sections and the two published views.

    uv run tools/render_results.py            # rewrite the generated sections and the views
    uv run tools/render_results.py --check    # exit 1 if README.md or a view is not what the files say

Reads the canonical run `results/h200/latest.json` (and checks that the tidy `latest.csv` beside
it holds the same workloads and sides), and writes:

- README.md between `<!-- generated:<name>:begin -->` and `<!-- generated:<name>:end -->` for
  each name in SECTIONS: `headline` (the headline table, `hopperbench.report`), `sizes` (ours over
  the baseline and the human winner per size class), `no-state` (the same table over the run's
  rows without GDN's initial state, and their pass counts), `passes` (a pass/fail line per track),
  `environment` (GPU, commit, date, protocol; commit and date per track where the tracks were
  measured in different runs), `repeat` (per track, how far the repeat `results/h200/repeat.json`
  moved from the canonical run: `report.repeat_markdown`) and `sides` (each library side of the
  registry with its pin and what one timed call contains);
- `results/h200_vs_human_best.csv` and `results/h200_vs_libraries.csv` (results/SCHEMA.md).

Without a canonical run the sections say so and the views hold their header only; they are still
written and checked. No number in README.md is typed by hand.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from hopperbench import report
from hopperbench.paths import REPO_ROOT, RESULTS_DIR
from hopperbench.results import ResultsFile, TidyFormatError, csv_cell, read_results, read_tidy_csv, state_given

CANONICAL = Path("h200") / "latest.json"
REPEAT = Path("h200") / "repeat.json"
HUMAN_VIEW = "h200_vs_human_best.csv"
LIBRARY_VIEW = "h200_vs_libraries.csv"
SECTIONS = ("headline", "sizes", "no-state", "passes", "environment", "repeat", "sides")
NO_RUN = "No canonical run yet (`results/h200/latest.json` does not exist)."
NO_STATE_ROWS = "The canonical run has no no-state rows."
NO_REPEAT = "No repeat run yet (`results/h200/repeat.json` does not exist), or it shares no judged row."


class RenderError(Exception):
    """Something the renderer cannot work with; one line, exit code 2."""


def markers(name: str) -> tuple[str, str]:
    return f"<!-- generated:{name}:begin -->", f"<!-- generated:{name}:end -->"


def load_canonical(results_dir: Path) -> ResultsFile | None:
    """The canonical run, or None when there is none; refuses one without its tidy CSV."""
    path = results_dir / CANONICAL
    if not path.is_file():
        return None
    results = read_results(path)
    csv_path = path.with_suffix(".csv")
    if not csv_path.is_file():
        raise RenderError(f"{csv_path} is missing: the canonical run needs its CSV beside the JSON")
    try:
        lines = read_tidy_csv(csv_path)
    except TidyFormatError as e:
        raise RenderError(str(e)) from None
    in_csv = {(line["track"], line["uuid"], line["state_given"], line["side"]) for line in lines}
    in_json = {
        (r.track, r.uuid, csv_cell(state_given(r.track, r.absent_inputs)), s) for r in results.rows for s in r.sides
    }
    if in_csv != in_json:
        raise RenderError(f"{csv_path} and {path.name} differ in their (track, workload, state given, side) lines")
    return results


def load_repeat(results_dir: Path) -> ResultsFile | None:
    path = results_dir / REPEAT
    return read_results(path) if path.is_file() else None


def sections(results: ResultsFile | None, repeat: ResultsFile | None = None) -> dict[str, str]:
    """The text between each pair of markers."""
    sides = "\n".join(report.sides_table())
    if results is None:
        return {"headline": NO_RUN, "sizes": "No sizes without a canonical run.",
                "no-state": "No no-state rows without a canonical run.",
                "passes": "No pass counts without a canonical run.", "environment": "none yet.",
                "repeat": NO_REPEAT, "sides": sides}  # fmt: skip
    partial = ""
    if results.completeness is not None and results.completeness.partial:
        c = results.completeness
        partial = f"\n\n**Partial run:** {c.complete} of {c.planned} planned workloads have every side."
    return {
        "headline": "\n".join(report.headline_markdown(report.headline(results))) + partial,
        "sizes": "\n".join(report.size_markdown(results)),
        "no-state": "\n".join(report.absent_input_markdown(results)) or NO_STATE_ROWS,
        "passes": "\n".join(f"- {line}" for line in report.pass_lines(report.headline_rows(results.rows))),
        "environment": report.environment_line(results.environment, results.track_environments()),
        "repeat": "\n".join(report.repeat_markdown(results, repeat) if repeat is not None else []) or NO_REPEAT,
        "sides": sides,
    }


def views(results: ResultsFile | None) -> dict[str, str]:
    """File name under results/ -> content of each published view."""
    rows = results.rows if results is not None else []
    return {HUMAN_VIEW: report.human_best_view(rows), LIBRARY_VIEW: report.libraries_view(rows)}


def replace_sections(text: str, contents: Mapping[str, str]) -> str:
    for name, content in contents.items():
        begin, end = markers(name)
        b = text.find(begin)
        e = text.find(end, b + 1) if b >= 0 else -1
        if b < 0 or e < 0:
            raise RenderError(f"README has no {begin} ... {end} block")
        text = text[: b + len(begin)] + "\n" + content + "\n" + text[e:]
    return text


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(0o644)


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--readme", type=Path, default=REPO_ROOT / "README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md or a view is stale; write nothing")
    args = parser.parse_args(argv)
    err = out or (lambda line: print(line, file=sys.stderr))
    try:
        results = load_canonical(args.results_dir)
        current = args.readme.read_text(encoding="utf-8")
        updated = replace_sections(current, sections(results, load_repeat(args.results_dir)))
        wanted = {args.results_dir / name: text for name, text in views(results).items()}
    except (RenderError, OSError, ValueError) as e:
        err(f"render_results: error: {str(e).splitlines()[0]}")
        return 2
    stale = [args.readme] if updated != current else []
    stale += [p for p, text in wanted.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]
    if args.check:
        if stale:
            names = ", ".join(str(p) for p in stale)
            err(f"render_results: stale: {names}; run uv run tools/render_results.py")
            return 1
        return 0
    if updated != current:
        args.readme.write_text(updated, encoding="utf-8")
    for path, text in wanted.items():
        if path in stale:
            _write(path, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
