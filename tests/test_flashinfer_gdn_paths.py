"""tools/flashinfer_gdn_paths.py on the CPU: the shapes it measures, the --even splits, which shapes take FlashInfer's
multi-token kernel, which shapes it reports as the side's losses, and its one-line errors. The timing and the gate
need a GPU (run on the H200)."""

from __future__ import annotations

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT
from hopperbench.workloads import load_workloads

paths = load_module_by_path(REPO_ROOT / "tools/flashinfer_gdn_paths.py", "flashinfer_gdn_paths")


def test_even_splits_are_every_pair_of_the_two_lists() -> None:
    assert paths.parse_even("1024,2048/2,4") == [(1024, 2), (1024, 4), (2048, 2), (2048, 4)]
    for bad in ("1024", "1024/x", "2/4", "8/0"):
        with pytest.raises(paths.PathsError):
            paths.parse_even(bad)


def test_the_listed_shapes_are_the_few_sequence_workloads_from_the_token_floor() -> None:
    workloads = load_workloads("gdn_prefill")
    shapes = paths.select_shapes(workloads, 341, 8, [(4096, 4)])
    listed = [s for s in shapes if s.label != "even"]
    assert listed and all(s.num_seqs <= 8 and s.total_tokens >= 341 for s in listed)
    expected = sum(1 for w in workloads if w.axes["num_seqs"] <= 8 and w.axes["total_seq_len"] >= 341)
    assert len(listed) == expected
    assert shapes[-1] == paths.Shape("even", 4096, 4, "even-4096-4")


def test_a_token_ceiling_selects_the_small_rows_and_only_one_sequence_takes_the_multi_token_kernel() -> None:
    workloads = load_workloads("gdn_prefill")
    small = paths.select_shapes(workloads, 1, 8, [], max_tokens=40)
    assert small and all(s.total_tokens <= 40 for s in small)
    assert len(small) == sum(1 for w in workloads if w.axes["total_seq_len"] <= 40)
    assert [paths.takes_mtp(s) for s in small] == [s.num_seqs == 1 for s in small]
    assert not paths.takes_mtp(paths.Shape("x", 1, 1, "u"))  # one token: not a multi-token batch


def _row(side_path: str, fused: float, cp: float, **more: float) -> object:
    times = {"fused": fused, "cp": cp, "cp_exact_max": cp, "ours": 80.0, **more}
    return paths.ShapeTimes(paths.Shape("79", 2040, 2, "u"), side_path, times)


def test_a_loss_is_the_sides_path_slower_than_the_other_beyond_the_tolerance() -> None:
    slow_pick = _row("fused", 86.0, 72.0)  # workload 79 under the mean-1024 rule
    good_pick = _row("cp", 86.0, 72.0)
    near_tie = _row("fused", 90.0, 88.0)
    assert slow_pick.side_loss == pytest.approx(86 / 72 - 1) and good_pick.side_loss == 0.0
    assert paths.side_losses([slow_pick, good_pick, near_tie], 0.03) == [slow_pick]


def test_the_loss_is_against_the_fastest_passing_path_the_side_could_take() -> None:
    mtp_faster = _row("fused", 12.0, 40.0, mtp=4.0)
    assert mtp_faster.side_loss == pytest.approx(2.0)
    # A failed path has no time: it is never the one compared against.
    failed_mtp = paths.ShapeTimes(mtp_faster.shape, "fused", {"fused": 12.0, "cp": 40.0}, ("mtp",))
    assert failed_mtp.side_loss == 0.0
    # The exact max_seqlen needs a host read: the side cannot take it, so it is not compared against.
    assert _row("cp", 86.0, 72.0, cp_exact_max=60.0).side_loss == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(capsys) -> None:
    assert paths.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["flashinfer_gdn_paths: needs a CUDA GPU"]


def test_bad_arguments_exit_2_before_any_device_work(capsys, tmp_path) -> None:
    assert paths.main(["--trials", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
    assert paths.main(["--output", str(tmp_path / "missing" / "rows.json")]) == 2
    assert "--output: no folder" in capsys.readouterr().err
    assert paths.main(["--min-tokens", "100", "--max-tokens", "40"]) == 2
    assert "below --min-tokens" in capsys.readouterr().err
