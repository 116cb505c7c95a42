"""The environment record (hopperbench/environment.py): the host CPU part, read from /proc and sysfs
files (here fakes of them), and the tree id of the checkout that ran."""

from __future__ import annotations

from pathlib import Path

import pytest

from hopperbench.environment import (
    EnvironmentRequest,
    collect_environment,
    gpu_limits_from,
    host_cpu,
    working_tree_id,
)
from hopperbench.paths import REPO_ROOT
from hopperbench.runner import collect_environment_isolated


def test_host_cpu_reads_the_model_the_cores_and_the_governor(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Example CPU @ 2.00GHz\nflags\t: fpu\n\nprocessor\t: 1\n")
    sysfs = tmp_path / "cpu"
    for cpu in range(4):  # two cores of two threads, numbered i and i + 2
        (sysfs / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(f"{cpu % 2},{cpu % 2 + 2}\n")
    (sysfs / "cpu0" / "cpufreq").mkdir()
    (sysfs / "cpu0" / "cpufreq" / "scaling_governor").write_text("performance\n")
    assert host_cpu(range(4), cpuinfo, sysfs) == {
        "model": "Example CPU @ 2.00GHz",
        "usable_cpus": 4,
        "physical_cores": [[0, 2], [1, 3]],
        "governor": "performance",
    }
    # Unreadable files leave their fields empty rather than failing the record.
    assert host_cpu([1], tmp_path / "missing", tmp_path / "missing") == {
        "model": None,
        "usable_cpus": 1,
        "physical_cores": [[1]],
        "governor": None,
    }


def test_the_environment_record_holds_the_host_cpu(tmp_path: Path) -> None:
    record = collect_environment(EnvironmentRequest(seed=0, protocol={}, probe_gpu=False), repo_root=tmp_path)
    assert record.host_cpu is not None and record.host_cpu["usable_cpus"] >= 1
    cpus = [c for core in record.host_cpu["physical_cores"] for c in core]
    assert len(cpus) == len(set(cpus)) == record.host_cpu["usable_cpus"]  # every usable CPU in one core


def test_the_isolated_collection_leaves_no_file_in_the_checkout_it_hashes() -> None:
    """The child hashes the checkout while the request waits for it: the files they exchange must not
    be part of that tree (a log folder inside an unignored path would otherwise change it)."""
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    record = collect_environment_isolated(EnvironmentRequest(seed=0, protocol={}, probe_gpu=False), None)
    assert record.repo_tree is not None and record.repo_tree == working_tree_id(REPO_ROOT)
    assert not any("request" in line or "record" in line for line in record.repo_changes or [])


def test_the_gpu_limits_are_the_running_boards_line_of_the_query() -> None:
    query = (
        "GPU-aaaa, 00000000:18:00.0, 1980 MHz, 3201 MHz, 700.00 W, Enabled\n"
        "GPU-bbbb, 00000000:2A:00.0, 1980 MHz, 2619 MHz, 600.00 W, Enabled\n"
    )
    assert gpu_limits_from(query, "GPU-bbbb") == {
        "pci.bus_id": "00000000:2A:00.0",
        "clocks.max.sm": "1980 MHz",
        "clocks.max.memory": "2619 MHz",
        "power.limit": "600.00 W",
        "ecc.mode.current": "Enabled",
    }
    assert gpu_limits_from(query, "GPU-cccc") is None  # a UUID torch and nvidia-smi spell differently
