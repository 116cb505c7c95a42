"""Shared plumbing of the device checks (kernels/<track>/probes/device_check_<track>.py) and the kernel tests.

A device check compiles one of our kernels, runs it on every case of its folder's
`check_cases.py`, compares with our reference under the track's acceptance rule, times it
with CUDA events and prints one table row per case. Everything here is what the three
checks had in common; the cases, the rows' columns and the extra checks (split sweep,
bitwise repeat, ...) stay in each tool.

Importing this module needs no GPU; the timing and graph helpers need CUDA when called.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from hopperbench.acceptance import Verdict

EXIT_PASSED = 0
EXIT_FAILED = 1
# Distinct from a failure, so that a batch script can tell "no GPU here" from "the kernel is wrong".
EXIT_NO_DEVICE = 2


class UnknownCaseError(ValueError):
    """A case name on the command line that the check_cases module does not define."""


class NamedCase(Protocol):
    @property
    def name(self) -> str: ...


CaseT = TypeVar("CaseT", bound=NamedCase)


def load_module_by_path(path: Path, name: str) -> ModuleType:
    """Import a file as module `name`.

    kernels/ is not a package (the harness packs each folder as a solution), so its files
    are loaded by path. The module is registered in sys.modules before it runs because
    dataclasses and the CuTe DSL look their defining module up by name.
    """
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_folder_module(folder: Path, package: str, name: str) -> ModuleType:
    """Import `folder/<name>.py` as module `<package>.<name>` of a package made of `folder` (no
    __init__.py needed), so that its relative imports of siblings resolve as they do in the
    harness's packed solution."""
    if package not in sys.modules:
        module = ModuleType(package)
        module.__path__ = [str(folder)]
        sys.modules[package] = module
    return importlib.import_module(f"{package}.{name}")


def select_cases(cases: Sequence[CaseT], names: str) -> list[CaseT]:
    """The cases named in a comma list (in the list's order), or all of them for an empty list."""
    wanted = [n for n in names.split(",") if n]
    if not wanted:
        return list(cases)
    by_name = {c.name: c for c in cases}
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise UnknownCaseError(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(by_name)}")
    return [by_name[n] for n in wanted]


def case_check_parser(description: str, iters: int, warmup: int) -> argparse.ArgumentParser:
    """The flags every device check takes; a tool adds its own before parsing.

    The defaults differ per track (a DSA call takes microseconds, a long GDN case seconds),
    so they are arguments.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--iters", type=int, default=iters, help="timed calls per case")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed calls per case before timing")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def require_cuda(tool: str) -> bool:
    """True when a CUDA device is usable; otherwise says so in one line on stderr."""
    if torch.cuda.is_available():
        return True
    print(f"{tool}: no CUDA device", file=sys.stderr)
    return False


def device_line() -> str:
    """The GPU and torch version, first line of every check's output (results are per machine)."""
    props = torch.cuda.get_device_properties(0)
    return (
        f"device: {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs), "
        f"torch {torch.__version__}"
    )


def load_and_compile(load_kernel: Callable[[], ModuleType], what: str) -> ModuleType:
    """Load the kernel module and compile it up front, printing how long that took, so that
    compile time is reported on its own and never lands in the first case's timing."""
    started = time.perf_counter()
    kernel = load_kernel()
    kernel.compile_only()
    print(f"compile: {time.perf_counter() - started:.1f} s ({what})")
    return kernel


def start(
    tool: str, select: Callable[[], list[CaseT]], load_kernel: Callable[[], ModuleType], what: str
) -> tuple[list[CaseT], ModuleType] | None:
    """The opening every device check shares, in the order its output relies on.

    Without a CUDA device: one line on stderr and None (the tool exits with EXIT_NO_DEVICE
    before judging anything else). Then the cases: an unknown name ends the program with
    its one-line message (exit 1). Then the device line and the compile, so that a broken
    compile shows before any case runs. Returns the selected cases and the compiled kernel.
    """
    if not require_cuda(tool):
        return None
    try:
        selected = select()
    except UnknownCaseError as error:
        raise SystemExit(str(error)) from None
    print(device_line())
    return selected, load_and_compile(load_kernel, what)


def median_cuda_time_us(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median time of one call in microseconds, from CUDA events around each call.

    Warm L2 and back-to-back launches: indicative only; the benchmark runner does the
    real cold-L2 CUPTI timing. One synchronize at the end keeps the host out of the way.
    """
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, stop in zip(starts, stops):
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, stops)) * 1e3


def capture_graph(call: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """Capture one call in a CUDA graph. The call runs once outside the capture first, so that
    compilation and lazy allocation happen there and not inside the graph."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def refill_inputs(static: MutableMapping[str, object], fresh: Mapping[str, object]) -> None:
    """Copy fresh tensor inputs into the captured ones in place (a replayed graph reads the
    captured addresses); scalars are baked into the graph and stay as captured."""
    for name, value in fresh.items():
        if isinstance(value, torch.Tensor):
            target = static[name]
            assert isinstance(target, torch.Tensor), f"input {name} was not a tensor at capture"
            target.copy_(value)


def replay_on_fresh_inputs(
    call: Callable[[], object],
    static: MutableMapping[str, object],
    fresh: Mapping[str, object],
    outputs: Sequence[torch.Tensor],
) -> torch.cuda.CUDAGraph:
    """Capture `call` (which reads `static` and writes `outputs`), refill `static` with
    `fresh`, fill the outputs with NaN, replay once and wait for it.

    This is what serving under CUDA graphs asks of a kernel: a replay must follow the new
    input values, not the captured ones, and write every output element (the NaN shows any
    it leaves). Returns the graph, so that its replays can be timed.
    """
    graph = capture_graph(call)
    refill_inputs(static, fresh)
    for output in outputs:
        output.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def total_nan(verdict: Verdict) -> int | None:
    """NaN elements over all outputs of a verdict; None when an output could not be compared."""
    counts = [stats.nan_count for stats in verdict.outputs.values()]
    return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)


def pass_mark(passed: bool) -> str:
    return "ok" if passed else "FAIL"


@dataclass(frozen=True)
class Column:
    """One right-aligned table column: its title, width and the format spec after the width."""

    title: str
    width: int
    spec: str = ""


@dataclass(frozen=True)
class Table:
    """A fixed-width table: a left-aligned name column, then right-aligned columns.

    Fixed widths keep the rows of one run aligned as they are printed, one per case,
    without waiting for the whole table.
    """

    name_title: str
    name_width: int
    columns: tuple[Column, ...]

    def header(self) -> str:
        return f"{self.name_title:<{self.name_width}}" + "".join(f" {c.title:>{c.width}}" for c in self.columns)

    def row(self, name: str, *values: object, note: str = "") -> str:
        """One row; a None value (a statistic that could not be computed) prints as '-'."""
        if len(values) != len(self.columns):
            raise ValueError(f"{len(values)} values for {len(self.columns)} columns")
        cells = (
            f" {'-':>{c.width}}" if v is None else f" {v:>{c.width}{c.spec}}" for c, v in zip(self.columns, values)
        )
        return f"{name:<{self.name_width}}" + "".join(cells) + note


def run_checks(
    checks: Iterable[tuple[str, Callable[[], bool]]],
    name_width: int,
    after_each: Callable[[], None] | None = None,
) -> bool:
    """Run every named check; True if all passed.

    An exception fails its check with one line in the table (and a short traceback on
    stderr) and the next check still runs: one broken case must not hide the others.
    """
    all_passed = True
    for name, check in checks:
        try:
            passed = check()
        except Exception as error:
            passed = False
            message = str(error).splitlines()[0] if str(error) else ""
            print(f"{name:<{name_width}} ERROR {type(error).__name__}: {message}")
            traceback.print_exc(limit=3, file=sys.stderr)
        all_passed &= passed
        if after_each is not None:
            after_each()
    return all_passed


def finish(all_passed: bool) -> int:
    """Print the last line of a check and return its exit code."""
    print("ALL PASSED" if all_passed else "SOME CASES FAILED")
    return EXIT_PASSED if all_passed else EXIT_FAILED
