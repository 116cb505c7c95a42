"""kernels/moe/probes/l2_partition_probe.py and kernels/moe/l2_partitions.py: the line offsets, the fast/slow threshold, the split
by a reference SM, the ranks from a split and the SM ranges (CPU, on made-up latencies of both L2 models), the argument
checks, the compile of the kernels (CPU), and on a GPU (marked `gpu`) one short probe whose two references agree and
the ranks of the device."""

from __future__ import annotations

import json

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT

probe = load_module_by_path(REPO_ROOT / "kernels/moe/probes/l2_partition_probe.py", "l2_partition_probe")
partitions = probe.partitions

FAST, SLOW = 300, 520


def test_line_offsets_are_distinct_lines_inside_the_buffer():
    offsets = [i * partitions.line_stride_words(256) for i in range(256)]
    assert len(set(o // partitions.LINE_WORDS for o in offsets)) == 256
    assert all(o % partitions.LINE_WORDS == 0 and 0 <= o < partitions.BUFFER_WORDS for o in offsets)


def test_threshold_falls_between_the_two_modes():
    rows = [[FAST + (i % 7) for i in range(64)], [SLOW - (i % 5) if i % 2 else FAST for i in range(64)]]
    assert FAST + 7 < partitions.slow_threshold(rows) < SLOW - 5


def _partitions() -> set[int]:
    return {0, 1, 4, 5, 8, 9}  # SMs of the reference's partition (by pairs, as TPCs are)


def test_split_in_a_replicating_l2():
    # The reference's partition holds a copy of every line it read: all fast there; the other half of the lines slow
    # from the other partition.
    home_far = [i % 2 == 0 for i in range(40)]
    latencies = {sm: [FAST if sm in _partitions() or not far else SLOW for far in home_far] for sm in range(12)}
    same, other = partitions.split_by_reference(latencies, 0)
    assert same == sorted(_partitions()) and other == sorted(set(range(12)) - _partitions())


def test_split_in_a_home_partition_l2():
    # No copies: each line is slow from the partition it is not homed in, so the two halves see complementary patterns.
    homed_here = [i % 3 == 0 for i in range(40)]
    latencies = {sm: [FAST if (sm in _partitions()) == here else SLOW for here in homed_here] for sm in range(12)}
    same, other = partitions.split_by_reference(latencies, 4)
    assert same == sorted(_partitions()) and other == sorted(set(range(12)) - _partitions())


def test_ranges():
    assert probe.as_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert probe.as_ranges([3]) == "3" and probe.as_ranges([]) == ""


def test_bad_arguments_are_refused():
    assert probe.main(["--lines", "4"]) == 2
    assert probe.main(["--references", "0"]) == 2


def test_ranks_from_a_split():
    assert partitions.ranks_from_split([0, 1, 4, 5], [2, 3, 6, 7], 8) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert partitions.ranks_from_split(list(range(8)), [], 8) == list(range(8))  # no split: the identity
    assert partitions.ranks_from_split([0], list(range(1, 8)), 8) == list(range(8))  # not halves
    assert partitions.ranks_from_split([0, 1, 2, 3], [4, 5, 6], 8) == list(range(8))  # an SM missing


def test_the_kernels_compile_without_a_gpu():
    assert all(callable(fn) for fn in partitions.compiled_kernels("sm_90a"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_short_probe_splits_the_sms(tmp_path, capsys):
    output = tmp_path / "map.json"
    assert probe.main(["--lines", "64", "--output", str(output)]) == 0
    found = json.loads(output.read_text())
    first = found["references"][0]
    assert found["agree"] and sorted(first["same"] + first["other"]) == list(range(found["sms"]))
    assert "reference SM 0" in capsys.readouterr().out
    device = torch.device("cuda", torch.cuda.current_device())
    ranks = partitions.partition_ranks(device)
    assert sorted(ranks) == list(range(found["sms"]))
    if len(first["other"]) >= found["sms"] // 3:  # a split: the reference's group first
        assert sorted(ranks[sm] for sm in first["same"]) == list(range(len(first["same"])))
