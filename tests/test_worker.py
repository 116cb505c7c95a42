"""The worker's flow on the CPU: a tiny definition, real flashinfer-bench builds, real acceptance,
fake inputs and a fake timer."""

from __future__ import annotations

import contextlib
import math
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from flashinfer_bench import Definition

from hopperbench.acceptance import check_outputs, merge_verdicts
from hopperbench.floors import FloorInputError
from hopperbench.results import GraphStatus, SideResult, Status, TrialFloor
from hopperbench.sides import Side, SideKind, run_start_up
from hopperbench.timing.span import ActivityTrace, ApiRecord, GpuRecord
from hopperbench.timing.graph import NotCapturable
from hopperbench.worker import (
    WorkerDeps,
    WorkerJob,
    allocate_poisoned_outputs,
    load_side_prepare,
    main,
    modified_inputs,
    reference_output_path,
    run_job,
    snapshot_inputs,
)
from hopperbench.workloads import WorkloadSpec

TRACK = "dsa_attention"  # its acceptance rule (atol = rtol = 1e-2, all elements, outputs output + lse)

REFERENCE = textwrap.dedent(
    """
    import torch

    def run(x, y, s):
        output = x * y + s
        return output, output.sum(dim=1)
    """
)

DEFINITION = Definition(
    name="tiny_def",
    op_type="tiny",
    axes={"n": {"type": "var"}, "d": {"type": "const", "value": 4}},
    inputs={
        "x": {"shape": ["n", "d"], "dtype": "float32"},
        "y": {"shape": ["n", "d"], "dtype": "float32"},
        "s": {"shape": None, "dtype": "float32"},
    },
    outputs={"output": {"shape": ["n", "d"], "dtype": "float32"}, "lse": {"shape": ["n"], "dtype": "float32"}},
    reference=REFERENCE,
)

DPS = "def run(x, y, s, output, lse):\n"
KERNELS = {
    "correct": DPS + "    output.copy_(x * y + s)\n    lse.copy_(output.sum(dim=1))\n",
    "skips_lse": DPS + "    output.copy_(x * y + s)\n",
    "in_place": DPS + "    x.mul_(y)\n    output.copy_(x + s)\n    lse.copy_(output.sum(dim=1))\n",
    "raises": DPS + "    raise RuntimeError('CUDA error: an illegal memory access\\nmore detail')\n",
    "value_returning": "def run(x, y, s):\n    out = x * y + s\n    return out, out.sum(dim=1)\n",
    "slightly_off": DPS + "    output.copy_(x * y + s + 0.5)\n    lse.copy_(output.sum(dim=1))\n",
    # Correct only once its start-up has run in this module (as MoE's walk needs its partition map).
    "needs_start_up": "STARTED = []\n\ndef warm_up(device):\n    STARTED.append(device)\n\n" + DPS
    + "    output.copy_(x * y + s * min(len(STARTED), 1))\n    lse.copy_(output.sum(dim=1))\n",
    "start_up_raises": "def warm_up(device):\n    raise RuntimeError('no partition map')\n\n" + DPS
    + "    output.copy_(x * y + s)\n    lse.copy_(output.sum(dim=1))\n",
}


class Recorder:
    def __init__(self) -> None:
        self.inputs_made: list[tuple[int, int]] = []
        self.timed: list[tuple[int, int, int]] = []  # (number of args, warmup, iterations)
        self.events: list[str] = []  # "floor" and "time", in call order
        self.floored_x: list[torch.Tensor] = []  # input x of each trial_floor call
        self.timed_x: list[torch.Tensor] = []  # first argument of each time_fn call
        self.budgets: list[float | None] = []  # time_budget_s of each time_fn call
        self.replays = 0  # time_fn calls on a graph replay

    def make_inputs(self, track, workload, seed, trial, device):
        self.inputs_made.append((seed, trial))
        gen = torch.Generator().manual_seed(seed * 1000 + trial)
        n = workload.axes["n"]
        return {"x": torch.randn(n, 4, generator=gen), "y": torch.randn(n, 4, generator=gen), "s": 0.25 * (trial + 1)}

    def trial_floor(self, track, axes, inputs):
        """A floor that depends on the values of the inputs, so the test can tell which ones it saw."""
        self.events.append("floor")
        self.floored_x.append(inputs["x"])
        return TrialFloor(bytes_min=100.0 * inputs["s"], core_us=float(inputs["x"].abs().sum()))

    def time_fn(self, fn, args, warmup, iterations, time_budget_s=None):
        fn(*args)  # the args must make a valid call
        self.events.append("time" if args else "replay")
        if not args:  # a graph replay: spans of 0.5 ms less than the eager ones
            self.replays += 1
            return trace_of_spans([self.replays - 0.5, self.replays - 0.4, self.replays])
        self.timed_x.append(args[0])
        self.timed.append((len(args), warmup, iterations))
        self.budgets.append(time_budget_s)
        base = float(len(self.timed))  # trial t gets spans centred on t + 1
        return trace_of_spans([base - 0.1, base, base + 0.5])


def trace_of_spans(spans_ms: list[float]) -> ActivityTrace:
    """A trace whose iteration i spans spans_ms[i]: two kernels, busy for the first half and the
    last quarter of the span (busy time 3/4 of it)."""
    trace = ActivityTrace()
    for i, span in enumerate(spans_ms):
        t0, ns = 10**9 * (i + 1), round(span * 1e6)
        trace.windows.append((t0, t0 + 10))
        trace.api_records.append(ApiRecord(start=t0 + 1, end=t0 + 2, correlation_id=i, kind=0, callback_id=0))
        trace.gpu_records += [
            GpuRecord(name="first", start=t0, end=t0 + ns // 2, correlation_id=i, kind=0),
            GpuRecord(name="second", start=t0 + ns - ns // 4, end=t0 + ns, correlation_id=i, kind=0),
        ]
    return trace


@pytest.fixture(autouse=True)
def fib_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIB_CACHE_PATH", str(tmp_path / "fib_cache"))


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


def deps(recorder: Recorder) -> WorkerDeps:
    return WorkerDeps(
        load_definition=lambda track: DEFINITION,
        parse_workload=WorkloadSpec.model_validate,
        make_inputs=recorder.make_inputs,
        check_outputs=check_outputs,
        merge_verdicts=merge_verdicts,
        time_fn=recorder.time_fn,
        build=lambda side, definition: side.build(definition),
        trial_floor=recorder.trial_floor,
        capture=fake_capture,
        load_prepare=load_side_prepare,
        start_up=run_start_up,
    )


@contextlib.contextmanager
def host_reads_forbidden():
    """What a capturing CUDA stream does to a host read of device data, on the CPU."""
    def refuse(*args, **kwargs):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    with pytest.MonkeyPatch.context() as patch:
        for name in ("item", "tolist", "cpu"):
            patch.setattr(torch.Tensor, name, refuse)
        yield


def fake_capture(fn, args):
    """CPU stand-in for `capture_call`: a host read during the capture fails as on a GPU; the
    replay repeats the call on the same arguments."""
    try:
        with host_reads_forbidden():
            result = fn(*args)
    except RuntimeError as e:
        raise NotCapturable(str(e)) from e
    return (lambda: fn(*args)), result


def workload(uuid: str = "w0") -> dict:
    spec = WorkloadSpec(track=TRACK, index=0, uuid=uuid, axes={"n": 3}, scalars={}, data_source="synthesized")
    return spec.model_dump(mode="json")


def reference_side() -> Side:
    return Side(name="reference", kind=SideKind.REFERENCE, track=TRACK, available=True, destination_passing_style=False)


def kernel_side(tmp_path: Path, variant: str, function: str = "run", start_up: str | None = None) -> Side:
    folder = tmp_path / f"kernel_{variant}"
    folder.mkdir(exist_ok=True)
    (folder / "kernel.py").write_text(KERNELS[variant])
    return Side(
        name="ours",
        kind=SideKind.OURS,
        track=TRACK,
        available=True,
        source_dir=folder,
        files=("kernel.py",),
        entry_point=f"kernel.py::{function}",
        destination_passing_style=variant != "value_returning",
        start_up=start_up,
    )


def job(tmp_path: Path, side: Side, iterations: int = 5, seed: int = 0, trials: int = 3) -> WorkerJob:
    return WorkerJob(track=TRACK, side=side, workload=workload(), seed=seed, trials=trials, warmup=2,
                     iterations=iterations, scratch_dir=tmp_path / "scratch", device="cpu")  # fmt: skip


def run_reference(tmp_path: Path, recorder: Recorder, **kw) -> None:
    result = run_job(job(tmp_path, reference_side(), **kw), deps(recorder))
    assert result.status == Status.PASSED, result.message


def test_reference_stores_outputs_then_times_itself(tmp_path: Path, recorder: Recorder) -> None:
    result = run_job(job(tmp_path, reference_side()), deps(recorder))
    assert result.status == Status.PASSED
    for t in range(3):
        assert reference_output_path(tmp_path / "scratch", TRACK, "w0", t).is_file()
    # 3 input sets for the outputs, 3 fresh ones for timing; value-returning: inputs only.
    assert recorder.inputs_made == [(0, 0), (0, 1), (0, 2)] * 2
    assert recorder.timed == [(3, 2, 5)] * 3
    assert recorder.budgets == [None] * 3
    assert result.per_trial_ms == [1.0, 2.0, 3.0]
    # Busy time: 3/4 of each trial's median span, and its median over trials.
    assert result.per_trial_busy_ms == pytest.approx([0.75, 1.5, 2.25])
    assert result.busy_ms == pytest.approx(1.5)
    assert result.per_trial_iterations == [3, 3, 3]  # the recorder returns three spans per trial
    assert (result.latency_ms, result.min_ms, result.max_ms) == (2.0, 1.0, 3.0)


def test_a_job_logs_where_its_wall_time_went(tmp_path: Path, recorder: Recorder, capsys) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    capsys.readouterr()
    assert run_job(job(tmp_path, kernel_side(tmp_path, "correct")), deps(recorder)).status == Status.PASSED
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("job phases (s): ")]
    assert len(lines) == 1
    names = [part.rsplit(" ", 1)[0] for part in lines[0].removeprefix("job phases (s): ").split(", ")]
    assert names == ["process_age", "setup", "build", "checks", "timing_trial0", "timing_trial1", "timing_trial2",
                     "graph_trial0", "graph_trial1", "graph_trial2"]  # fmt: skip
    # A job that ends early still logs what it did.
    run_job(job(tmp_path, kernel_side(tmp_path, "raises")), deps(recorder))
    assert ", setup " in capsys.readouterr().err.splitlines()[-1]


def test_the_jobs_time_budget_reaches_the_timer_of_every_trial(tmp_path: Path, recorder: Recorder) -> None:
    budgeted = job(tmp_path, reference_side()).model_copy(update={"time_budget_s": 0.5})
    assert run_job(budgeted, deps(recorder)).status == Status.PASSED
    assert recorder.budgets == [0.5] * 3


def test_reference_outputs_are_cached_per_seed(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    assert recorder.inputs_made == [(0, 0), (0, 1), (0, 2)] and recorder.timed == []
    recorder.inputs_made.clear()
    run_reference(tmp_path, recorder, iterations=0)
    assert recorder.inputs_made == []  # reused
    run_reference(tmp_path, recorder, iterations=0, seed=7)
    assert recorder.inputs_made == [(7, 0), (7, 1), (7, 2)]  # another seed: recomputed


def test_correct_dps_kernel_passes_and_is_timed_on_fresh_inputs(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    recorder.inputs_made.clear()
    result = run_job(job(tmp_path, kernel_side(tmp_path, "correct")), deps(recorder))
    assert result.status == Status.PASSED, result.message
    assert result.max_abs_err is not None and result.max_abs_err < 1e-6
    assert result.matched_ratio == 1.0
    # Correctness, then fresh inputs for the eager timing, then again for the graph replays.
    assert recorder.inputs_made == [(0, 0), (0, 1), (0, 2)] * 3
    assert recorder.timed == [(5, 2, 5)] * 3  # 3 inputs + 2 output buffers
    assert result.latency_ms == 2.0 and result.min_ms == 1.0 and result.max_ms == 3.0


def test_each_timed_trial_records_the_floor_of_exactly_the_inputs_it_timed(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    recorder.inputs_made.clear()
    result = run_job(job(tmp_path, kernel_side(tmp_path, "correct")), deps(recorder))
    assert result.status == Status.PASSED, result.message
    # The correctness pass takes no floor; each eager trial takes one, before it is timed; the
    # graph replays of the same inputs come after every eager trial.
    assert recorder.events == ["floor", "time"] * 3 + ["replay"] * 3
    assert all(f is t for f, t in zip(recorder.floored_x, recorder.timed_x, strict=True))
    expected = [
        TrialFloor(bytes_min=100.0 * 0.25 * (trial + 1), core_us=float(x.abs().sum()))
        for trial, x in enumerate(recorder.timed_x)
    ]
    assert result.per_trial_floor == expected
    assert len(result.per_trial_floor) == len(result.per_trial_ms)
    # It travels in the result file the runner reads back.
    assert SideResult.model_validate_json(result.model_dump_json()).per_trial_floor == expected


def test_inputs_without_a_floor_leave_the_job_timed_and_floorless(tmp_path: Path, recorder: Recorder) -> None:
    def no_floor(track, axes, inputs):
        recorder.events.append("floor")
        raise FloorInputError("dsa_attention: inputs lack tensor 'sparse_indices'")

    result = run_job(job(tmp_path, reference_side()), replace(deps(recorder), trial_floor=no_floor))
    assert result.status == Status.PASSED, result.message
    assert result.per_trial_ms == [1.0, 2.0, 3.0] and result.per_trial_floor == []
    assert recorder.events == ["floor", "time", "time", "time"]  # not asked again once it had none


def test_no_floor_is_taken_without_timing(tmp_path: Path, recorder: Recorder) -> None:
    result = run_job(job(tmp_path, reference_side(), iterations=0), deps(recorder))
    assert result.status == Status.PASSED and result.per_trial_floor == []
    assert recorder.events == []


def test_value_returning_side_passes(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    result = run_job(job(tmp_path, kernel_side(tmp_path, "value_returning")), deps(recorder))
    assert result.status == Status.PASSED, result.message
    assert recorder.timed == [(3, 2, 5)] * 3


def test_unwritten_output_fails_through_the_nan_poison(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    result = run_job(job(tmp_path, kernel_side(tmp_path, "skips_lse")), deps(recorder))
    assert result.status == Status.FAILED
    assert "lse" in (result.message or "")
    assert result.latency_ms is None and recorder.timed == []


def test_wrong_values_fail_with_stats(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    result = run_job(job(tmp_path, kernel_side(tmp_path, "slightly_off")), deps(recorder))
    assert result.status == Status.FAILED
    assert result.max_abs_err == pytest.approx(2.0, rel=1e-5)  # lse sums 4 elements each 0.5 off
    assert result.matched_ratio == 0.0
    assert recorder.timed == []


def test_modifying_inputs_fails(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    result = run_job(job(tmp_path, kernel_side(tmp_path, "in_place")), deps(recorder))
    assert result.status == Status.FAILED
    assert result.message == "modified its inputs (x) in trial 0"


def test_exception_is_a_one_line_runtime_error(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    result = run_job(job(tmp_path, kernel_side(tmp_path, "raises")), deps(recorder))
    assert result.status == Status.RUNTIME_ERROR
    assert result.message == "RuntimeError: CUDA error: an illegal memory access"


def test_build_failure_is_a_runtime_error(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    result = run_job(job(tmp_path, kernel_side(tmp_path, "correct", function="missing")), deps(recorder))
    assert result.status == Status.RUNTIME_ERROR
    assert (result.message or "").startswith("build failed:")


def test_missing_reference_outputs_give_no_reference(tmp_path: Path, recorder: Recorder) -> None:
    result = run_job(job(tmp_path, kernel_side(tmp_path, "correct")), deps(recorder))
    assert result.status == Status.NO_REFERENCE
    run_reference(tmp_path, recorder, iterations=0, seed=1)  # outputs of another seed do not count
    assert run_job(job(tmp_path, kernel_side(tmp_path, "correct")), deps(recorder)).status == Status.NO_REFERENCE


def test_a_twins_reference_outputs_are_stored_apart_from_its_workloads(tmp_path: Path, recorder: Recorder) -> None:
    twin = WorkloadSpec.model_validate(workload()).without("lse_scale").model_dump(mode="json")

    def twin_job(side: Side) -> WorkerJob:
        return job(tmp_path, side, iterations=0).model_copy(update={"workload": twin})

    assert run_job(twin_job(reference_side()), deps(recorder)).status == Status.PASSED
    scratch = tmp_path / "scratch"
    assert all(reference_output_path(scratch, TRACK, "w0.without-lse_scale", t).is_file() for t in range(3))
    assert not (scratch / TRACK / "w0").exists()
    # The twin's sides are checked against its outputs; the workload's own row has none yet.
    assert run_job(twin_job(kernel_side(tmp_path, "correct")), deps(recorder)).status == Status.PASSED
    assert run_job(job(tmp_path, kernel_side(tmp_path, "correct")), deps(recorder)).status == Status.NO_REFERENCE


def test_unavailable_side_is_reported_without_building(tmp_path: Path, recorder: Recorder) -> None:
    side = Side(
        name="ours", kind=SideKind.OURS, track=TRACK, available=False, reason="kernels/x/kernel.py does not exist yet"
    )
    result = run_job(job(tmp_path, side), deps(recorder))
    assert result.status == Status.UNAVAILABLE and result.message == side.reason
    assert recorder.inputs_made == []


def test_poisoned_outputs() -> None:
    fields = DEFINITION.model_dump()
    fields["outputs"]["idx"] = {"shape": ["n"], "dtype": "int32"}
    definition = Definition.model_validate(fields)
    output, lse, idx = allocate_poisoned_outputs(definition, {"n": 2}, torch.device("cpu"))
    assert output.shape == (2, 4) and torch.isnan(output).all()
    assert lse.shape == (2,) and torch.isnan(lse).all()
    assert idx.dtype == torch.int32 and (idx == torch.iinfo(torch.int32).min).all()


def test_input_snapshot_is_bitwise() -> None:
    inputs = {"x": torch.tensor([1.0, math.nan]), "n": 3, "state": None, "z": torch.tensor(2.0)}
    snapshot = snapshot_inputs(inputs)
    assert modified_inputs(snapshot, inputs) == []  # NaN equals itself bitwise
    inputs["z"].add_(1)
    inputs["x"][1] = -math.nan
    assert modified_inputs(snapshot, inputs) == ["x", "z"]


def test_main_needs_two_paths(capsys) -> None:
    assert main(["only-one"]) == 2
    assert "usage" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_reference_and_a_copy_of_it_on_the_gpu(tmp_path: Path) -> None:
    """The real collaborators: definitions, synth, acceptance and the CUPTI timer, on a small DSA workload."""
    from hopperbench.tracks import get_track
    from hopperbench.workloads import load_workloads

    spec = min(load_workloads(TRACK), key=lambda w: w.axes["num_tokens"])
    copy = Side(
        name="ours",
        kind=SideKind.OURS,
        track=TRACK,
        available=True,
        source_dir=get_track(TRACK).folder,
        files=("reference.py",),
        entry_point="reference.py::run",
        destination_passing_style=False,
    )
    results = {}
    for side in (reference_side(), copy):
        gpu_job = WorkerJob(track=TRACK, side=side, workload=spec.model_dump(mode="json"), seed=0, trials=2, warmup=1,
                            iterations=3, scratch_dir=tmp_path / "scratch", device="cuda")  # fmt: skip
        results[side.name] = run_job(gpu_job)
    assert results["reference"].status == Status.PASSED, results["reference"].message
    assert results["ours"].status == Status.PASSED, results["ours"].message
    assert results["ours"].max_abs_err == 0.0
    from hopperbench.floors import trial_floor
    from hopperbench.synth import make_inputs

    expected_floors = [
        trial_floor(TRACK, spec.axes, make_inputs(TRACK, spec, 0, trial, "cuda", only=["sparse_indices"]))
        for trial in range(2)
    ]
    for result in results.values():
        assert result.latency_ms is not None and result.latency_ms > 0
        assert len(result.per_trial_ms) == 2
        assert result.per_trial_floor == expected_floors


def test_a_failing_harness_step_is_still_one_result(tmp_path: Path, recorder: Recorder) -> None:
    def broken_inputs(*args, **kwargs):
        raise MemoryError("cannot allocate the inputs")

    result = run_job(job(tmp_path, reference_side()), replace(deps(recorder), make_inputs=broken_inputs))
    assert result.status == Status.RUNTIME_ERROR
    assert result.message == "harness error: MemoryError: cannot allocate the inputs"


def test_poisoned_outputs_take_shapes_from_the_workload_axes() -> None:
    """GDN's optional `state` may be None, so output shapes cannot be read from the inputs."""
    from hopperbench.definitions import load_definition
    from hopperbench.tracks import GDN_PREFILL

    definition = load_definition(GDN_PREFILL)
    axes = {"total_seq_len": 6, "num_seqs": 2, "len_cu_seqlens": 3}
    output, new_state = allocate_poisoned_outputs(definition, axes, torch.device("cpu"))
    assert output.shape == (6, 8, 128) and output.dtype == torch.bfloat16 and torch.isnan(output).all()
    assert new_state.shape == (2, 8, 128, 128) and torch.isnan(new_state).all()


# ------------------------------------------------------------------------------------------
# Graph replays

SYNCS = DPS + "    output.copy_(x * y + s)\n    lse.copy_(output.sum(dim=1))\n    float(lse[0].item())\n"


def source_side(tmp_path: Path, source: str, **fields) -> Side:
    folder = tmp_path / "side"
    folder.mkdir(exist_ok=True)
    (folder / "kernel.py").write_text(source)
    return Side(name=fields.pop("name", "ours"), kind=fields.pop("kind", SideKind.OURS), track=TRACK, available=True,
                source_dir=folder, files=("kernel.py",), entry_point="kernel.py::run", **fields)  # fmt: skip


def test_a_capturable_side_gets_its_graph_spans_recorded(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    result = run_job(job(tmp_path, kernel_side(tmp_path, "correct")), deps(recorder))
    assert result.status == Status.PASSED and result.graph_status == "PASSED", result.graph_message
    # The recorder's replay spans are 0.4 ms below the eager ones (medians 0.6, 1.6, 2.6).
    assert result.per_trial_graph_ms == pytest.approx([0.6, 1.6, 2.6]) and result.graph_ms == pytest.approx(1.6)
    assert result.per_trial_graph_busy_ms == pytest.approx([0.45, 1.2, 1.95])
    assert result.graph_timed and result.latency_ms == 2.0  # the eager columns are untouched


def test_a_side_that_syncs_is_not_capturable_and_keeps_only_its_eager_timing(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    result = run_job(job(tmp_path, source_side(tmp_path, SYNCS)), deps(recorder))
    assert result.status == Status.PASSED and result.latency_ms == 2.0
    assert result.graph_status == "NOT_CAPTURABLE"
    assert "not permitted when stream is capturing" in (result.graph_message or "")
    # Never timed eagerly in the graph's place.
    assert result.graph_ms is None and result.per_trial_graph_ms == [] and recorder.replays == 0


def test_a_replay_that_leaves_its_outputs_unwritten_fails_its_own_gate(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    # A graph that recorded none of the call's work (e.g. work launched on another stream): its
    # replay leaves the poisoned outputs as they are.
    empty_graph = replace(deps(recorder), capture=lambda fn, args: ((lambda: None), None))
    result = run_job(job(tmp_path, kernel_side(tmp_path, "correct")), empty_graph)
    assert result.status == Status.PASSED and result.latency_ms == 2.0
    assert result.graph_status == "FAILED" and result.graph_ms is None
    assert (result.graph_message or "").startswith("replay in trial 0:")


def test_the_reference_is_timed_eagerly_only(tmp_path: Path, recorder: Recorder) -> None:
    result = run_job(job(tmp_path, reference_side()), deps(recorder))
    assert result.status == Status.PASSED and result.graph_status is None and recorder.replays == 0


def test_the_eager_result_is_checkpointed_before_the_replays(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    seen: list[SideResult] = []
    result = run_job(job(tmp_path, kernel_side(tmp_path, "correct")), deps(recorder), checkpoint=seen.append)
    assert len(seen) == 1 and seen[0].graph_status is None and seen[0].latency_ms == result.latency_ms
    assert result.graph_status == "PASSED"


PREPARED = (
    "def prepare(x, y, s):\n    return {'x': x, 'y': (y * 2).contiguous(), 's': s}\n\n"
    + DPS + "    output.copy_(x * (y / 2) + s)\n    lse.copy_(output.sum(dim=1))\n"
)


def test_a_library_side_takes_its_inputs_through_prepare(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    side = source_side(tmp_path, PREPARED, name="lib", kind=SideKind.LIBRARY, prepare="prepare")
    result = run_job(job(tmp_path, side), deps(recorder))
    assert result.status == Status.PASSED and result.graph_status == "PASSED", result.message
    # Without prepare the same run function is wrong: y arrives unscaled.
    unprepared = run_job(job(tmp_path, side.model_copy(update={"prepare": None})), deps(recorder))
    assert unprepared.status == Status.FAILED


UNAVAILABLE_LIBRARY = (
    "class LibraryUnavailableError(RuntimeError):\n    pass\n\n"
    + DPS + "    raise LibraryUnavailableError('libfoo 1.0 is installed; this adapter needs 2.0')\n"
)


def test_a_library_that_cannot_run_here_is_unavailable_not_a_runtime_error(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    side = source_side(tmp_path, UNAVAILABLE_LIBRARY, name="lib", kind=SideKind.LIBRARY)
    result = run_job(job(tmp_path, side), deps(recorder))
    assert result.status == Status.UNAVAILABLE
    assert result.message == "LibraryUnavailableError: libfoo 1.0 is installed; this adapter needs 2.0"
    # Any other exception in the call stays a runtime error.
    failing = source_side(tmp_path, UNAVAILABLE_LIBRARY.replace("raise LibraryUnavailableError", "raise ValueError"),
                          name="lib", kind=SideKind.LIBRARY)  # fmt: skip
    assert run_job(job(tmp_path, failing), deps(recorder)).status == Status.RUNTIME_ERROR


def test_prepare_loads_from_a_side_file_that_defines_a_dataclass(tmp_path: Path) -> None:
    # A dataclass looks its module up in sys.modules while the class is created (string annotations).
    source = (
        "from __future__ import annotations\nfrom dataclasses import dataclass\n\n"
        "@dataclass(frozen=True)\nclass Entry:\n    scale: float\n\n" + PREPARED
    )
    side = source_side(tmp_path, source, name="lib", kind=SideKind.LIBRARY, prepare="prepare")
    prepare = load_side_prepare(side)
    assert prepare is not None and callable(prepare)


def test_a_session_ends_after_an_exception_in_the_side_not_after_a_wrong_answer() -> None:
    from hopperbench.worker import process_still_sound

    def result(status: Status, graph: GraphStatus | None = None) -> SideResult:
        return SideResult(side="ours", status=status, graph_status=graph)

    assert process_still_sound(result(Status.PASSED, GraphStatus.PASSED))
    assert process_still_sound(result(Status.PASSED, GraphStatus.NOT_CAPTURABLE))
    assert process_still_sound(result(Status.FAILED))
    assert not process_still_sound(result(Status.RUNTIME_ERROR))
    assert not process_still_sound(result(Status.PASSED, GraphStatus.FAILED))


def test_a_process_warms_each_side_up_once_on_the_largest_workload(
    tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hopperbench import worker

    monkeypatch.setattr(worker, "_WARMED_UP", set())
    run_reference(tmp_path, recorder, iterations=0)
    largest = WorkloadSpec(track=TRACK, index=1, uuid="big", axes={"n": 7}, scalars={}, data_source="synthesized")
    side = kernel_side(tmp_path, "correct")
    first = job(tmp_path, side).model_copy(update={"warmup_workload": largest.model_dump(mode="json")})
    recorder.inputs_made.clear()
    assert run_job(first, deps(recorder)).status == Status.PASSED
    # One call on trial 0 of the largest workload (seed 0), before the job's own inputs.
    assert recorder.inputs_made[0] == (0, 0) and len(recorder.inputs_made) == 1 + 3 * 3
    recorder.inputs_made.clear()
    assert run_job(first, deps(recorder)).status == Status.PASSED
    assert len(recorder.inputs_made) == 3 * 3  # the same process does not warm this side up again
    # A job whose warm-up workload withholds an input (a twin's) is another kernel variant for an
    # autotuner keyed on argument types: the process warms up once more, on that workload.
    twin = first.model_copy(update={"warmup_workload": largest.without("state").model_dump(mode="json")})
    recorder.inputs_made.clear()
    assert run_job(twin, deps(recorder)).status == Status.PASSED
    assert len(recorder.inputs_made) == 1 + 3 * 3


def test_a_warm_up_that_raises_leaves_the_job_to_report_the_side(
    tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from hopperbench import worker

    monkeypatch.setattr(worker, "_WARMED_UP", set())
    run_reference(tmp_path, recorder, iterations=0)
    broken = WorkloadSpec(track=TRACK, index=1, uuid="big", axes={"n": -1}, scalars={}, data_source="synthesized")
    side = kernel_side(tmp_path, "correct")
    warmed = job(tmp_path, side).model_copy(update={"warmup_workload": broken.model_dump(mode="json")})
    assert run_job(warmed, deps(recorder)).status == Status.PASSED
    assert "warm-up on workload big raised" in capsys.readouterr().err


def test_a_side_with_a_start_up_runs_it_in_its_built_module_before_its_calls(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    assert run_job(job(tmp_path, kernel_side(tmp_path, "needs_start_up")), deps(recorder)).status == Status.FAILED
    started = kernel_side(tmp_path, "needs_start_up", start_up="warm_up")
    assert run_job(job(tmp_path, started), deps(recorder)).status == Status.PASSED


def test_a_start_up_that_raises_ends_the_job_with_its_message(tmp_path: Path, recorder: Recorder) -> None:
    run_reference(tmp_path, recorder, iterations=0)
    side = kernel_side(tmp_path, "start_up_raises", start_up="warm_up")
    result = run_job(job(tmp_path, side), deps(recorder))
    assert result.status == Status.RUNTIME_ERROR and result.message == "start-up failed: RuntimeError: no partition map"
