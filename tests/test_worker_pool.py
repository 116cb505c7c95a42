"""Worker launchers on the CPU: the fork server's isolation (crash, hang, exit codes, fresh state per job,
cleanup when the runner or the server goes away), the plain-subprocess launcher, and CPU pinning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hopperbench.worker_pool import (
    DEFAULT_PRELOAD,
    CpuSplitError,
    ForkServerLauncher,
    MAX_SESSIONS,
    JobFiles,
    LaunchStopped,
    ServerConfig,
    SubprocessLauncher,
    WorkerPoolError,
    cuda_driver_mapped,
    parse_cpu_list,
    physical_cores,
    spawn_pinned,
    split_cpus,
)

# A job script: JOB.json says what to do; RESULT gets what the child saw.
FAKE_JOB = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    from pathlib import Path

    job = json.loads(Path(sys.argv[1]).read_text())
    print(f"job {job['mode']} in {os.getpid()}", flush=True)
    seen = {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0),
            "probe_preloaded": "pool_probe" in sys.modules, "affinity": sorted(os.sched_getaffinity(0))}
    if job["mode"] == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if job["mode"] == "exit3":
        sys.exit(3)
    if job["mode"] == "raise":
        raise RuntimeError("the job's own exception")
    if job["mode"] == "sleep":
        child = subprocess.Popen(["sleep", "60"])
        Path(job["pid_file"]).write_text(f"{os.getpid()} {child.pid}")
        time.sleep(60)
    if job["mode"] == "probe":
        import pool_probe
        pool_probe.STATE.append(os.getpid())
        seen["probe_state"] = list(pool_probe.STATE)
    if job["mode"] == "torch":
        import torch
        seen["torch_preloaded"] = True
        seen["cuda_initialized"] = torch.cuda.is_initialized()
    Path(sys.argv[2]).write_text(json.dumps(seen))
    """
)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "job.py").write_text(FAKE_JOB)
    (tmp_path / "pool_probe.py").write_text("STATE = []\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    return tmp_path


def fork_server(
    workdir: Path,
    preload: tuple[str, ...] = ("pool_probe",),
    cpus: list[int] | None = None,
) -> ForkServerLauncher:
    return ForkServerLauncher(
        [sys.executable, str(workdir / "job.py")],
        preload,
        dict(os.environ),
        workdir,
        cpus=cpus,
        log_path=workdir / "server.log",
        startup_timeout=60,
    )


def job_files(workdir: Path, mode: str, name: str | None = None) -> JobFiles:
    name = name or mode
    job = workdir / f"{name}.job.json"
    job.write_text(json.dumps({"mode": mode, "pid_file": str(workdir / f"{name}.pids")}))
    return JobFiles(job=job, result=workdir / f"{name}.result.json", log=workdir / f"{name}.log")


def seen(files: JobFiles) -> dict:
    return json.loads(files.result.read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a killed process whose parent is gone may linger as a zombie until init reaps it
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pid: int, seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


def wait_for(path: Path, seconds: float = 10) -> str:
    deadline = time.monotonic() + seconds
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return path.read_text()


# ------------------------------------------------------------------------------------------
# CPU shares


def test_split_cpus_is_even_disjoint_contiguous_and_complete() -> None:
    assert split_cpus(range(16), 2) == [list(range(8)), list(range(8, 16))]
    shares = split_cpus([7, 3, 5, 1, 0, 2, 4, 6, 3], 3)  # unordered, with a duplicate
    assert shares == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert split_cpus([0, 2, 4, 6, 8], 2) == [[0, 2, 4], [6, 8]]
    assert split_cpus([5], 1) == [[5]]
    for cpus, parts in ((range(128), 8), (range(10), 4), (range(3), 3)):
        shares = split_cpus(cpus, parts)
        assert sorted(c for share in shares for c in share) == list(cpus)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def _fake_sysfs(root: Path, siblings: dict[int, str]) -> Path:
    for cpu, text in siblings.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(text + "\n")
    return root


def test_cpu_lists_parse_as_the_kernel_writes_them() -> None:
    assert parse_cpu_list("0,16\n") == {0, 16}
    assert parse_cpu_list("0-3,8-9") == {0, 1, 2, 3, 8, 9}
    assert parse_cpu_list("5") == {5}


def test_physical_cores_group_smt_siblings(tmp_path: Path) -> None:
    # 8 CPUs, the two threads of core i numbered i and i + 4 (the usual Linux numbering).
    sysfs = _fake_sysfs(tmp_path, {c: f"{c % 4},{c % 4 + 4}" for c in range(8)})
    assert physical_cores(range(8), sysfs) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Only the CPUs asked about (a cpuset), and a CPU without topology is a core of its own.
    assert physical_cores([0, 1, 4, 9], sysfs) == [[0, 4], [1], [9]]


def test_split_cpus_gives_each_device_whole_physical_cores(tmp_path: Path) -> None:
    sysfs = _fake_sysfs(tmp_path, {c: f"{c % 4},{c % 4 + 4}" for c in range(8)})
    cores = physical_cores(range(8), sysfs)
    # Halves of the numbers would give both devices the two threads of the same four cores.
    assert split_cpus(range(8), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_cpus(range(8), 2, cores) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert split_cpus(range(8), 3, cores) == [[0, 1, 4, 5], [2, 6], [3, 7]]
    # Fewer physical cores than devices: threads are split after all, rather than refused.
    assert split_cpus([0, 4], 2, [[0, 4]]) == [[0], [4]]
    # Cores that do not cover the CPUs (a stale topology) are ignored.
    assert split_cpus(range(4), 2, [[0, 1]]) == [[0, 1], [2, 3]]


def test_split_cpus_refuses_fewer_cores_than_devices() -> None:
    with pytest.raises(CpuSplitError, match="2 devices but only 1"):
        split_cpus([0], 2)
    with pytest.raises(CpuSplitError):
        split_cpus(range(4), 0)


def test_spawn_pinned_pins_the_process_not_the_caller() -> None:
    mine = os.sched_getaffinity(0)
    core = min(mine)
    process = spawn_pinned([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], [core],
                           stdout=subprocess.PIPE)  # fmt: skip
    out, _ = process.communicate(timeout=30)
    assert json.loads(out) == [core]
    assert os.sched_getaffinity(0) == mine


# ------------------------------------------------------------------------------------------
# The fork server


def test_fork_server_runs_jobs_in_fresh_children_of_one_warm_server(workdir: Path) -> None:
    core = max(os.sched_getaffinity(0))
    server = fork_server(workdir, cpus=[core])
    try:
        first, second = job_files(workdir, "probe", "first"), job_files(workdir, "probe", "second")
        for files in (first, second):
            outcome = server.run(files, timeout=30)
            assert (outcome.returncode, outcome.timed_out, outcome.launcher_failure) == (0, False, None)
            assert outcome.wall_s > 0
        assert server.ready is not None and server.ready.preloaded == ["pool_probe"]
        a, b = seen(first), seen(second)
        # Each job is a child of the same server, leads its own process group, and saw the
        # preloaded module untouched by the job before it.
        assert a["ppid"] == b["ppid"] == server.ready.pid
        assert a["pid"] != b["pid"] and a["pgid"] == a["pid"] and b["pgid"] == b["pid"]
        assert a["probe_preloaded"] and b["probe_preloaded"]
        assert a["probe_state"] == [a["pid"]] and b["probe_state"] == [b["pid"]]
        assert "job probe in" in first.log.read_text()
        assert a["affinity"] == b["affinity"] == [core]  # the server's pinning, inherited
    finally:
        server.close()


def test_fork_server_reports_crashes_and_exit_codes_and_keeps_serving(workdir: Path) -> None:
    server = fork_server(workdir)
    try:
        assert server.run(job_files(workdir, "segv"), timeout=30).returncode == -signal.SIGSEGV
        assert server.run(job_files(workdir, "exit3"), timeout=30).returncode == 3
        raising = job_files(workdir, "raise")
        assert server.run(raising, timeout=30).returncode == 1
        assert "RuntimeError: the job's own exception" in raising.log.read_text()
        assert server.ready is not None
        server_pid = server.ready.pid
        ok = job_files(workdir, "ok")
        assert server.run(ok, timeout=30).returncode == 0 and seen(ok)["ppid"] == server_pid
    finally:
        server.close()


def test_fork_server_timeout_kills_the_jobs_whole_group(workdir: Path) -> None:
    server = fork_server(workdir)
    try:
        files = job_files(workdir, "sleep")
        started = time.monotonic()
        outcome = server.run(files, timeout=1.0)
        assert outcome.timed_out and outcome.returncode is None
        assert time.monotonic() - started < 15
        job_pid, grandchild = map(int, (workdir / "sleep.pids").read_text().split())
        assert wait_dead(job_pid) and wait_dead(grandchild)
        assert server.run(job_files(workdir, "ok"), timeout=30).returncode == 0  # still serving
    finally:
        server.close()


def session_files(workdir: Path, mode: str, name: str, session: str = "track/side") -> JobFiles:
    return job_files(workdir, mode, name).model_copy(update={"session": session})


def test_a_session_runs_its_jobs_one_after_another_in_one_child(workdir: Path) -> None:
    server = fork_server(workdir)
    try:
        first, second = session_files(workdir, "probe", "first"), session_files(workdir, "probe", "second")
        other = session_files(workdir, "probe", "other", session="track/other")
        for files in (first, other, second):
            outcome = server.run(files, timeout=30)
            assert (outcome.returncode, outcome.timed_out, outcome.launcher_failure) == (0, False, None)
        a, b, c = seen(first), seen(second), seen(other)
        assert server.ready is not None
        assert a["pid"] == b["pid"] != c["pid"]
        assert a["ppid"] == c["ppid"] == server.ready.pid and a["pgid"] == a["pid"] and c["pgid"] == c["pid"]
        # What a job leaves in its process reaches the session's next job, never another session.
        assert b["probe_state"] == [a["pid"], a["pid"]] and c["probe_state"] == [c["pid"]]
        # Each job's output goes to its own log.
        assert first.log.read_text().count("job probe") == second.log.read_text().count("job probe") == 1
    finally:
        server.close()
    assert wait_dead(a["pid"]) and wait_dead(c["pid"])  # closing the server ends its sessions


def test_a_failed_crashed_or_killed_job_ends_its_session(workdir: Path) -> None:
    server = fork_server(workdir)
    try:
        first = session_files(workdir, "probe", "first")
        assert server.run(first, timeout=30).returncode == 0
        assert server.run(session_files(workdir, "exit3", "failing"), timeout=30).returncode == 3
        assert wait_dead(seen(first)["pid"])  # a non-zero exit ends the session with the job
        after = session_files(workdir, "probe", "after")
        assert server.run(after, timeout=30).returncode == 0
        assert seen(after)["pid"] != seen(first)["pid"] and seen(after)["probe_state"] == [seen(after)["pid"]]

        assert server.run(session_files(workdir, "segv", "segv"), timeout=30).returncode == -signal.SIGSEGV
        hang = session_files(workdir, "sleep", "sleep")
        outcome = server.run(hang, timeout=1.0)
        assert outcome.timed_out and outcome.returncode is None
        job_pid, grandchild = map(int, (workdir / "sleep.pids").read_text().split())
        assert wait_dead(job_pid) and wait_dead(grandchild)
        last = session_files(workdir, "probe", "last")
        assert server.run(last, timeout=30).returncode == 0
        assert seen(last)["pid"] not in (seen(after)["pid"], job_pid)
    finally:
        server.close()


def test_the_session_used_longest_ago_ends_when_too_many_are_open(workdir: Path) -> None:
    server = fork_server(workdir)
    try:
        pids = []
        for i in range(MAX_SESSIONS + 1):
            files = session_files(workdir, "probe", f"job{i}", session=f"track/side{i}")
            assert server.run(files, timeout=30).returncode == 0
            pids.append(seen(files)["pid"])
        assert len(set(pids)) == MAX_SESSIONS + 1
        assert wait_dead(pids[0]) and all(alive(pid) for pid in pids[1:])
    finally:
        server.close()


def test_fork_server_refuses_to_fork_once_cuda_is_initialised(workdir: Path) -> None:
    # Stands in for a preloaded module that initialises CUDA: the server checks torch.cuda.is_initialized().
    (workdir / "cuda_touching.py").write_text(
        "import sys, types\n"
        "sys.modules['torch'] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))\n"
    )
    server = fork_server(workdir, preload=("cuda_touching",))
    with pytest.raises(WorkerPoolError, match="initialised CUDA") as error:
        server.run(job_files(workdir, "ok"), timeout=30)
    assert "\n" not in str(error.value) and "--no-preload" in str(error.value)
    assert not (workdir / "ok.result.json").exists()


def test_default_preload_imports_without_initialising_cuda(workdir: Path) -> None:
    server = fork_server(workdir, preload=DEFAULT_PRELOAD)
    try:
        files = job_files(workdir, "torch")
        assert server.run(files, timeout=60).returncode == 0
        assert server.ready is not None
        assert server.ready.failed == {} and server.ready.preloaded == list(DEFAULT_PRELOAD)
        assert seen(files)["cuda_initialized"] is False
    finally:
        server.close()


def test_fork_server_kills_its_job_and_exits_when_the_runner_goes(workdir: Path) -> None:
    config = ServerConfig(worker_argv=[str(workdir / "job.py")])
    server = subprocess.Popen([sys.executable, "-m", "hopperbench.worker_pool", config.model_dump_json()],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=workdir)  # fmt: skip
    assert server.stdin is not None and server.stdout is not None
    assert json.loads(server.stdout.readline())["kind"] == "ready"
    files = job_files(workdir, "sleep")
    server.stdin.write(files.model_dump_json().encode() + b"\n")
    server.stdin.flush()
    started = json.loads(server.stdout.readline())
    assert started["kind"] == "started"
    job_pid, grandchild = map(int, wait_for(workdir / "sleep.pids").split())
    assert job_pid == started["pid"]
    server.stdin.close()  # what the runner's death looks like from the server
    assert server.wait(timeout=10) == 0
    assert wait_dead(job_pid) and wait_dead(grandchild)


def test_a_dead_server_is_the_jobs_crash_and_the_next_job_gets_a_new_server(workdir: Path) -> None:
    server = fork_server(workdir)
    try:
        files = job_files(workdir, "sleep")
        killer = threading.Thread(
            target=lambda: (wait_for(workdir / "sleep.pids"), os.kill(server.ready.pid, signal.SIGKILL))  # type: ignore[union-attr]
        )
        killer.start()
        outcome = server.run(files, timeout=30)
        killer.join()
        assert not outcome.timed_out and "died while the job ran" in (outcome.launcher_failure or "")
        job_pid, grandchild = map(int, (workdir / "sleep.pids").read_text().split())
        assert wait_dead(job_pid) and wait_dead(grandchild)
        first_server = server.ready.pid  # type: ignore[union-attr]
        ok = job_files(workdir, "ok")
        assert server.run(ok, timeout=30).returncode == 0
        assert seen(ok)["ppid"] == server.ready.pid != first_server  # type: ignore[union-attr]
    finally:
        server.close()


@pytest.mark.parametrize("kind", ["fork-server", "subprocess"])
def test_stop_kills_the_running_job_and_refuses_more(workdir: Path, kind: str) -> None:
    if kind == "fork-server":
        launcher = fork_server(workdir)
    else:
        launcher = SubprocessLauncher([sys.executable, str(workdir / "job.py")], dict(os.environ), workdir, None)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            launcher.run(job_files(workdir, "sleep"), timeout=60)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    job_pid, grandchild = map(int, wait_for(workdir / "sleep.pids").split())
    started = time.monotonic()
    launcher.stop()
    thread.join(timeout=15)
    assert not thread.is_alive() and time.monotonic() - started < 15
    assert len(outcome) == 1 and isinstance(outcome[0], LaunchStopped)
    assert wait_dead(job_pid) and wait_dead(grandchild)
    with pytest.raises(LaunchStopped):
        launcher.run(job_files(workdir, "ok"), timeout=30)
    launcher.close()


def test_subprocess_launcher_pins_and_reports_exit_codes(workdir: Path) -> None:
    core = min(os.sched_getaffinity(0))
    launcher = SubprocessLauncher([sys.executable, str(workdir / "job.py")], dict(os.environ), workdir, [core])
    assert launcher.run(job_files(workdir, "segv"), timeout=30).returncode == -signal.SIGSEGV
    assert launcher.run(job_files(workdir, "exit3"), timeout=30).returncode == 3
    ok = job_files(workdir, "ok")
    assert launcher.run(ok, timeout=30).returncode == 0
    assert seen(ok)["probe_preloaded"] is False  # nothing is preloaded in a fresh interpreter
    assert seen(ok)["affinity"] == [core]


def test_cuda_driver_detection_reads_the_library_not_the_runtime() -> None:
    runtime_only = (
        "7f00-7f10 r-xp 00000000 08:01 1 /venv/nvidia/cuda_runtime/lib/libcudart.so.12\n"
        "7f10-7f20 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1\n"
        "7f20-7f30 rw-p 00000000 00:00 0 \n"
    )
    assert not cuda_driver_mapped(runtime_only)
    assert cuda_driver_mapped(runtime_only + "7f30-7f40 r-xp 00000000 08:01 3 /usr/lib64/libcuda.so.570.86.15\n")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_forked_jobs_use_cuda_on_the_gpu(workdir: Path) -> None:
    """The real preload on a GPU host: each forked child creates its own CUDA context."""
    (workdir / "job.py").write_text(
        "import json, sys, torch\n"
        "from pathlib import Path\n"
        "x = torch.arange(4, device='cuda', dtype=torch.float32)\n"
        "Path(sys.argv[2]).write_text(json.dumps({'sum': float(x.sum()), 'pid': __import__('os').getpid()}))\n"
    )
    server = ForkServerLauncher([sys.executable, str(workdir / "job.py")], DEFAULT_PRELOAD,
                                dict(os.environ), workdir, None, workdir / "server.log", 300)  # fmt: skip
    try:
        results = []
        for name in ("a", "b"):
            files = job_files(workdir, "cuda", name)
            outcome = server.run(files, timeout=120)
            assert outcome.returncode == 0, files.log.read_text()
            results.append(seen(files))
        assert [r["sum"] for r in results] == [6.0, 6.0] and results[0]["pid"] != results[1]["pid"]
    finally:
        server.close()


def test_optional_preload_takes_a_fork_safe_module_and_skips_a_cuda_touching_one(workdir: Path) -> None:
    (workdir / "safe_optional.py").write_text("VALUE = 1\n")
    # What a module that initialises CUDA looks like to the server: torch says CUDA is up.
    (workdir / "cuda_claiming.py").write_text("import torch\ntorch.cuda.is_initialized = lambda: True\n")
    server = ForkServerLauncher(
        [sys.executable, str(workdir / "job.py")],
        ("pool_probe",),
        dict(os.environ),
        workdir,
        cpus=None,
        log_path=workdir / "server.log",
        startup_timeout=60,
        preload_if_fork_safe=("safe_optional", "cuda_claiming", "no_such_module_here"),
    )
    try:
        files = job_files(workdir, "probe")
        assert server.run(files, timeout=30).returncode == 0
        assert server.ready is not None
        assert server.ready.preloaded == ["pool_probe", "safe_optional"]
        assert set(server.ready.skipped) == {"cuda_claiming", "no_such_module_here"}
        assert server.ready.skipped["cuda_claiming"] == "importing it initialised CUDA"
        assert server.ready.skipped["no_such_module_here"].startswith("import failed")
        assert seen(files)["probe_preloaded"]
        assert "left cuda_claiming to the jobs" in (workdir / "server.log").read_text()
    finally:
        server.close()


# Probes fork: run them in a fresh single-threaded interpreter, as in the server, not in pytest's.
PROBES = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from hopperbench.worker_pool import _probe_in_child

    started = time.monotonic()
    hanging = _probe_in_child(lambda: time.sleep(60), "sleeping", "sleep failed", timeout=0.5)
    print(json.dumps({
        "hanging": hanging,
        "hanging_s": time.monotonic() - started,
        "crashing": _probe_in_child(lambda: os.kill(os.getpid(), signal.SIGKILL), "crashing", "crash failed"),
        "exiting": _probe_in_child(lambda: sys.exit(4), "exiting", "calling it failed"),
        "clean": _probe_in_child(lambda: None, "nothing", "nothing failed"),
    }))
    """
)


def test_probe_kills_a_hanging_step_and_reports_a_crashing_one() -> None:
    done = subprocess.run([sys.executable, "-c", PROBES], capture_output=True, text=True, timeout=60, check=True)
    probes = json.loads(done.stdout.splitlines()[-1])
    assert probes["hanging"] == "the probe was still running after 0.5 s (killed)" and probes["hanging_s"] < 10
    assert probes["crashing"] == "the probe child died (killed by SIGKILL)"
    assert probes["exiting"] == "calling it failed: SystemExit: 4"
    assert probes["clean"] is None
