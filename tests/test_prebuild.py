"""Prebuilding our kernel sides: built and compiled once, the cached Runnable reused by the same
Side as the runner sends it to a worker, and inherited by jobs forked from a warmed server."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from flashinfer_bench import Definition

from hopperbench.definitions import load_definition
from hopperbench.environment import EnvironmentRecord
from hopperbench.prebuild import (
    HOPPER_ARCH,
    PREBUILD_TARGET,
    PrebuildError,
    _builder_registry,
    kernel_side,
    prebuild,
    prebuild_kernel_side,
)
from hopperbench.runner import RunnerHooks, build_parser, kernel_warm_calls, plan_run
from hopperbench.sides import SideContext
from hopperbench.tracks import TRACKS, CandidateSide, UnknownTrackError, get_track
from hopperbench.worker import WorkerJob
from hopperbench.worker_pool import ForkServerLauncher, JobFiles, WarmCall
from tests.test_sides import DEFINITION as TINY_SIDES_DEFINITION

# test_sides.py's tiny definition, as the plain data a generated warm-up module can embed.
TINY_DEFINITION = TINY_SIDES_DEFINITION.model_dump(mode="json")

# A kernel folder whose module logs (to $PREBUILD_EVENTS, with its pid) when it is imported and
# when it compiles. Its text names the test's folder, so no other test shares its solution hash.
TINY_KERNEL = textwrap.dedent(
    """
    # {folder}
    import os

    def _event(what):
        with open(os.environ["PREBUILD_EVENTS"], "a") as log:
            log.write(f"{{what}} {{os.getpid()}}\\n")

    _event("import")

    def compile_only():
        _event("compile")

    def run(x, y, out):
        out.copy_(x + 2 * y)
    """
)
NO_COMPILE_CANDIDATE = "# {folder}\ndef run(x, y, out):\n    out.copy_(x + 2 * y)\n"


@pytest.fixture(autouse=True)
def fib_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIB_CACHE_PATH", str(tmp_path / "fib_cache"))
    monkeypatch.setenv("PREBUILD_EVENTS", str(tmp_path / "events.log"))


def tiny_kernel_folder(root: Path) -> None:
    folder = root / "kernels" / "tiny"
    folder.mkdir(parents=True)
    (folder / "kernel.py").write_text(TINY_KERNEL.format(folder=folder))
    (folder / "plain.py").write_text(NO_COMPILE_CANDIDATE.format(folder=folder))


def tiny_track(root: Path):
    tiny_kernel_folder(root)
    track = replace(
        TRACKS["gdn_prefill"],
        kernel_entry="kernels/tiny/kernel.py::run",
        candidates=(
            CandidateSide(name="cand_plain", entry="plain.py::run", description="no compile_only"),
            CandidateSide(name="cand_gone", entry="gone.py::run", description="not written"),
        ),
    )
    ctx = SideContext(repo_root=root, adapters_dir=root / "adapters", manifest={})
    return track, ctx


def events(root: Path) -> list[str]:
    log = root / "events.log"
    return log.read_text().split("\n")[:-1] if log.exists() else []


def test_prebuild_compiles_once_and_the_workers_side_gets_the_cached_runnable(tmp_path: Path) -> None:
    import torch

    track, ctx = tiny_track(tmp_path)
    definition = Definition.model_validate(TINY_DEFINITION)
    runnable = prebuild(kernel_side(track, "ours", ctx), definition)
    mine = str(os.getpid())
    assert events(tmp_path) == [f"import {mine}", f"compile {mine}"]

    # The side as the runner writes it into a job file and the worker reads it back.
    job = WorkerJob(track=track.name, side=kernel_side(track, "ours", ctx), workload={"uuid": "u"}, seed=0, trials=1,
                    warmup=0, iterations=1, scratch_dir=tmp_path)  # fmt: skip
    received = WorkerJob.model_validate_json(job.model_dump_json()).side
    assert received.solution(definition).hash() == kernel_side(track, "ours", ctx).solution(definition).hash()
    assert received.build(definition) is runnable
    assert events(tmp_path) == [f"import {mine}", f"compile {mine}"]  # no second import, no second compile
    out = torch.empty(3)
    runnable(torch.ones(3), torch.arange(3.0), out)
    assert torch.equal(out, torch.tensor([1.0, 3.0, 5.0]))

    # A candidate without compile_only is built (imported) and nothing more.
    (tmp_path / "events.log").unlink()
    plain = prebuild(kernel_side(track, "cand_plain", ctx), definition)
    assert plain is not runnable and events(tmp_path) == []  # plain.py neither imports kernel.py nor compiles


def test_only_available_kernel_sides_of_ours_are_prebuilt(tmp_path: Path) -> None:
    track, ctx = tiny_track(tmp_path)
    refusals = {
        "reference": "side reference of gdn_prefill is a reference side; only ours and candidate sides are prebuilt",
        "human": "side human of gdn_prefill is a human side; only ours and candidate sides are prebuilt",
        "cand_gone": "side cand_gone of gdn_prefill is unavailable: kernels/tiny/gone.py does not exist",
        "nothing": "track gdn_prefill has no side 'nothing'",
    }
    for name, message in refusals.items():
        with pytest.raises(PrebuildError) as error:
            kernel_side(track, name, ctx)
        assert str(error.value) == message
    with pytest.raises(UnknownTrackError, match="unknown track 'tiny'"):
        prebuild_kernel_side("tiny", "ours")


def tiny_setup_module(root: Path) -> str:
    """A module the fork server imports: the tiny track and its warm call."""
    return textwrap.dedent(
        f"""
        from dataclasses import replace
        from pathlib import Path

        from flashinfer_bench import Definition

        from hopperbench.prebuild import kernel_side, prebuild
        from hopperbench.sides import SideContext
        from hopperbench.tracks import TRACKS

        DEFINITION = Definition.model_validate({TINY_DEFINITION!r})
        ROOT = Path({str(root)!r})
        TRACK = replace(TRACKS["gdn_prefill"], kernel_entry="kernels/tiny/kernel.py::run")
        CTX = SideContext(repo_root=ROOT, adapters_dir=ROOT / "adapters", manifest={{}})

        def warm():
            prebuild(kernel_side(TRACK, "ours", CTX), DEFINITION)
        """
    )


# A worker stand-in: builds the side of its job file as the worker does and runs it once.
TINY_WORKER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import torch
    from hopperbench.worker import WorkerJob
    from tiny_setup import DEFINITION

    job = WorkerJob.model_validate_json(Path(sys.argv[1]).read_text())
    out = torch.empty(2)
    job.side.build(DEFINITION)(torch.ones(2), torch.ones(2), out)
    Path(sys.argv[2]).write_text(json.dumps({"out": out.tolist()}))
    """
)


def test_jobs_forked_from_a_prebuilt_server_neither_import_nor_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    track, ctx = tiny_track(tmp_path)
    (tmp_path / "tiny_setup.py").write_text(tiny_setup_module(tmp_path))
    (tmp_path / "tiny_worker.py").write_text(TINY_WORKER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    server = ForkServerLauncher(
        [sys.executable, str(tmp_path / "tiny_worker.py")],
        ("torch", "hopperbench.worker", "tiny_setup"),
        dict(os.environ),
        tmp_path,
        cpus=None,
        log_path=tmp_path / "server.log",
        startup_timeout=120,
        warm_calls=(WarmCall(target="tiny_setup:warm"),),
    )
    job = WorkerJob(track=track.name, side=kernel_side(track, "ours", ctx), workload={"uuid": "u"}, seed=0, trials=1,
                    warmup=0, iterations=1, scratch_dir=tmp_path)  # fmt: skip
    try:
        for name in ("first", "second"):
            files = JobFiles(job=tmp_path / f"{name}.job.json", result=tmp_path / f"{name}.result.json",
                             log=tmp_path / f"{name}.log")  # fmt: skip
            files.job.write_text(job.model_dump_json())
            assert server.run(files, timeout=60).returncode == 0, files.log.read_text()
            assert json.loads(files.result.read_text()) == {"out": [3.0, 3.0]}
        assert server.ready is not None and server.ready.warmed == ["tiny_setup:warm()"]
        # Imported and compiled in the probe child and then in the server; never in a job.
        seen = [line.split() for line in events(tmp_path)]
        assert [what for what, _ in seen] == ["import", "compile", "import", "compile"]
        assert {int(pid) for _, pid in seen[2:]} == {server.ready.pid}
    finally:
        server.close()


def test_the_runner_sends_the_side_that_prebuild_builds_for_every_track(tmp_path: Path) -> None:
    hooks = RunnerHooks(
        check_devices=lambda requested: [None],
        timer_protocol=lambda: {"name": "fake-timer"},
        guard=lambda tracks, allow: {},
        collect_environment=lambda request, slot, folder: EnvironmentRecord(seed=0, protocol={}),
        show_progress=False,
    )
    args = build_parser().parse_args(
        ["--track", "all", "--max-workloads", "1", "--sides", "ours,reference", "--output", str(tmp_path / "r.json")]
    )
    plan = plan_run(args, hooks)
    assert kernel_warm_calls(plan, PREBUILD_TARGET) == [
        WarmCall(target=PREBUILD_TARGET, args=[name, "ours"]) for name in TRACKS
    ]
    for tp in plan.tracks:
        (ours,) = [s for s in tp.sides if s.name == "ours"]
        job = WorkerJob(track=tp.track.name, side=ours, workload=tp.workloads[0].model_dump(mode="json"), seed=0,
                        trials=1, warmup=0, iterations=1, scratch_dir=tmp_path)  # fmt: skip
        received = WorkerJob.model_validate_json(job.model_dump_json()).side
        definition = load_definition(tp.track)
        prebuilt = kernel_side(get_track(tp.track.name), "ours")
        assert received.solution(definition).hash() == prebuilt.solution(definition).hash()


def test_prebuilding_a_real_kernel_leaves_nothing_to_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """dsa_attention (one CuTe-DSL compile, a few seconds on the CPU): after the prebuild the
    worker's build is the cached Runnable and its compile_only finds everything compiled."""
    import cutlass.cute as cute

    track = get_track("dsa_attention")
    prebuild_kernel_side(track.name, "ours")
    runnable = kernel_side(track, "ours").build(load_definition(track))
    module = sys.modules[runnable.metadata.misc["module_name"]]

    def no_more_compiles(*args, **kwargs):
        raise AssertionError("cute.compile called after the prebuild")

    monkeypatch.setattr(cute, "compile", no_more_compiles)
    module.compile_only()
    assert module.GPU_ARCH == HOPPER_ARCH  # the architecture the runner gives CuTe-DSL (CUTE_DSL_ARCH)


def test_every_kernel_compiles_for_the_architecture_the_runner_sets() -> None:
    for track in TRACKS.values():
        runnable = kernel_side(track, "ours").build(load_definition(track))
        assert sys.modules[runnable.metadata.misc["module_name"]].GPU_ARCH == HOPPER_ARCH, track.name


def test_the_builder_registry_is_made_without_initialising_the_cuda_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch builder's availability check runs on NVML (no cuInit) while the registry that the
    jobs inherit is made, and the setting does not outlive it."""
    from flashinfer_bench.compile import BuilderRegistry
    from flashinfer_bench.compile.builders import TorchBuilder

    asked_with: list[str | None] = []

    def is_available() -> bool:
        asked_with.append(os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"))
        return False

    monkeypatch.setattr(BuilderRegistry, "_instance", None)
    monkeypatch.setattr(TorchBuilder, "is_available", staticmethod(is_available))
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    registry = _builder_registry()
    assert asked_with == ["1"] and "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    assert BuilderRegistry.get_instance() is registry and asked_with == ["1"]
