"""kernels/moe/probes/grouped_check.py: its cases and table (CPU), the exit without a device (CPU), and on a GPU (marked
`gpu`) one short case that passes and prints its row."""

from __future__ import annotations

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT

probe = load_module_by_path(REPO_ROOT / "kernels/moe/probes/grouped_check.py", "grouped_check")


def test_the_cases_span_1025_to_32768_tokens_in_every_routing_pattern():
    large = probe.cases.LARGE_CASES
    assert len({c.name for c in large}) == len(large)
    assert min(c.num_tokens for c in large) == 1025 and max(c.num_tokens for c in large) == 32768  # kernel.MAX_TOKENS
    assert {c.pattern for c in large} == set(probe.cases.PATTERNS)
    sizes = {pattern: {c.num_tokens for c in large if c.pattern == pattern} for pattern in ("random", "eight_local")}
    timed = sizes["random"] & sizes["eight_local"]
    assert {2048, 4096, 8192, 11948, 14107} <= timed  # uniform and skewed at each size timed against MEDIUM_T
    header = probe.TABLE.header()
    assert all(column in header for column in ("grouped_us", "medium_us", "speedup", "x_floor"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the exit without a device")
def test_without_a_device_it_exits_2_with_one_line(capsys):
    assert probe.main([]) == 2
    assert capsys.readouterr().err.strip() == "grouped_check: no CUDA device"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_short_case_passes_and_prints_its_row(capsys):
    assert probe.main(["--cases", "t2048_off96", "--iters", "2", "--warmup", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("t2048_off96")]
    assert len(rows) == 1 and " ok " in rows[0]
