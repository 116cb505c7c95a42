"""Launching worker processes: a fresh process per job, or a fork server's children.

Two launchers run a worker command (`python -m hopperbench.worker JOB.json RESULT.json`,
or a test's `python script.py JOB.json RESULT.json`) for one job at a time and report
how it ended as a `JobExit`:

- `SubprocessLauncher` spawns the command as a new process for every job. Every job pays
  the interpreter start, the imports of torch, triton, flashinfer_bench, ..., and its side's
  compiles and autotuning.
- `ForkServerLauncher` keeps one long-lived server process per device (this module run as
  `python -m hopperbench.worker_pool CONFIG_JSON`), started with that device's environment
  (CUDA_VISIBLE_DEVICES) and CPU cores. The server imports the heavy modules once, checks
  that doing so did not initialise CUDA, and then `os.fork()`s its children: one per job, or,
  for jobs that name a `session` (the runner names one per track and side), one per session
  that runs the session's jobs one after another, as a serving process calls a library again
  and again. A session builds and compiles its side on its first job and keeps the result for
  the rest, so the server itself never builds or compiles anything.

Isolation guarantees of the fork server, and where they differ from a fresh process:

- One side, one process. The server never runs job code: it only imports the modules named by
  its configuration when it starts, the same for every job (no side is built, no kernel
  compiled, no input made). Every child starts from that state. A session child keeps what its
  jobs leave (built sides, compiled kernels, autotuning choices, module caches, its CUDA
  context): the same side's next workload finds its library warm, as in a serving engine, while
  nothing of one side reaches another side's process. A job whose worker exits non-zero (ours
  does after an exception in the side's call or replay, which may leave a sticky CUDA error)
  ends its session; the next job of that side gets a fresh child. At most MAX_SESSIONS sessions
  live at once (the one used longest ago ends first); each job's worker empties its CUDA memory
  pool when it ends, so an idle session holds little memory.
- No CUDA in the server. CUDA cannot survive a fork; the server refuses to start (and to
  fork) if `torch.cuda.is_initialized()` is true, or if the CUDA driver library is loaded
  and a canary child cannot initialise it (a bare cuInit, as `torch.cuda.is_available()`
  does, also breaks forked children), so each child creates its own context. An optional
  import (`preload_if_fork_safe`) runs first in a forked probe child, which must leave CUDA in
  that state (and not fail, crash, or run past PROBE_TIMEOUT_S); only then does the server import
  it itself. One that fails its probe is skipped (Ready.skipped and the server's log line say
  why) and the jobs that need it import it themselves.
- A crash, an illegal address or a hang stays the job's (and its session's). The child leads
  its own process group (set by both the server and the child, so there is no window in which
  it is not); a timeout kills that whole group, compilers it spawned included. The server reports
  the job's exit status; its stdout and stderr go to the job's log file; its result is the
  result file it writes, as with a fresh process.
- Cleanup without the runner. If the runner dies, the server sees its request pipe close,
  kills the running child's group and exits. If the server dies (or is killed to stop or
  replace it), its children get SIGKILL (parent-death signal); a running job is reported as
  a crash and the next job starts a new server.
- What is shared: the environment, the working directory, the CPU affinity, the imported
  modules as they were when the server started (a preloaded module file edited during a run is
  not re-read until the next run; kernel files are not preloaded, each session builds its own
  side), and atexit handlers registered while importing (each child runs them at exit, as a
  fresh process would). Python's `random` is reseeded in each child by Python itself; the job's
  inputs are seeded explicitly anyway.
  What the server holds is frozen for Python's cyclic collector (gc.freeze) before it forks.

Both launchers start their processes pinned to a set of CPU cores (`split_cpus` gives
each device a disjoint share of whole physical cores, SMT siblings together) so that the
host-bound work of one device's jobs does not compete with another device's for the same
cores. Pinning is done on the spawning thread (Linux affinity is per thread and
inherited), so the new process is pinned from its first instruction.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Annotated, Any, Literal, NoReturn, Protocol

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

# What a worker imports, loaded once per device by the fork server. Nothing here may
# initialise CUDA (the server checks); cupti and cutlass are left to the jobs.
DEFAULT_PRELOAD = (
    "numpy",
    "torch",
    "triton",
    "safetensors.torch",
    "pydantic",
    "flashinfer_bench",
    "hopperbench.acceptance",
    "hopperbench.definitions",
    "hopperbench.results",
    "hopperbench.sides",
    "hopperbench.synth",
    "hopperbench.timing.cupti_timer",
    "hopperbench.tracks",
    "hopperbench.worker",
    "hopperbench.workloads",
)
# Heavy imports that are worth sharing only if they leave a forked child able to use CUDA.
# Each is first imported in a probe child of the server (which then tries cuInit in a
# grandchild, as `_fork_poisoned` does); only a module that passes is imported by the server.
# cutlass.cute takes ~3 s to import and every one of our kernels needs it. torch._dynamo takes
# ~3 s too and flash-linear-attention imports it (fla itself queries the device at import, so it
# cannot be preloaded): its jobs took ~10 s each in the third session's GDN run.
DEFAULT_PRELOAD_IF_FORK_SAFE = ("cutlass.cute", "torch._dynamo")

# Session children kept alive at once per server (each holds a CUDA context and its memory pool);
# a new session beyond this ends the one used longest ago. A track has at most six sides.
MAX_SESSIONS = 6
# How long a live server may take to acknowledge a fork or report a killed child.
CONTROL_TIMEOUT_S = 30.0
# How long a probe child may take (an optional import, ~3 s each) before it is killed and the
# import is left to the jobs; the bound only caps what a hang could cost a session's device time.
PROBE_TIMEOUT_S = 120.0


class WorkerPoolError(Exception):
    """The fork server could not be started or used; one line."""


class LaunchStopped(Exception):
    """The launcher was stopped (the run is being interrupted); the job has no result."""


class CpuSplitError(ValueError):
    """Fewer CPU cores than devices to give each a disjoint share."""


# ------------------------------------------------------------------------------------------
# CPU cores


SYSFS_CPU_DIR = Path("/sys/devices/system/cpu")


def parse_cpu_list(text: str) -> set[int]:
    """The CPUs of a kernel CPU list such as "0,16" or "0-3,8-11"."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def physical_cores(cpus: Iterable[int], sysfs_cpu_dir: Path = SYSFS_CPU_DIR) -> list[list[int]]:
    """`cpus` grouped by the physical core they run on (SMT siblings together, from sysfs
    `cpuN/topology/thread_siblings_list`), each group sorted, the groups in order of their lowest
    CPU; a CPU whose topology cannot be read is a core of its own."""
    wanted = set(cpus)
    groups: dict[frozenset[int], None] = {}
    for cpu in sorted(wanted):
        try:
            siblings = parse_cpu_list((sysfs_cpu_dir / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text())
        except (OSError, ValueError):
            siblings = {cpu}
        groups[frozenset((siblings & wanted) | {cpu})] = None
    seen: set[int] = set()
    cores = []
    for group in groups:  # a CPU listed in two groups (inconsistent sysfs) stays in its first
        core = sorted(group - seen)
        if core:
            cores.append(core)
            seen.update(core)
    return sorted(cores)


def split_cpus(cpus: Iterable[int], parts: int, cores: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """`parts` disjoint, contiguous, as-even-as-possible shares of the CPUs, in CPU order.

    With `cores` (`physical_cores` of the same CPUs), the shares are made of whole physical cores
    whenever there are at least `parts` of them: on an SMT host, numbering usually puts the two
    threads of a core far apart (0 and 16 of 32), so contiguous halves of the CPU numbers would
    give two devices' workers the two threads of the same cores, and one device's host-bound work
    (a Python reference, a Triton launch) would slow the other's. Contiguous shares keep a
    device's cores together (on most hosts neighbouring numbers share a socket); the first shares
    get one core more when they do not divide evenly.
    """
    ordered = sorted(set(cpus))
    if parts < 1:
        raise CpuSplitError(f"cannot split cores into {parts} shares")
    if len(ordered) < parts:
        raise CpuSplitError(f"{parts} devices but only {len(ordered)} CPU core(s) to give each its own")
    units: list[list[int]] = [[c] for c in ordered]
    if cores is not None:
        grouped = sorted(sorted(set(core) & set(ordered)) for core in cores)
        grouped = [core for core in grouped if core]
        if len(grouped) >= parts and sorted(c for core in grouped for c in core) == ordered:
            units = grouped
    size, extra = divmod(len(units), parts)
    shares, start = [], 0
    for part in range(parts):
        end = start + size + (1 if part < extra else 0)
        shares.append(sorted(c for unit in units[start:end] for c in unit))
        start = end
    return shares


def available_cpus() -> set[int]:
    """The cores this process may run on (its affinity, which respects a container's cpuset)."""
    return set(os.sched_getaffinity(0))


@contextlib.contextmanager
def _thread_affinity(cpus: Sequence[int] | None) -> Iterator[None]:
    """Pin the calling thread (only it: affinity is per thread on Linux) for the duration."""
    if cpus is None:
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def spawn_pinned(args: Sequence[str], cpus: Sequence[int] | None, **popen: Any) -> subprocess.Popen[bytes]:
    """Popen whose process inherits `cpus` as its affinity from the spawning thread."""
    with _thread_affinity(cpus):
        return subprocess.Popen(list(args), **popen)


def kill_group(pgid: int) -> None:
    if pgid <= 1:  # 0 would be our own group: never
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------------
# What the runner asks and gets back


class JobFiles(BaseModel):
    """One job: the worker reads `job`, writes `result`; its stdout and stderr go to `log`.

    Jobs with the same `session` run one after another in one long-lived child of the fork server
    (see the module docstring); without one, or with `SubprocessLauncher`, every job gets a
    process of its own."""

    model_config = ConfigDict(extra="forbid")

    job: Path
    result: Path
    log: Path
    session: str | None = None


@dataclass(frozen=True)
class JobExit:
    """How a job's process ended: its exit code (negative: killed by that signal), or a timeout."""

    returncode: int | None
    timed_out: bool
    wall_s: float
    # Set when the launcher, not the job, failed (the fork server died under it).
    launcher_failure: str | None = None


class Launcher(Protocol):
    def run(self, files: JobFiles, timeout: float) -> JobExit: ...

    def stop(self) -> None:
        """From any thread: kill the running job; run() then raises LaunchStopped, now and later."""

    def close(self) -> None: ...


class SubprocessLauncher:
    """A fresh process per job (the `--no-preload` path)."""

    def __init__(
        self, worker_command: Sequence[str], env: Mapping[str, str], cwd: Path, cpus: Sequence[int] | None
    ) -> None:
        self.worker_command = list(worker_command)
        self.env = dict(env)
        self.cwd = cwd
        self.cpus = cpus
        self._lock = threading.Lock()
        self._stopped = False
        self._live: subprocess.Popen[bytes] | None = None

    def run(self, files: JobFiles, timeout: float) -> JobExit:
        if self._stopped:
            raise LaunchStopped
        started = time.monotonic()
        with open(files.log, "wb") as log:
            process = spawn_pinned(
                [*self.worker_command, str(files.job), str(files.result)],
                self.cpus,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,  # its own process group: a timeout kills compilers it spawned too
            )
            with self._lock:
                self._live = process
            if self._stopped:  # stop() ran between the check above and the registration
                kill_group(process.pid)
            try:
                returncode = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_group(process.pid)
                process.wait()
                returncode = None
            except BaseException:
                kill_group(process.pid)
                process.wait()
                raise
            finally:
                with self._lock:
                    self._live = None
            kill_group(process.pid)  # stragglers the worker left behind
        if self._stopped:
            raise LaunchStopped
        return JobExit(returncode, returncode is None, time.monotonic() - started)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self._live is not None:
                kill_group(self._live.pid)

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------
# The fork server's protocol: JSON lines, requests on its stdin, replies on its stdout


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The worker command without its interpreter: ["-m", "module"] or ["script.py"].
    worker_argv: list[str] = Field(min_length=1)
    preload: list[str] = Field(default_factory=list)
    preload_if_fork_safe: list[str] = Field(default_factory=list)


class Ready(BaseModel):
    kind: Literal["ready"] = "ready"
    pid: int
    preloaded: list[str]
    failed: dict[str, str]  # module -> one-line error
    # Optional module (preload_if_fork_safe) -> why the server left it to the jobs.
    skipped: dict[str, str] = Field(default_factory=dict)
    threads: int  # OS threads of the server when it starts forking
    seconds: float


class Refused(BaseModel):
    kind: Literal["refused"] = "refused"
    reason: str


class Started(BaseModel):
    kind: Literal["started"] = "started"
    pid: int


class Exited(BaseModel):
    kind: Literal["exited"] = "exited"
    pid: int
    returncode: int


Reply = Annotated[Ready | Refused | Started | Exited, Field(discriminator="kind")]
_REPLY = TypeAdapter(Reply)


class _LineReader:
    """Lines from a file descriptor, with a timeout and without Python's buffered readers."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""
        self.eof = False

    def fill(self, timeout: float | None) -> bool:
        """Read what is available within `timeout`; False if nothing arrived."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        chunk = os.read(self.fd, 1 << 16)
        if chunk:
            self.buffer += chunk
        else:
            self.eof = True
        return True

    def line(self, timeout: float | None) -> bytes | None:
        """The next line; None on timeout; EOFError when the other end closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            if self.eof:
                raise EOFError
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            self.fill(remaining)
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line


def _send(stream: IO[bytes], message: BaseModel) -> None:
    stream.write(message.model_dump_json().encode() + b"\n")
    stream.flush()


# ------------------------------------------------------------------------------------------
# The runner's side of a fork server


class ForkServerLauncher:
    """A fork server for one device, started on the first job and again after it died."""

    def __init__(
        self,
        worker_command: Sequence[str],
        preload: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        cpus: Sequence[int] | None,
        log_path: Path,
        startup_timeout: float,
        preload_if_fork_safe: Sequence[str] = (),
    ) -> None:
        """`startup_timeout` covers the imports."""
        if len(worker_command) < 2:
            raise WorkerPoolError(f"worker command {list(worker_command)} has no module or script to fork")
        self.interpreter = worker_command[0]
        self.config = ServerConfig(
            worker_argv=list(worker_command[1:]),
            preload=list(preload),
            preload_if_fork_safe=list(preload_if_fork_safe),
        )
        self.env = dict(env)
        self.cwd = cwd
        self.cpus = cpus
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.ready: Ready | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._replies: _LineReader | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self._live_pid: int | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def _start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            process = spawn_pinned(
                [self.interpreter, "-m", __name__, self.config.model_dump_json()],
                self.cpus,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,  # no terminal signals: the runner decides when it ends
            )
        assert process.stdout is not None
        with self._lock:
            self._process, self._replies = process, _LineReader(process.stdout.fileno())
        if self._stopped:
            self._discard()
            raise LaunchStopped
        try:
            reply = self._read(self.startup_timeout)
        except (EOFError, ValueError):
            reply = Refused(reason="it exited")
        if reply is None:
            reply = Refused(reason=f"not ready after {self.startup_timeout:g} s")
        if not isinstance(reply, Ready):
            returncode = self._discard()
            if self._stopped:
                raise LaunchStopped
            why = reply.reason if isinstance(reply, Refused) else f"unexpected {reply.kind} reply"
            if returncode is not None and returncode > 0:
                why += f" ({describe_exit(returncode)})"
            raise WorkerPoolError(
                f"the worker fork server did not start: {why}; log {self.log_path}; --no-preload runs without it"
            )
        self.ready = reply

    def _alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _discard(self) -> int | None:
        """Kill the server, its running child with it (parent-death signal); its exit code."""
        with self._lock:
            process, self._process, self._replies = self._process, None, None
        if process is None:
            return None
        kill_group(process.pid)
        returncode = process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        return returncode

    def _read(self, timeout: float) -> Ready | Refused | Started | Exited | None:
        assert self._replies is not None
        line = self._replies.line(timeout)
        return None if line is None else _REPLY.validate_json(line)

    # -- one job ---------------------------------------------------------------------------

    def run(self, files: JobFiles, timeout: float) -> JobExit:
        if self._stopped:
            raise LaunchStopped
        if not self._alive():
            self._discard()
            self._start()
        assert self._process is not None and self._process.stdin is not None
        started = time.monotonic()

        def lost(why: str) -> JobExit:
            self._discard()
            if self._stopped:
                raise LaunchStopped
            return JobExit(None, False, time.monotonic() - started, launcher_failure=f"worker fork server {why}")

        try:
            _send(self._process.stdin, files)
            reply = self._read(CONTROL_TIMEOUT_S)
        except (EOFError, OSError, ValueError):
            return lost("exited before starting the job")
        if not isinstance(reply, Started):
            return lost("did not start the job")
        pid = reply.pid
        with self._lock:
            self._live_pid = pid
        if self._stopped:
            kill_group(pid)
        try:
            reply = self._read(timeout)
            if reply is None:
                kill_group(pid)
                try:
                    after_kill = self._read(CONTROL_TIMEOUT_S)
                except (EOFError, ValueError):
                    after_kill = None
                if after_kill is None:  # the server is stuck or gone: replace it
                    self._discard()
        except (EOFError, ValueError):
            kill_group(pid)
            return lost("died while the job ran")
        finally:
            with self._lock:
                self._live_pid = None
        if self._stopped:
            raise LaunchStopped
        wall = time.monotonic() - started
        if reply is None:
            return JobExit(None, True, wall)
        if not isinstance(reply, Exited):
            return lost(f"sent a {reply.kind} reply instead of the job's exit")
        return JobExit(reply.returncode, False, wall)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            live, process = self._live_pid, self._process
        if live is not None:
            kill_group(live)
        if process is not None:
            kill_group(process.pid)  # the reading thread sees the pipe close

    def close(self) -> None:
        process = self._process
        if process is None:
            return
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()  # end of requests: the server exits
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._discard()


def describe_exit(returncode: int) -> str:
    """A process's exit status in words (a negative code is the signal that killed it)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


# ------------------------------------------------------------------------------------------
# The fork server itself: `python -m hopperbench.worker_pool CONFIG_JSON`


class _RunnerGone(Exception):
    """The request pipe closed: the runner ended or died."""


def _os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def cuda_driver_mapped(maps: str) -> bool:
    """Whether a /proc/<pid>/maps text shows the CUDA driver library (not the runtime, libcudart)."""
    return any(line.rsplit("/", 1)[-1].startswith("libcuda.so") for line in maps.splitlines())


def _fork_poisoned() -> str | None:
    """Why a forked child could not use CUDA, or None.

    torch.cuda.is_initialized() misses a bare driver initialisation (cuInit, which
    torch.cuda.is_available() or device_count() perform), and that too breaks CUDA in forked
    children. Without the driver library mapped, cuInit cannot have run; with it mapped, a
    canary child tries cuInit itself.
    """
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    if not cuda_driver_mapped(maps):
        return None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        result = -1
        with contextlib.suppress(BaseException):
            import ctypes

            result = ctypes.CDLL("libcuda.so.1").cuInit(0)
        os.write(write_end, str(result).encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as pipe:
        returned = pipe.read().decode() or "nothing"
    if returned == "0":
        return None
    return f"the CUDA driver was initialised here, so a forked child cannot (cuInit returned {returned})"


def _one_line(error: BaseException) -> str:
    first = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first}".rstrip(": ")


def _preload(modules: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    loaded, failed = [], {}
    for name in modules:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception as e:  # the job that needs it will fail the same way, with its own log
            traceback.print_exc()
            failed[name] = _one_line(e)
    return loaded, failed


def _wait_exited(pid: int, timeout: float) -> int | None:
    """The child's exit code (negative: its signal), or None if it is still running after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)  # only while the server starts: a polling wait costs nothing that matters


_PROBE_CLEAN, _PROBE_UNSAFE = b"+", b"-"


def _probe_in_child(
    step: Callable[[], object], doing: str, failing: str, timeout: float = PROBE_TIMEOUT_S
) -> str | None:
    """Why doing `step` in the server would break CUDA in forked children, or None if it would not.

    The step runs in a forked probe child, so a step that initialises CUDA (or crashes, or hangs)
    never reaches the server itself. The child then checks what the server checks before it
    forks: torch's CUDA state and, with the driver library mapped, a cuInit in a canary
    grandchild. `doing` and `failing` word the reasons ("importing it initialised CUDA",
    "import failed: ModuleNotFoundError: ...").
    """
    read_end, write_end = os.pipe()
    server_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            with contextlib.suppress(OSError):
                os.setpgid(0, 0)  # its own group: a timeout kills whatever it spawned too
            _die_with_parent(server_pid)
            try:
                step()
                if _cuda_initialized():
                    verdict = _PROBE_UNSAFE + f"{doing} initialised CUDA".encode()
                else:
                    poisoned = _fork_poisoned()
                    verdict = _PROBE_CLEAN if poisoned is None else _PROBE_UNSAFE + poisoned.encode()
            except BaseException as e:
                traceback.print_exc()  # the server's log says where it failed
                verdict = _PROBE_UNSAFE + f"{failing}: {_one_line(e)}".encode()
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os.write(write_end, verdict)
        finally:
            os._exit(0)
    os.close(write_end)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # also done by the child: whichever runs first, no window
    returncode = _wait_exited(pid, timeout)
    if returncode is None:
        kill_group(pid)
        os.waitpid(pid, 0)
    kill_group(pid)  # stragglers the step left behind
    # The verdict is one short write, already in the pipe once the child has exited; a straggler
    # that inherited the write end must not make this read wait.
    ready, _, _ = select.select([read_end], [], [], 0)
    verdict = os.read(read_end, 1 << 16) if ready else b""
    os.close(read_end)
    if returncode is None:
        return f"the probe was still running after {timeout:g} s (killed)"
    if verdict.startswith(_PROBE_CLEAN):
        return None
    if verdict.startswith(_PROBE_UNSAFE):
        return verdict[1:].decode(errors="replace")
    return f"the probe child died ({describe_exit(returncode)})"


def _probe_fork_safety(module: str) -> str | None:
    """Why importing `module` here would break CUDA in forked children, or None if it would not."""
    return _probe_in_child(lambda: importlib.import_module(module), "importing it", "import failed")


def _preload_if_fork_safe(modules: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    loaded, skipped = [], {}
    for name in modules:
        why = _probe_fork_safety(name)
        if why is None:
            importlib.import_module(name)
            loaded.append(name)
        else:
            skipped[name] = why
    return loaded, skipped


def _exit_code(code: object) -> int:
    """What the interpreter would exit with for `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_worker(worker_argv: Sequence[str], args: Sequence[str]) -> int:
    """The worker command, as `python <worker_argv> <args>` would run it, in this process."""
    if worker_argv[0] == "-m":
        module_name = worker_argv[1]
        sys.argv = [module_name, *worker_argv[2:], *args]
        module = importlib.import_module(module_name)
        entry = getattr(module, "main", None)
        if callable(entry):
            return _exit_code(entry(sys.argv[1:]))
        runpy.run_module(module_name, run_name="__main__", alter_sys=True)
        return 0
    sys.argv = [*worker_argv, *args]
    sys.path.insert(0, str(Path(worker_argv[0]).resolve().parent))  # as `python script.py` sets it
    runpy.run_path(worker_argv[0], run_name="__main__")
    return 0


def _die_with_parent(server_pid: int) -> None:
    """SIGKILL this child when the server dies (the runner stops or replaces a server by killing it)."""
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != server_pid:  # the server died before the signal was armed
        os._exit(1)


def _become_child(server_pid: int, server_fds: Sequence[int]) -> None:
    """A forked child's first steps: its own process group, dies with the server, none of its pipes."""
    os.setpgid(0, 0)
    _die_with_parent(server_pid)
    for fd in server_fds:
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def _run_job(config: ServerConfig, files: JobFiles) -> int:
    """One job in this process, its stdout and stderr in its log; the worker's exit code."""
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    log = os.open(files.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    try:
        return _run_worker(config.worker_argv, [str(files.job), str(files.result)])
    except SystemExit as e:
        return _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()


def _child(config: ServerConfig, files: JobFiles, server_pid: int, server_fds: Sequence[int]) -> NoReturn:
    """The forked child of one job: run it, never return."""
    code = 1
    try:
        _become_child(server_pid, server_fds)
        code = _run_job(config, files)
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()  # as a fresh interpreter would at exit
    finally:
        os._exit(code)


def _session_child(
    config: ServerConfig, files: JobFiles, server_pid: int, server_fds: Sequence[int], jobs_fd: int, done_fd: int
) -> NoReturn:
    """The forked child of a session: run its first job, then each job the server passes on
    `jobs_fd`, answering each with its exit code on `done_fd`. A job whose worker exits non-zero
    ends the session (its process may hold a broken CUDA context): the child exits with that code
    instead of answering. End of `jobs_fd`: the session is closed."""
    code = 1
    try:
        _become_child(server_pid, server_fds)
        jobs = _LineReader(jobs_fd)
        while True:
            code = _run_job(config, files)
            if code != 0:
                break
            os.write(done_fd, b"0\n")
            try:
                line = jobs.line(None)
            except EOFError:
                break
            assert line is not None
            files = JobFiles.model_validate_json(line)
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
    finally:
        os._exit(code)


def _wait_for_child(pid: int, requests: _LineReader, done: _LineReader | None = None) -> tuple[int, bool]:
    """(exit code, whether the child exited) of the child's job: a session child answers on `done`
    and lives on; any child may exit (negative code: its signal). Kills it and raises _RunnerGone if
    the runner goes."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None  # no pidfd (old kernel): poll
    try:
        while True:
            if done is not None and b"\n" in done.buffer:
                answer = done.line(0)
                assert answer is not None
                return int(answer), False
            watched = [requests.fd, *([] if pidfd is None else [pidfd])]
            if done is not None and not done.eof:
                watched.append(done.fd)
            ready, _, _ = select.select(watched, [], [], 0.05 if pidfd is None else None)
            if requests.fd in ready:
                requests.fill(0)
                if requests.eof:
                    kill_group(pid)
                    os.waitpid(pid, 0)
                    raise _RunnerGone
            if done is not None and done.fd in ready:
                done.fill(0)
                continue  # an answer comes before the exit check: a finished job is not a dead child
            exited, status = os.waitpid(pid, os.WNOHANG)
            if exited:
                return os.waitstatus_to_exitcode(status), True
    finally:
        if pidfd is not None:
            os.close(pidfd)


@dataclass
class _Session:
    """A session child as the server sees it: where to send its next job, where it answers."""

    pid: int
    jobs: IO[bytes]
    done: _LineReader
    last_used: float

    def fds(self) -> list[int]:
        return [self.jobs.fileno(), self.done.fd]

    def close(self) -> None:
        """Kill the child and forget it."""
        kill_group(self.pid)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            self.jobs.close()
        with contextlib.suppress(OSError):
            os.close(self.done.fd)


def _server_fds(server_fds: Sequence[int], sessions: Mapping[str, _Session]) -> list[int]:
    """Every descriptor of the server's that a new child must close: its own pipes and its sessions'."""
    return [*server_fds, *(fd for session in sessions.values() for fd in session.fds())]


def _fork_session(
    config: ServerConfig, files: JobFiles, server_fds: Sequence[int], sessions: Mapping[str, _Session]
) -> _Session:
    """A new session child, already running `files`."""
    jobs_read, jobs_write = os.pipe()
    done_read, done_write = os.pipe()
    server_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        _session_child(
            config, files, server_pid, [*_server_fds(server_fds, sessions), jobs_write, done_read], jobs_read, done_write
        )
    os.close(jobs_read)
    os.close(done_write)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)
    return _Session(pid=pid, jobs=os.fdopen(jobs_write, "wb", buffering=0), done=_LineReader(done_read),
                    last_used=time.monotonic())  # fmt: skip


def serve(config: ServerConfig) -> int:
    # The protocol gets private copies of stdin and stdout; fd 1 then points at the log, so a
    # module that prints while importing cannot corrupt the replies.
    requests_fd, replies_fd = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    replies = os.fdopen(replies_fd, "wb", buffering=0)
    requests = _LineReader(requests_fd)

    began = time.monotonic()
    loaded, failed = _preload(config.preload)
    if _cuda_initialized():
        _send(replies, Refused(reason="importing the preloaded modules initialised CUDA, which cannot survive a fork"))
        return 3
    poisoned = _fork_poisoned()
    if poisoned is not None:
        _send(replies, Refused(reason=poisoned))
        return 3
    optional, skipped = _preload_if_fork_safe(config.preload_if_fork_safe)
    loaded += optional
    seconds = time.monotonic() - began
    report = f"preloaded {len(loaded)} modules in {seconds:.1f} s"
    report += f"; could not import {', '.join(failed)}" if failed else ""
    report += "".join(f"; left {name} to the jobs: {why}" for name, why in skipped.items())
    print(f"worker fork server {os.getpid()}: {report}", file=sys.stderr, flush=True)
    ready = Ready(
        pid=os.getpid(),
        preloaded=loaded,
        failed=failed,
        skipped=skipped,
        threads=_os_threads(),
        seconds=seconds,
    )
    _send(replies, ready)

    # What the imports left is never garbage: later collections (the timer runs one
    # before each trial) skip it, and forked children do not copy its pages by touching them.
    gc.collect()
    gc.freeze()
    sessions: dict[str, _Session] = {}
    try:
        return _serve_jobs(config, requests, replies, sessions, (requests_fd, replies_fd))
    finally:
        for session in sessions.values():
            session.close()


def _serve_jobs(
    config: ServerConfig,
    requests: _LineReader,
    replies: IO[bytes],
    sessions: dict[str, _Session],
    server_fds: Sequence[int],
) -> int:
    while True:
        try:
            line = requests.line(None)
        except EOFError:
            return 0
        assert line is not None
        files = JobFiles.model_validate_json(line)
        if _cuda_initialized():
            _send(replies, Refused(reason="CUDA became initialised in the fork server"))
            return 3
        sys.stdout.flush()
        sys.stderr.flush()
        session = sessions.get(files.session) if files.session is not None else None
        if session is not None:
            try:
                session.jobs.write(files.model_dump_json().encode() + b"\n")
            except OSError:  # it died while idle: a fresh one takes the job
                del sessions[files.session]
                session.close()
                session = None
        if session is None and files.session is not None:
            while len(sessions) >= MAX_SESSIONS:
                oldest = min(sessions, key=lambda key: sessions[key].last_used)
                sessions.pop(oldest).close()
            session = sessions[files.session] = _fork_session(config, files, server_fds, sessions)
        if session is not None:
            pid = session.pid
            session.last_used = time.monotonic()
        else:
            server_pid = os.getpid()
            pid = os.fork()
            if pid == 0:
                _child(config, files, server_pid, _server_fds(server_fds, sessions))
            with contextlib.suppress(OSError):
                os.setpgid(pid, pid)  # also done by the child: whichever runs first, no window
        _send(replies, Started(pid=pid))
        try:
            returncode, exited = _wait_for_child(pid, requests, session.done if session is not None else None)
        except _RunnerGone:
            return 0
        if exited:
            kill_group(pid)  # stragglers the job left behind
            if session is not None:
                assert files.session is not None
                sessions.pop(files.session).close()
        _send(replies, Exited(pid=pid, returncode=returncode))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m hopperbench.worker_pool CONFIG_JSON", file=sys.stderr)
        return 2
    try:
        return serve(ServerConfig.model_validate(json.loads(args[0])))
    except BrokenPipeError:
        return 0  # the runner went away while we replied


if __name__ == "__main__":
    raise SystemExit(main())
