"""What a track is: the spec each track folder fills in (`hopperbench/tracks/<track>/__init__.py`).

A track is one contest definition. Its spec says which definition it is, how an output is
accepted, where our kernel lives, which `human_best/` manifest entry holds the contest winner,
and which public Hopper libraries stand beside them as extra reference sides. Its folder holds
the rest under fixed names (`definition.json`, `reference.py`, `workloads.tsv`, `synth.py`,
`floor.py`, `adapters/`, optionally `offlist.tsv`), which the properties below point to.

This module imports nothing heavy (no torch): reading the registry stays cheap. A track's
`synth.py` and `floor.py` are imported only when the harness asks for them (`Track.synth`,
`Track.floor_model`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Protocol, TypeVar

from hopperbench.paths import REPO_ROOT


@dataclass(frozen=True)
class AcceptanceRule:
    """The contest's per-output acceptance rule for one track.

    An element fails only when both its absolute and its relative error exceed
    their tolerances; an output passes when the share of passing elements is at
    least `required_matched_ratio` in every trial. `outputs` lists the outputs
    that are compared (all of the definition's outputs on every track).
    """

    atol: float
    rtol: float
    required_matched_ratio: float
    outputs: tuple[str, ...]
    # Extra bound beyond the contest rule; None = not checked. The contest rule alone judges the
    # human and library sides; a stricter bound is ours to meet (see Track.ours_max_relative_l2).
    max_relative_l2: float | None = None


@dataclass(frozen=True)
class TimingDefaults:
    """Per-track overrides of the runner's timing protocol for the reference side.

    The definitions' Python references can be slow (the GDN reference steps through
    every token), so the reference side may be timed with fewer iterations than the
    kernels, or not at all (`reference_iterations=0`: it still runs once a trial for the
    outputs the other sides are gated against). `None` means: the same as the kernels.
    """

    reference_warmup: int | None = None
    reference_iterations: int | None = None
    # Seconds of warm-up and timed calls per trial of the reference: a slower call gets fewer
    # (at least one timed call), so that its cheap workloads keep the full counts.
    reference_time_budget_s: float | None = None


@dataclass(frozen=True)
class SizeClasses:
    """How the report splits a track's workloads by size: the workload axis, and the upper bound
    (inclusive) of every class but the last, ascending."""

    axis: str
    bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.bounds or list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"size class bounds must be ascending and distinct, got {self.bounds}")

    def labels(self) -> list[str]:
        """"<= 40", "41-200", ..., "> 4000"."""
        lows = [None, *self.bounds]
        labels = [f"<= {self.bounds[0]}"]
        labels += [f"{low + 1}-{high}" for low, high in zip(lows[1:], self.bounds[1:])]
        return [*labels, f"> {self.bounds[-1]}"]

    def index(self, value: int) -> int:
        """The class of a workload whose axis is `value`."""
        return next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))


class _SizedWorkload(Protocol):
    """What a sample reads of a workload (hopperbench.workloads.WorkloadSpec, which this module
    does not import)."""

    @property
    def index(self) -> int: ...

    @property
    def axes(self) -> Mapping[str, int]: ...


_W = TypeVar("_W", bound=_SizedWorkload)


@dataclass(frozen=True)
class AbsentInputSample:
    """Workloads that run a second time in the same run with an optional input passed as None (a
    twin: same uuid, axes and inputs but that one), for the report's table of that case beside the
    headline. Device time is scarce, so the sample is small and fixed: the first `per_size_class`
    workloads by index in each size class (`Track.size_classes`; the whole list is one class for a
    track without them, or a list without their axis), among the workloads whose own inputs give
    `input`."""

    input: str
    per_size_class: int

    def __post_init__(self) -> None:
        if self.per_size_class < 1:
            raise ValueError(f"a sample needs at least one workload per size class, got {self.per_size_class}")

    def select(self, workloads: Sequence[_W], size_classes: SizeClasses | None) -> list[_W]:
        """The sampled workloads of `workloads` (those that give the input), in index order."""
        if size_classes is not None and any(size_classes.axis not in w.axes for w in workloads):
            size_classes = None
        taken: dict[int, int] = {}
        chosen = []
        for workload in sorted(workloads, key=lambda w: w.index):
            group = 0 if size_classes is None else size_classes.index(int(workload.axes[size_classes.axis]))
            if taken.get(group, 0) < self.per_size_class:
                taken[group] = taken.get(group, 0) + 1
                chosen.append(workload)
        return chosen


@dataclass(frozen=True)
class LibrarySide:
    """A public Hopper library timed as an extra reference side.

    `entry` is `<file in the track's adapters/ folder>::<function>`; the adapter maps the
    definition's inputs to the library's call, in destination-passing style.
    `submodule` names the `third_party/` path that pins the library's source, if any;
    `package` the optional dependency that provides it, if any.
    """

    name: str
    entry: str
    description: str
    submodule: str | None = None
    package: str | None = None
    # What one timed call contains, in a sentence (README's library table shows it).
    timed_call: str = ""
    # `<function in the adapter file>` run once per trial, untimed, on the definition's inputs: it
    # returns the arguments `entry` takes, the inputs stored as the library keeps them (a serving
    # engine's cache layout). None: `entry` takes the definition's inputs as they are.
    prepare: str | None = None


CANDIDATE_PREFIX = "cand_"


@dataclass(frozen=True)
class CandidateSide:
    """A candidate of ours for the next version of a track's kernel, timed beside `ours` only when
    asked for (`--sides ours,cand_...`), so that a promotion is decided in one run.

    `entry` is `<file in the track's kernel folder>::<function>`; the candidate is judged by the
    same rule as `ours`. Its name starts with CANDIDATE_PREFIX, which is how results tell it from
    the reference sides.
    """

    name: str
    entry: str
    description: str

    def __post_init__(self) -> None:
        if not self.name.startswith(CANDIDATE_PREFIX):
            raise ValueError(f"candidate side {self.name!r} must be named {CANDIDATE_PREFIX}...")


def is_candidate_side(name: str) -> bool:
    return name.startswith(CANDIDATE_PREFIX)


# The fixed names of a track folder's files (see hopperbench/tracks/__init__.py).
DEFINITION_FILE = "definition.json"
REFERENCE_FILE = "reference.py"
WORKLOAD_LIST_FILE = "workloads.tsv"
OFFLIST_FILE = "offlist.tsv"
ADAPTERS_FOLDER = "adapters"
SYNTH_MODULE = "synth"
FLOOR_MODULE = "floor"


@dataclass(frozen=True)
class Track:
    name: str
    # The track's package (`hopperbench.tracks.<track>`); its folder holds the track's files.
    package: str
    definition_name: str
    op_type: str
    acceptance: AcceptanceRule
    # Our kernel, `<path relative to the repository root>::<function>`.
    kernel_entry: str
    # Key of this track in human_best/manifest.toml.
    human_key: str
    # A function (device) -> None of our entry module (and each candidate's) that sets up what a
    # serving process sets up once before its first call; idempotent, since the worker runs it,
    # untimed, before each job. None: none.
    kernel_start_up: str | None = None
    # Our embedded workload list (uuid + axes), relative to the track's folder.
    workload_list: str = WORKLOAD_LIST_FILE
    timing: TimingDefaults = field(default_factory=TimingDefaults)
    libraries: tuple[LibrarySide, ...] = ()
    candidates: tuple[CandidateSide, ...] = ()
    # A bound our kernel must meet beyond the contest rule (the MoE kernel issue: no skipped experts
    # or tokens can hide under the loose 90 % rule). Other sides are judged by the contest rule.
    ours_max_relative_l2: float | None = None
    # The library side that is the track's FlashInfer baseline of the Hopper edition, where
    # FlashInfer has an SM90 kernel (the report's headline measures against it); None: the fastest
    # library side is the baseline.
    flashinfer_baseline: str | None = None
    # The report's split of the workloads by size (README's by-size table); None: no split.
    size_classes: SizeClasses | None = None
    # The workloads that also run without one optional input (README's second table); None: none do.
    absent_input_sample: AbsentInputSample | None = None

    def acceptance_for(self, side_kind: str) -> AcceptanceRule:
        """The rule a side is judged by: the contest's, plus our own stricter bound for `ours` and
        its candidates."""
        if side_kind in ("ours", "candidate") and self.ours_max_relative_l2 is not None:
            return replace(self.acceptance, max_relative_l2=self.ours_max_relative_l2)
        return self.acceptance

    @property
    def kernel_path(self) -> Path:
        return REPO_ROOT / self.kernel_entry.split("::")[0]

    @property
    def kernel_function(self) -> str:
        return self.kernel_entry.split("::")[1]

    @property
    def folder(self) -> Path:
        """The track's folder (its package's directory)."""
        file = importlib.import_module(self.package).__file__
        assert file is not None, f"{self.package} is not a regular package"
        return Path(file).resolve().parent

    @property
    def reference_path(self) -> Path:
        return self.folder / REFERENCE_FILE

    @property
    def definition_path(self) -> Path:
        return self.folder / DEFINITION_FILE

    @property
    def workload_list_path(self) -> Path:
        return self.folder / self.workload_list

    @property
    def offlist_path(self) -> Path:
        """The track's off-list workloads (`offlist.tsv`; most tracks have none): shapes or input
        variants beyond the listed workloads, run into a results file of their own."""
        return self.folder / OFFLIST_FILE

    @property
    def adapters_dir(self) -> Path:
        return self.folder / ADAPTERS_FOLDER

    @property
    def synth(self) -> ModuleType:
        """The track's input synthesis (`<package>.synth`): `RECIPE`, `absent_optional_inputs`,
        optionally `GATE_REGIMES` and `RECIPE_VARIANTS` (see hopperbench.synth)."""
        return importlib.import_module(f"{self.package}.{SYNTH_MODULE}")

    @property
    def floor_model(self) -> ModuleType:
        """The track's roofline model (`<package>.floor`): `work(axes, inputs)` (see hopperbench.floors)."""
        return importlib.import_module(f"{self.package}.{FLOOR_MODULE}")
