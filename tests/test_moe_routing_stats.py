"""kernels/moe/probes/moe_routing_stats.py: row tiles and L2 bytes of the MoE streaming GEMMs from a routing."""

from __future__ import annotations

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT

stats = load_module_by_path(REPO_ROOT / "kernels/moe/probes/moe_routing_stats.py", "moe_routing_stats")


def test_tile_traffic_counts_row_tiles_and_bytes_per_item_map():
    counts = [0] * 29 + [1, 33, 64]  # 98 assignments
    by_32 = stats.tile_traffic(counts, 32)
    assert by_32.row_tiles == 1 + 2 + 2
    assert by_32.gemm1_bytes == 5 * 4096 * 7168 + 64 * 98 * 7168
    assert by_32.gemm2_bytes == 5 * 7168 * 2048 + 112 * 98 * 4096
    by_64 = stats.tile_traffic(counts, 64)
    assert by_64.row_tiles == 3 and by_64.gemm1_bytes < by_32.gemm1_bytes
    assert stats.tile_traffic([0] * 32, 16).gemm2_bytes == 0


def test_one_workload_on_the_cpu_prints_a_row_per_trial(capsys):
    assert stats.main(["--workloads", "1", "--trials", "2", "--tiles", "16,64"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and "tiles@64" in lines[0]
    for line in lines[1:]:
        index, num_tokens, _, _, active, assignments, largest, *_ = (int(v) for v in line.split()[:7])
        assert (index, num_tokens) == (1, 1)
        assert 0 <= active <= 8 and assignments == active and largest <= 1  # one token: <= 8 experts, once each


def test_bad_arguments_exit_2_with_one_line(capsys):
    assert stats.main(["--workloads", "99"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert stats.main(["--tiles", "0"]) == 2
    assert stats.main(["--workloads", "x"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(line.startswith("moe_routing_stats: ") for line in errors)
