"""Where things live: the repository, our package data, downloaded data, the shared contest data."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
BENCHMARK_DATA_DIR = REPO_ROOT / "benchmark_data"
HUMAN_BEST_DIR = REPO_ROOT / "human_best"
RESULTS_DIR = REPO_ROOT / "results"
# The canonical run: every track's listed workloads (README's numbers come from it).
CANONICAL_RESULTS = RESULTS_DIR / "h200" / "latest.json"


def shared_contest_data_dir() -> Path | None:
    """The official definitions and workload lists beside the checkout (`../shared/contest_data`).

    `HOPPERBENCH_CONTEST_DATA` overrides the location. Returns None when absent: the
    tests that compare against the official files skip then.
    """
    override = os.environ.get("HOPPERBENCH_CONTEST_DATA")
    candidate = Path(override) if override else REPO_ROOT.parent / "shared" / "contest_data"
    return candidate if candidate.is_dir() else None
