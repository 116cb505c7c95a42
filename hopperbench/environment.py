"""The environment record stored with every run: hardware, software versions, commits, protocol.

Every probe is independent and tolerant: a field that cannot be read is recorded as
null, never an exception, so a missing tool can not lose a finished run's results.

`python -m hopperbench.environment REQUEST.json RECORD.json` collects the record in
its own process, so that the runner itself never holds a CUDA context or CUPTI.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from hopperbench.paths import REPO_ROOT
from hopperbench.worker_pool import SYSFS_CPU_DIR, available_cpus, physical_cores

T = TypeVar("T")

# Distributions whose versions decide what a number means.
RECORDED_PACKAGES = (
    "torch",
    "triton",
    "nvidia-cutlass-dsl",
    "cupti-python",
    "nvidia-cuda-cupti",
    "flashinfer-bench",
    "apache-tvm-ffi",
    "pydantic",
    "safetensors",
)


class SubmoduleRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    url: str | None = None
    commit: str | None = None
    # HEAD at the gitlink recorded in the superproject and the checkout clean.
    pinned: bool | None = None


class EnvironmentRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    gpu_name: str | None = None
    compute_capability: str | None = None
    sm_count: int | None = None
    l2_cache_bytes: int | None = None
    gpu_memory_bytes: int | None = None
    # Which board ran (nvidia-smi's "GPU-..." UUID) and its limits (GPU_LIMIT_FIELDS): two H200s differ
    # by a percent or two in memory bandwidth and clocks, which a repeat must be able to tell from noise.
    gpu_uuid: str | None = None
    gpu_limits: dict[str, str] | None = None
    driver_version: str | None = None
    cuda_version: str | None = None  # the CUDA torch was built with
    python_version: str | None = None
    packages: dict[str, str | None] = Field(default_factory=dict)
    repo_commit: str | None = None
    repo_dirty: bool | None = None
    # "git" when read from the checkout; "declared" when whoever copied the tree to a GPU host
    # declared its commit through HOPPERBENCH_SOURCE_COMMIT (the copy's own .git, if any, may hold
    # another HEAD: it is kept in repo_git_head).
    repo_commit_source: str | None = None
    repo_git_head: str | None = None
    # The git tree id of the files that ran (see working_tree_id): equal to `<commit>^{tree}` iff
    # they are exactly that commit's files, which `tools/verify_provenance.py` checks.
    repo_tree: str | None = None
    # `git status --porcelain` of the copy that ran (at most REPO_CHANGES_LIMIT lines): what differs
    # from the copy's HEAD, so that a tree that is not the declared commit's can be explained.
    repo_changes: list[str] | None = None
    submodules: list[SubmoduleRecord] = Field(default_factory=list)
    # Per track: the submodule guard's verdict on the human side (pinned, unpinned_allowed, unavailable: ...).
    human_guard: dict[str, str] = Field(default_factory=dict)
    # Per track: where the workloads came from (official, synthesized).
    data_sources: dict[str, list[str]] = Field(default_factory=dict)
    seed: int | None = None
    protocol: dict[str, Any] = Field(default_factory=dict)
    empty_kernel_span_ms: float | None = None
    devices: list[int] = Field(default_factory=list)
    # Per device slot (its CUDA_VISIBLE_DEVICES, or "inherited"), the CPU cores its workers were
    # pinned to; None when they were not pinned (or the record predates pinning).
    cpu_affinity: dict[str, list[int]] | None = None
    # How worker processes were started: "fork-server" (forked from a warm per-device server)
    # or "subprocess" (a fresh interpreter per job); None in records that predate the choice.
    worker_launch: str | None = None
    # The environment variables the runner set for its workers (e.g. CUTE_DSL_ARCH), as the workers
    # saw them; empty in records that predate it.
    worker_env: dict[str, str] = Field(default_factory=dict)
    hostname: str | None = None
    # The host's CPU as the run saw it (`host_cpu`): model, the CPUs the runner could use grouped by
    # physical core, the frequency governor. Host-bound sides depend on it; None in older records.
    host_cpu: dict[str, Any] | None = None
    timestamp: str | None = None


class EnvironmentRequest(BaseModel):
    """What the runner knows and the probes cannot discover."""

    model_config = ConfigDict(extra="forbid")

    seed: int
    protocol: dict[str, Any]
    data_sources: dict[str, list[str]] = Field(default_factory=dict)
    human_guard: dict[str, str] = Field(default_factory=dict)
    devices: list[int] = Field(default_factory=list)
    cpu_affinity: dict[str, list[int]] | None = None
    worker_launch: str | None = None
    worker_env: dict[str, str] = Field(default_factory=dict)
    probe_gpu: bool = True


def _safe(probe: Callable[[], T]) -> T | None:
    try:
        return probe()
    except Exception:
        return None


def _command(args: Sequence[str], cwd: Path | None = None) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=20, check=True)
    return done.stdout.strip()


def package_versions(names: Sequence[str] = RECORDED_PACKAGES) -> dict[str, str | None]:
    return {name: _safe(lambda n=name: importlib.metadata.version(n)) for name in names}


def _git(repo: Path, *args: str) -> str:
    return _command(["git", "-C", str(repo), *args])


def _submodule_urls(repo: Path) -> dict[str, str]:
    """Submodule path -> url, from .gitmodules."""
    text = _safe(lambda: _git(repo, "config", "-f", ".gitmodules", "--get-regexp", r"^submodule\..*\.(path|url)$"))
    paths: dict[str, str] = {}
    urls: dict[str, str] = {}
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        name, _, attribute = key.removeprefix("submodule.").rpartition(".")
        (paths if attribute == "path" else urls)[name] = value
    return {path: urls[name] for name, path in paths.items() if name in urls}


def submodule_records(repo: Path) -> list[SubmoduleRecord]:
    urls = _submodule_urls(repo)
    status = _safe(lambda: _git(repo, "submodule", "status")) or ""
    records = []
    for line in status.splitlines():
        if len(line) < 2:
            continue
        # "<flag><sha> <path> (<describe>)"; flag ' ' = at the gitlink, '-' = absent, '+' = elsewhere.
        flag, rest = line[0], line[1:].split()
        commit, path = rest[0], rest[1]
        clean = _safe(lambda p=path: _git(repo / p, "status", "--porcelain") == "") if flag == " " else False
        records.append(
            SubmoduleRecord(
                path=path, url=urls.get(path), commit=None if flag == "-" else commit, pinned=flag == " " and clean
            )
        )
    known = {r.path for r in records}
    records += [SubmoduleRecord(path=p, url=u) for p, u in urls.items() if p not in known]
    return records


def _gpu_fields() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "gpu_name": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "l2_cache_bytes": props.L2_cache_size,
        "gpu_memory_bytes": props.total_memory,
    }


GPU_LIMIT_FIELDS = ("pci.bus_id", "clocks.max.sm", "clocks.max.memory", "power.limit", "ecc.mode.current")


def gpu_limits_from(query: str, uuid: str) -> dict[str, str] | None:
    """GPU_LIMIT_FIELDS of the GPU `uuid` from `nvidia-smi --query-gpu=uuid,<GPU_LIMIT_FIELDS>
    --format=csv,noheader` output (one line per GPU); None when no line is that GPU's."""
    for line in query.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) == 1 + len(GPU_LIMIT_FIELDS) and cells[0] == uuid:
            return dict(zip(GPU_LIMIT_FIELDS, cells[1:], strict=True))
    return None


def _gpu_identity() -> dict[str, Any]:
    import torch

    uuid = f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    query = _command(["nvidia-smi", f"--query-gpu=uuid,{','.join(GPU_LIMIT_FIELDS)}", "--format=csv,noheader"])
    return {"gpu_uuid": uuid, "gpu_limits": gpu_limits_from(query, uuid)}


def _driver_version() -> str:
    return _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()[0]


def _empty_kernel_span_ms() -> float:
    from hopperbench.timing.cupti_timer import empty_kernel_span_ms

    return float(empty_kernel_span_ms())


def _torch_cuda_version() -> str | None:
    import torch

    return torch.version.cuda


@contextlib.contextmanager
def temporary_index(repo_root: Path) -> Iterator[Callable[..., str]]:
    """A `git` runner for `repo_root` whose index is a temporary file: the real index is never
    touched. Yields git(*args) -> stdout (stripped); a failing command raises."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}

        def git(*args: str) -> str:
            done = subprocess.run(["git", "-C", str(repo_root), *args], env=env, capture_output=True, text=True,
                                  timeout=60, check=True)  # fmt: skip
            return done.stdout.strip()

        yield git


def working_tree_id(repo_root: Path) -> str:
    """The git tree id of the working tree's files as they are now.

    HEAD's tree is read into a temporary index, then every tracked and every untracked, not ignored
    file outside the submodules is added (submodules keep HEAD's gitlinks: their checkouts are
    recorded separately). The id equals `git rev-parse <commit>^{tree}` exactly when the files are
    those of <commit>, whatever HEAD the copy's .git holds. Like `git stash create`, it writes blob
    objects into the repository's object store and changes nothing else.
    """
    with temporary_index(repo_root) as git:
        git("read-tree", "HEAD")
        gitlinks = [line.split("\t", 1)[1] for line in git("ls-files", "--stage").splitlines() if line.startswith("160000")]
        git("add", "-A", "--", ".", *(f":(exclude){path}" for path in gitlinks))
        return git("write-tree")


REPO_CHANGES_LIMIT = 50


def repo_changes(repo_root: Path) -> list[str]:
    """The first REPO_CHANGES_LIMIT lines of `git status --porcelain --untracked-files=all`."""
    # Not through _command: its strip() would eat the status column of the first line.
    done = subprocess.run(["git", "-C", str(repo_root), "status", "--porcelain", "--untracked-files=all"],
                          capture_output=True, text=True, timeout=20, check=True)  # fmt: skip
    return done.stdout.splitlines()[:REPO_CHANGES_LIMIT]


def host_cpu(
    cpus: Iterable[int] | None = None,
    cpuinfo: Path = Path("/proc/cpuinfo"),
    sysfs_cpu_dir: Path = SYSFS_CPU_DIR,
) -> dict[str, Any]:
    """The CPU model, the usable CPUs grouped by physical core (SMT siblings together) and the
    frequency governor of the first of them; a field that cannot be read is None."""
    usable = sorted(available_cpus() if cpus is None else set(cpus))

    def model() -> str | None:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
        return None

    governor = None
    if usable:
        governor = _safe(lambda: (sysfs_cpu_dir / f"cpu{usable[0]}" / "cpufreq" / "scaling_governor").read_text().strip())
    return {
        "model": _safe(model),
        "usable_cpus": len(usable),
        "physical_cores": physical_cores(usable, sysfs_cpu_dir),
        "governor": governor,
    }


def _repo_state(repo_root: Path) -> dict[str, Any]:
    head = _safe(lambda: _git(repo_root, "rev-parse", "HEAD"))
    tree = _safe(lambda: working_tree_id(repo_root)) if head is not None else None
    changes = _safe(lambda: repo_changes(repo_root)) if head is not None else None
    declared = os.environ.get("HOPPERBENCH_SOURCE_COMMIT")
    if declared:
        dirty_flag = os.environ.get("HOPPERBENCH_SOURCE_DIRTY")
        dirty = None if dirty_flag is None else dirty_flag.strip().lower() in {"1", "true", "yes"}
        return {"repo_commit": declared, "repo_dirty": dirty, "repo_commit_source": "declared",
                "repo_git_head": head, "repo_tree": tree, "repo_changes": changes}  # fmt: skip
    if head is not None:
        dirty = _safe(lambda: _git(repo_root, "status", "--porcelain", "--untracked-files=no") != "")
        return {"repo_commit": head, "repo_dirty": dirty, "repo_commit_source": "git", "repo_git_head": head,
                "repo_tree": tree, "repo_changes": changes}  # fmt: skip
    return {}


def source_commit(repo_root: Path = REPO_ROOT) -> str | None:
    """The commit this checkout's results are recorded under: the declared one
    (`HOPPERBENCH_SOURCE_COMMIT`, for a copy without git), else git's HEAD; None if neither."""
    return _repo_state(repo_root).get("repo_commit")


def collect_environment(request: EnvironmentRequest, repo_root: Path = REPO_ROOT) -> EnvironmentRecord:
    record = EnvironmentRecord(
        python_version=platform.python_version(),
        packages=package_versions(),
        **_repo_state(repo_root),
        submodules=_safe(lambda: submodule_records(repo_root)) or [],
        human_guard=dict(request.human_guard),
        data_sources={k: list(v) for k, v in request.data_sources.items()},
        seed=request.seed,
        protocol=dict(request.protocol),
        devices=list(request.devices),
        cpu_affinity=request.cpu_affinity,
        worker_launch=request.worker_launch,
        worker_env=dict(request.worker_env),
        hostname=_safe(socket.gethostname),
        host_cpu=_safe(host_cpu),
        timestamp=datetime.now(UTC).isoformat(timespec="seconds"),
        cuda_version=_safe(_torch_cuda_version),
    )
    if request.probe_gpu:
        record = record.model_copy(
            update={
                **(_safe(_gpu_fields) or {}),
                **(_safe(_gpu_identity) or {}),
                "driver_version": _safe(_driver_version),
                "empty_kernel_span_ms": _safe(_empty_kernel_span_ms),
            }
        )
    return record


def guard_summary(guard_results: Mapping[str, Any]) -> dict[str, str]:
    """Per track, the integrity guard's verdict on the human side as one readable string."""
    return {
        track: f"{result.human}: {result.reason}" if result.reason else str(result.human)
        for track, result in guard_results.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m hopperbench.environment REQUEST.json RECORD.json", file=sys.stderr)
        return 2
    request = EnvironmentRequest.model_validate_json(Path(args[0]).read_text(encoding="utf-8"))
    record = collect_environment(request)
    Path(args[1]).write_text(record.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
