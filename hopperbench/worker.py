"""One (side, workload): `python -m hopperbench.worker JOB.json RESULT.json`, in a process of its
own or in its side's session of the fork server (`hopperbench.worker_pool`).

The reference side computes the reference outputs of every trial and stores them in
the run's scratch folder (`<scratch>/<track>/<row>/trial<t>.safetensors`, the row named by
`WorkloadSpec.row_name`; reused when written under the same seed), then times itself. Every
other side regenerates the same inputs from (uuid, seed, trial) (a twin's withheld inputs None),
fills its output buffers with NaN, runs once,
and is checked against the stored outputs with the track's acceptance rule; it must
also leave its inputs bit-for-bit unchanged. Only a side that passes every trial is
timed: on each trial's fresh inputs, with the CUPTI cold-L2 timer; latency is the
median over trials of the per-trial medians. Before its first job, each process of a side other
than the reference makes one untimed call on the run's largest workload of the track (`warm_up`),
and once more on the largest twin before its first twin (a call that withholds an optional input);
a side with a start-up function (`Side.start_up`, idempotent) runs it before each job, untimed.
Before each trial is timed, the roofline floor of exactly its inputs is recorded beside its latency
(`per_trial_floor`). After the eager trials, every side but the reference is captured in a CUDA
graph per trial, its replay gated like the eager call, and the replays timed under the same
protocol (`graph_*` fields; a side that cannot be captured is NOT_CAPTURABLE). A library side with
a `prepare` step gets its inputs through it, untimed, once per trial (e.g. a cache stored in the
library's layout).

Whatever happens inside the side is reported as a result (RUNTIME_ERROR, FAILED,
NO_REFERENCE); a crash of the process itself is the runner's to report.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from hopperbench.floors import FloorInputError, trial_floor
from hopperbench.results import GraphStatus, SideResult, Status, TrialFloor
from hopperbench.sides import Side, SideKind, run_start_up
from hopperbench.timing.graph import NotCapturable
from hopperbench.timing.span import ActivityTrace
from hopperbench.tracks import AcceptanceRule, get_track

InputValue = Any  # torch.Tensor | int | float | None, as hopperbench.synth makes them


class WorkerJob(BaseModel):
    """Everything a worker needs; written by the runner as JSON."""

    model_config = ConfigDict(extra="forbid")

    track: str
    side: Side
    # A hopperbench.workloads.WorkloadSpec, as its JSON dump (validated again in the worker).
    workload: dict[str, Any]
    # The workload this side's process makes one untimed call on before its first job with the same
    # withheld inputs (the run's largest of the track with them; `JobRunner.warm_up`); None: no
    # warm-up (the reference side).
    warmup_workload: dict[str, Any] | None = None
    seed: int
    trials: int
    warmup: int
    # 0 = no timing: the reference side then only stores its outputs, another side only gets checked.
    iterations: int
    # Caps warmup and iterations of a slow call to about this many seconds per trial (None: no cap).
    time_budget_s: float | None = None
    scratch_dir: Path
    device: str = "cuda"


class ReferenceMissing(RuntimeError):
    """The stored reference output of a trial is absent (its worker failed or never ran)."""


@dataclass(frozen=True)
class WorkerDeps:
    """The worker's collaborators, replaceable so the flow can be tested without a GPU."""

    load_definition: Callable[[str], Any]
    parse_workload: Callable[[Mapping[str, Any]], Any]
    make_inputs: Callable[..., dict[str, InputValue]]
    check_outputs: Callable[[AcceptanceRule, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], Any]
    merge_verdicts: Callable[[list[Any]], Any]
    # (fn, args, warmup, iterations, time_budget_s=...) -> the timed calls' activity trace, whose
    # spans (the protocol's latency) and busy times the worker reads
    time_fn: Callable[..., ActivityTrace]
    build: Callable[[Side, Any], Callable[..., Any]]
    # The floor of one trial's inputs: (track, workload axes, inputs) -> TrialFloor; raises
    # hopperbench.floors.FloorInputError when the inputs do not fit the floor model.
    trial_floor: Callable[[str, Mapping[str, int], Mapping[str, InputValue]], TrialFloor]
    # (fn, args) -> (replay, value the captured call returned): one call recorded in a CUDA graph;
    # raises hopperbench.timing.graph.NotCapturable when it cannot be.
    capture: Callable[[Callable[..., Any], Sequence[Any]], tuple[Callable[[], Any], Any]]
    # A library side's untimed step (its `prepare` function: definition inputs -> the arguments
    # its entry takes), or None for a side that takes the definition's inputs as they are.
    load_prepare: Callable[[Side], Callable[..., Mapping[str, InputValue]] | None]
    # (side, built entry, device): the side's start-up function run on the device (`Side.start_up`).
    start_up: Callable[[Side, Any, torch.device], None]

    @classmethod
    def default(cls) -> WorkerDeps:
        from hopperbench.acceptance import check_outputs, merge_verdicts
        from hopperbench.definitions import load_definition
        from hopperbench.synth import make_inputs
        from hopperbench.timing.cupti_timer import record_cold_l2
        from hopperbench.timing.graph import capture_call
        from hopperbench.workloads import WorkloadSpec

        return cls(
            load_definition=lambda track: load_definition(get_track(track)),
            parse_workload=WorkloadSpec.model_validate,
            make_inputs=make_inputs,
            check_outputs=check_outputs,
            merge_verdicts=merge_verdicts,
            time_fn=record_cold_l2,
            build=lambda side, definition: side.build(definition),
            trial_floor=trial_floor,
            capture=capture_call,
            load_prepare=load_side_prepare,
            start_up=run_start_up,
        )


def load_side_prepare(side: Side) -> Callable[..., Mapping[str, InputValue]] | None:
    """The side's `prepare` function from its entry file, imported by path; None without one."""
    if side.prepare is None:
        return None
    from hopperbench.devcheck import load_module_by_path

    assert side.source_dir is not None
    path = side.source_dir / side.entry_point.split("::")[0]
    module = load_module_by_path(path, f"_hopperbench_prepare_{side.track}_{side.name}")
    return getattr(module, side.prepare)


# ------------------------------------------------------------------------------------------
# Stored reference outputs


def reference_output_path(scratch_dir: Path, track: str, row: str, trial: int) -> Path:
    """Where a row's reference outputs of `trial` are stored (`row`: `WorkloadSpec.row_name`)."""
    return scratch_dir / track / row / f"trial{trial}.safetensors"


def _stored_seed(path: Path) -> str | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("seed")
    except Exception:
        return None  # unreadable (e.g. torn by a killed run): recompute


def save_reference_outputs(path: Path, outputs: Mapping[str, torch.Tensor], seed: int) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in outputs.items()}, tmp, metadata={"seed": str(seed)})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_reference_outputs(path: Path, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file() or _stored_seed(path) != str(seed):
        raise ReferenceMissing(f"no stored reference output {path} for seed {seed}")
    return load_file(str(path), device=str(device))


# ------------------------------------------------------------------------------------------
# Calling a side


def output_names(definition: Any) -> list[str]:
    return list(definition.outputs)


def allocate_poisoned_outputs(
    definition: Any, axes: Mapping[str, int], device: torch.device
) -> list[torch.Tensor]:
    """The DPS output buffers, pre-filled so that an element the side never writes cannot pass.

    Shapes come from the workload's axes, not from the inputs: an optional input may be None
    (GDN `state`), and flashinfer-bench cannot read axes through it.
    """
    shapes = definition.get_output_shapes(dict(axes))
    buffers = []
    for shape, dtype in zip(shapes, definition.torch_output_dtypes):
        buffer = torch.empty(tuple(shape or ()), dtype=dtype, device=device)
        _poison(buffer)
        buffers.append(buffer)
    return buffers


def _poison(buffer: torch.Tensor) -> None:
    """NaN (floating point) or the type's minimum (integers): a value no passing output holds."""
    if buffer.dtype.is_floating_point:
        buffer.fill_(float("nan"))
    elif buffer.dtype != torch.bool:
        buffer.fill_(torch.iinfo(buffer.dtype).min)


def as_output_dict(definition: Any, result: Any) -> dict[str, torch.Tensor]:
    """A value-returning side's result (tensor, tuple or list) keyed by the definition's output names."""
    values = list(result) if isinstance(result, (tuple, list)) else [result]
    names = output_names(definition)
    if not 1 <= len(values) <= len(names):
        raise ValueError(f"returned {len(values)} values, the definition has {len(names)} outputs")
    for name, value in zip(names, values):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"output {name!r} is a {type(value).__name__}, not a tensor")
    return dict(zip(names, values))


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def snapshot_inputs(inputs: Mapping[str, InputValue]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}


def modified_inputs(snapshot: Mapping[str, torch.Tensor], inputs: Mapping[str, InputValue]) -> list[str]:
    """Names of tensor inputs whose bytes differ from the snapshot (bitwise, so NaN == NaN)."""
    changed = []
    for name, before in snapshot.items():
        after = inputs[name]
        if (
            after.shape != before.shape
            or after.dtype != before.dtype
            or not torch.equal(_bytes_of(before), _bytes_of(after))
        ):
            changed.append(name)
    return changed


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The exception a library adapter raises when its library cannot run here (not installed, another
# build, a prebuilt part missing). Adapters are self-contained files (stdlib, torch and their
# library only), so each defines the class itself and the worker knows it by name.
LIBRARY_UNAVAILABLE = "LibraryUnavailableError"


def failure_status(exc: BaseException) -> Status:
    """UNAVAILABLE for an adapter's LibraryUnavailableError, RUNTIME_ERROR for any other exception."""
    return Status.UNAVAILABLE if type(exc).__name__ == LIBRARY_UNAVAILABLE else Status.RUNTIME_ERROR


def one_line(exc: BaseException, limit: int = 500) -> str:
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------
# The job


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc, 10 ms resolution), or None elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 of stat(5), counted after "pid (comm)"
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime_s - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class PhaseLog:
    """Wall time of a job's phases, printed as one line to the job's log (stderr) when it ends, so
    that a run's logs show where its wall time goes (`process_age`: the process's age when the job
    began, its start-up for a job of its own, the session's age for a later job of a session)."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.phases: list[tuple[str, float]] = []
        age = process_age_s()
        if age is not None:
            self.phases.append(("process_age", age))

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases.append((name, now - self.last))
        self.last = now

    def line(self) -> str:
        return "job phases (s): " + ", ".join(f"{name} {seconds:.3f}" for name, seconds in self.phases)


# The (track, side, withheld inputs of the warm-up workload) this process has warmed up: a fork
# server's session runs many jobs of one side, and only its first of each set of withheld inputs
# warms up.
_WARMED_UP: set[tuple[str, str, tuple[str, ...]]] = set()


class _Outcome(Exception):
    """Ends the job early with a finished result."""

    def __init__(self, result: SideResult) -> None:
        self.result = result


class JobRunner:
    def __init__(
        self, job: WorkerJob, deps: WorkerDeps, checkpoint: Callable[[SideResult], None] | None = None
    ) -> None:
        self.job = job
        self.deps = deps
        # Called with the eager result before the graph replays are attempted, so that a replay
        # that hangs (and gets the process killed) does not take the eager timing with it.
        self.checkpoint = checkpoint or (lambda result: None)
        self.prepare: Callable[..., Mapping[str, InputValue]] | None = None
        self.track = get_track(job.track)
        self.device = torch.device(job.device)
        self.phases = PhaseLog()
        self.definition = deps.load_definition(job.track)
        self.workload = deps.parse_workload(job.workload)

    def result(self, status: Status, **fields: Any) -> SideResult:
        return SideResult(side=self.job.side.name, status=status, pinned=self.job.side.pinned, **fields)

    def inputs(self, trial: int) -> dict[str, InputValue]:
        return self.deps.make_inputs(self.job.track, self.workload, self.job.seed, trial, self.device)

    def arguments(self, inputs: Mapping[str, InputValue]) -> list[InputValue]:
        """The side's positional arguments for these inputs: as they are, or as its untimed
        `prepare` stores them (the same names, in definition order)."""
        if self.prepare is None:
            return list(inputs.values())
        prepared = self.checked(partial(self.prepare, *inputs.values()))
        if list(prepared) != list(inputs):
            raise _Outcome(self.result(Status.RUNTIME_ERROR, message="prepare must return every input by name, in order"))
        return list(prepared.values())

    def run(self) -> SideResult:
        try:
            return self._run()
        finally:
            print(self.phases.line(), file=sys.stderr)

    def _run(self) -> SideResult:
        side = self.job.side
        if not side.available:
            return self.result(Status.UNAVAILABLE, message=side.reason)
        self.phases.mark("setup")
        try:
            fn = self.deps.build(side, self.definition)
            self.prepare = self.deps.load_prepare(side)
        except Exception as e:
            traceback.print_exc()
            return self.result(Status.RUNTIME_ERROR, message=f"build failed: {one_line(e)}")
        self.phases.mark("build")
        if side.start_up is not None:
            try:
                self.deps.start_up(side, fn, self.device)
            except Exception as e:
                traceback.print_exc()
                return self.result(Status.RUNTIME_ERROR, message=f"start-up failed: {one_line(e)}")
            self.phases.mark("start_up")
        if self.job.warmup_workload is not None:
            warmup_workload = self.deps.parse_workload(self.job.warmup_workload)
            key = (self.job.track, side.name, tuple(warmup_workload.withheld_inputs))
            if key not in _WARMED_UP:
                _WARMED_UP.add(key)
                self.warm_up(fn, warmup_workload)
                self.phases.mark("warmup")
        try:
            if side.kind == SideKind.REFERENCE:
                return self.run_reference(fn)
            return self.run_candidate(fn)
        except _Outcome as outcome:
            return outcome.result

    def warm_up(self, fn: Callable[..., Any], workload: Any) -> None:
        """One untimed call on trial 0 of `workload` (the run's largest of the track), whose outputs
        are dropped: what a side's process chooses on its first call (a Triton autotuner's
        configuration, kept per key that may omit the token count) is chosen on the largest shape,
        as a serving engine's warm-up does, whichever workload the process serves first. A warm-up
        that raises is only logged: the job's own calls report the side's errors."""
        try:
            inputs = self.deps.make_inputs(self.job.track, workload, self.job.seed, 0, self.device)
            args = self.arguments(inputs)
            if self.job.side.destination_passing_style:
                args += allocate_poisoned_outputs(self.definition, workload.axes, self.device)
            self._call_synchronized(fn, args)
        except _Outcome as outcome:  # `arguments` ends a job this way; here it only ends the warm-up
            print(f"warm-up on workload {workload.uuid} raised {outcome.result.message}", file=sys.stderr)
        except Exception as e:
            print(f"warm-up on workload {workload.uuid} raised {one_line(e)}", file=sys.stderr)

    # -- reference -------------------------------------------------------------------------

    def run_reference(self, fn: Callable[..., Any]) -> SideResult:
        job = self.job
        for trial in range(job.trials):
            path = reference_output_path(job.scratch_dir, job.track, self.workload.row_name, trial)
            if path.is_file() and _stored_seed(path) == str(job.seed):
                continue
            inputs = self.inputs(trial)
            result = self.call(fn, list(inputs.values()))
            save_reference_outputs(path, self.checked(partial(as_output_dict, self.definition, result)), job.seed)
            del inputs, result
        self.phases.mark("reference_outputs")
        return self.timed(fn, dps=False)

    # -- any other side --------------------------------------------------------------------

    def run_candidate(self, fn: Callable[..., Any]) -> SideResult:
        job = self.job
        dps = job.side.destination_passing_style
        verdicts = []
        for trial in range(job.trials):
            path = reference_output_path(job.scratch_dir, job.track, self.workload.row_name, trial)
            try:
                reference = load_reference_outputs(path, job.seed, self.device)
            except ReferenceMissing as e:
                return self.result(Status.NO_REFERENCE, message=str(e))
            inputs = self.inputs(trial)
            snapshot = snapshot_inputs(inputs)
            args = self.arguments(inputs)
            if dps:
                buffers = allocate_poisoned_outputs(self.definition, self.workload.axes, self.device)
                self.call(fn, [*args, *buffers])
                outputs = dict(zip(output_names(self.definition), buffers))
            else:
                result = self.call(fn, args)
                outputs = self.checked(partial(as_output_dict, self.definition, result))
            changed = modified_inputs(snapshot, inputs)
            if changed:
                return self.result(
                    Status.FAILED, message=f"modified its inputs ({', '.join(changed)}) in trial {trial}"
                )
            verdicts.append(self.deps.check_outputs(self.track.acceptance_for(job.side.kind), outputs, reference))
            del inputs, args, snapshot, outputs, reference  # free before the next trial's inputs
        self.phases.mark("checks")
        verdict = self.deps.merge_verdicts(verdicts)
        stats = error_stats(verdict)
        if not verdict.passed:
            return self.result(Status.FAILED, message=verdict.reason or "outputs do not match the reference", **stats)
        return self.timed(fn, dps=dps, **stats)

    # -- shared ----------------------------------------------------------------------------

    def call(self, fn: Callable[..., Any], args: list[Any]) -> Any:
        """One untimed call, synchronized; an exception ends the job as RUNTIME_ERROR."""
        return self.checked(partial(self._call_synchronized, fn, args))

    def _call_synchronized(self, fn: Callable[..., Any], args: list[Any]) -> Any:
        with torch.no_grad():
            result = fn(*args)
        _synchronize(self.device)
        return result

    def checked(self, thunk: Callable[[], Any]) -> Any:
        try:
            return thunk()
        except _Outcome:
            raise
        except Exception as e:
            traceback.print_exc()
            raise _Outcome(self.result(failure_status(e), message=one_line(e))) from None

    def timed(self, fn: Callable[..., Any], dps: bool, **stats: Any) -> SideResult:
        """Eager timing of every trial, then, for any side but the reference, the same calls
        replayed from a CUDA graph (`graph_timed`). Eager first and in full: a side whose replay
        breaks the CUDA context cannot cost its eager result."""
        job = self.job
        if job.iterations == 0:
            return self.result(Status.PASSED, **stats)
        per_trial, per_trial_busy, per_trial_iterations = [], [], []
        floors: list[TrialFloor] | None = []  # None once a trial's inputs have no floor
        for trial in range(job.trials):
            inputs = self.inputs(trial)  # fresh: never the inputs the correctness call saw
            if floors is not None:
                floors = self.floor_of(inputs, floors)  # may synchronize: before the timed region
            args = self.arguments(inputs)
            if dps:
                args += allocate_poisoned_outputs(self.definition, self.workload.axes, self.device)
            trace = self.checked(
                partial(self.deps.time_fn, fn, args, job.warmup, job.iterations, time_budget_s=job.time_budget_s)
            )
            spans, busy = self.checked(lambda: (trace.spans(), trace.busy()))
            per_trial.append(statistics.median(spans))
            per_trial_busy.append(statistics.median(busy))
            per_trial_iterations.append(len(spans))
            del inputs, args
            self.phases.mark(f"timing_trial{trial}")
        eager = self.result(
            Status.PASSED,
            latency_ms=statistics.median(per_trial),
            min_ms=min(per_trial),
            max_ms=max(per_trial),
            per_trial_ms=per_trial,
            busy_ms=statistics.median(per_trial_busy),
            per_trial_busy_ms=per_trial_busy,
            per_trial_iterations=per_trial_iterations,
            per_trial_floor=floors or [],
            **stats,
        )
        if job.side.kind == SideKind.REFERENCE:
            return eager  # the definition's reference is timed eagerly only
        self.checkpoint(eager)
        return eager.model_copy(update=self.graph_timed(fn, dps))

    def graph_timed(self, fn: Callable[..., Any], dps: bool) -> dict[str, Any]:
        """Per trial: capture one call on the trial's inputs, replay it once into poisoned outputs
        and gate them against the stored reference, then time replays under the same protocol.
        The result fields of the graph columns (`SideResult.graph_*`)."""
        job = self.job
        spans_ms: list[float] = []
        busy_ms: list[float] = []
        for trial in range(job.trials):
            inputs = self.inputs(trial)
            args = self.arguments(inputs)
            buffers = allocate_poisoned_outputs(self.definition, self.workload.axes, self.device) if dps else []
            try:
                replay, returned = self.deps.capture(fn, [*args, *buffers])
            except NotCapturable as e:
                return {"graph_status": GraphStatus.NOT_CAPTURABLE, "graph_message": str(e)}
            try:
                outputs = dict(zip(output_names(self.definition), buffers)) if dps else as_output_dict(
                    self.definition, returned
                )
                for tensor in outputs.values():
                    _poison(tensor)
                replay()
                _synchronize(self.device)
                path = reference_output_path(job.scratch_dir, job.track, self.workload.row_name, trial)
                reference = load_reference_outputs(path, job.seed, self.device)
                verdict = self.deps.check_outputs(self.track.acceptance_for(job.side.kind), outputs, reference)
                if not verdict.passed:
                    why = verdict.reason or "outputs do not match the reference"
                    return {"graph_status": GraphStatus.FAILED, "graph_message": f"replay in trial {trial}: {why}"}
                trace = self.deps.time_fn(replay, [], job.warmup, job.iterations, time_budget_s=job.time_budget_s)
                spans_ms.append(statistics.median(trace.spans()))
                busy_ms.append(statistics.median(trace.busy()))
            except Exception as e:
                traceback.print_exc()
                return {"graph_status": GraphStatus.FAILED, "graph_message": f"replay in trial {trial}: {one_line(e)}"}
            finally:
                del inputs, args, buffers
            self.phases.mark(f"graph_trial{trial}")
        return {
            "graph_status": GraphStatus.PASSED,
            "graph_ms": statistics.median(spans_ms),
            "graph_busy_ms": statistics.median(busy_ms),
            "per_trial_graph_ms": spans_ms,
            "per_trial_graph_busy_ms": busy_ms,
        }

    def floor_of(self, inputs: Mapping[str, InputValue], floors: list[TrialFloor]) -> list[TrialFloor] | None:
        """`floors` with this trial's appended, or None when the inputs do not fit the floor model:
        the job then has no floor, which is no failure of the side."""
        try:
            floor = self.deps.trial_floor(self.job.track, self.workload.axes, inputs)
        except FloorInputError as e:
            print(f"no roofline floor for this job: {one_line(e)}", file=sys.stderr)
            return None
        return [*floors, floor]


def error_stats(verdict: Any) -> dict[str, float | None]:
    """Worst error over outputs (the verdict already merged trials): max errors, min matched ratio."""
    outputs = list(getattr(verdict, "outputs", {}).values())

    def worst(field: str, pick: Callable[[list[float]], float]) -> float | None:
        values = [float(getattr(o, field)) for o in outputs if getattr(o, field, None) is not None]
        if any(math.isnan(v) for v in values):
            return math.nan  # NaN is the worst possible error, and max() would not see it
        return pick(values) if values else None

    return {
        "max_abs_err": worst("max_abs_err", max),
        "max_rel_err": worst("max_rel_err", max),
        "relative_l2": worst("relative_l2", max),
        "matched_ratio": worst("matched_ratio", min),
    }


def run_job(
    job: WorkerJob, deps: WorkerDeps | None = None, checkpoint: Callable[[SideResult], None] | None = None
) -> SideResult:
    try:
        return JobRunner(job, deps or WorkerDeps.default(), checkpoint).run()
    except Exception as e:
        # The harness's own steps (inputs, comparison) failed, not the side's call: still one result line.
        traceback.print_exc()
        return SideResult(side=job.side.name, status=Status.RUNTIME_ERROR, pinned=job.side.pinned,
                          message=f"harness error: {one_line(e)}")  # fmt: skip


def write_result(path: Path, result: SideResult) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(result.model_dump_json(), encoding="utf-8")
    os.replace(tmp, path)


def process_still_sound(result: SideResult) -> bool:
    """Whether this process may run another job after `result`: not after an exception inside a
    side's call or replay, which may have left a sticky CUDA error behind."""
    return result.status != Status.RUNTIME_ERROR and result.graph_status != GraphStatus.FAILED


def main(argv: Sequence[str] | None = None) -> int:
    """Run one job; exit code 0 when the process may run another (a fork server's session), else 1.
    The result file is written either way."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m hopperbench.worker JOB.json RESULT.json", file=sys.stderr)
        return 2
    job = WorkerJob.model_validate_json(Path(args[0]).read_text(encoding="utf-8"))
    result = run_job(job, checkpoint=partial(write_result, Path(args[1])))
    write_result(Path(args[1]), result)
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # an idle session keeps no memory pool the next side could want
    return 0 if process_still_sound(result) else 1


if __name__ == "__main__":
    raise SystemExit(main())
