"""tools/time_axes.py: off-list shapes for a sweep, its argument checks and its table."""

from __future__ import annotations

import pytest

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT
from hopperbench.synth import make_inputs
from hopperbench.workloads import load_workloads

sweep = load_module_by_path(REPO_ROOT / "tools/time_axes.py", "time_axes")


def test_parse_axis_takes_a_name_and_positive_values():
    assert sweep.parse_axis("seq_len=1024, 2048") == sweep.AxisSweep("seq_len", (1024, 2048))
    for bad in ("seq_len", "=4", "seq_len=", "seq_len=a", "seq_len=0,4"):
        with pytest.raises(sweep.SweepError):
            sweep.parse_axis(bad)


def test_off_list_workload_changes_one_axis_and_gets_its_own_inputs():
    template = load_workloads("moe")[4]
    spec = sweep.off_list_workload(template, "seq_len", 37)
    assert spec.axes == {**template.axes, "seq_len": 37} and spec.scalars == template.scalars
    assert spec.uuid != template.uuid and template.axes["seq_len"] != 37  # the template is untouched
    inputs = make_inputs("moe", spec, seed=0, trial=0, device="cpu", only=("hidden_states", "routing_logits"))
    assert inputs["hidden_states"].shape == (37, 7168) and inputs["routing_logits"].shape[0] == 37
    with pytest.raises(sweep.SweepError, match="no var axis"):
        sweep.off_list_workload(template, "num_tokens", 8)


def test_rows_give_each_sides_speedup_over_the_first():
    row = sweep.ratio_row(2048, 1, [0.5, 0.4])
    cells = row.split()
    assert cells[:2] == ["2048", "1"]
    assert [float(c) for c in cells[2:]] == [500.0, 1.0, 400.0, 1.25]
    assert len(sweep.header("seq_len", ["ours", "cand"]).split()) == 4


def test_bad_arguments_exit_2_with_one_line(capsys):
    assert sweep.main(["--track", "moe", "--sides", "ours", "--axis", "seq_len=8", "--template", "99"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert sweep.main(["--track", "moe", "--sides", "ours,nobody", "--axis", "seq_len=8"]) == 2
    assert "nobody" in capsys.readouterr().err
    assert sweep.main(["--track", "moe", "--sides", "ours", "--axis", "tokens=8"]) == 2
    assert "no var axis" in capsys.readouterr().err
    assert sweep.main(["--track", "nope", "--sides", "ours", "--axis", "seq_len=8"]) == 2
