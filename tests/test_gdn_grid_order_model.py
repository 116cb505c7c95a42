"""kernels/gdn_prefill/probes/gdn_grid_order_model.py: the CTA dispatch model behind the chunked kernels' longest-first
grid order (CPU only)."""

from __future__ import annotations

import pytest

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT

model = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/probes/gdn_grid_order_model.py", "gdn_grid_order_model")


def test_makespan_fills_sms_breadth_first_and_pairs_run_slower() -> None:
    # Two SMs, two slots: the first two CTAs run alone, the next two pair up with them.
    assert model.makespan([4.0, 1.0], num_sms=2) == pytest.approx(4.0)
    # [4, 1, 1]: SM 0 holds 4 and its partner 1 (rate 0.5 each) -> the 1 ends at t = 2, the 4 then
    # has 3 left alone -> 5. SM 1's 1 ends at 1.
    assert model.makespan([4.0, 1.0, 1.0], num_sms=2, pair_rate=0.5) == pytest.approx(5.0)
    # A late long CTA: started only when a slot frees up.
    assert model.makespan([1.0, 1.0, 1.0, 1.0, 3.0], num_sms=2, pair_rate=0.5) == pytest.approx(5.0)


def test_longest_first_shortens_the_tail_of_a_late_long_sequence() -> None:
    lengths = [64] * 20 + [1024]  # the long one last in the list
    works = model.grid_works(lengths, longest_first=False)
    assert len(works) == 21 * model.CTAS_PER_SEQUENCE and works[-1] == 16 + model.FIXED_CHUNKS
    assert model.grid_works(lengths, longest_first=True)[0] == 16 + model.FIXED_CHUNKS
    assert model.makespan(model.grid_works(lengths, True)) < model.makespan(works)


def test_the_tool_prints_a_row_per_modelled_workload(capsys) -> None:
    assert model.main(["--min-seqs", "50"]) == 0
    out = capsys.readouterr().out
    assert "geomean gain" in out and len([line for line in out.splitlines() if line.startswith(" 8192")]) == 2
