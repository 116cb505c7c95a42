"""The sides of a comparison and how each becomes a flashinfer-bench Solution.

A side is one implementation of a track's definition: `ours` (kernels/<track>/),
`human` (the contest winner, pinned under human_best/), `reference` (the
definition's own Python reference) and one side per public Hopper library the track
lists. Every side is built from its files, unmodified, by flashinfer-bench's builder
registry, and called positionally in definition order.

Sides are found by resolvers, one per kind, listed in `SIDE_RESOLVERS`; adding a kind
of side means adding a resolver there, not changing the runner or the worker.

This module imports flashinfer-bench only when a side is built, so that reading side
names (results, rendering) stays cheap.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from hopperbench.paths import REPO_ROOT
from hopperbench.tracks import Track, is_candidate_side

if TYPE_CHECKING:
    import torch
    from flashinfer_bench import Definition, Solution
    from flashinfer_bench.compile import Runnable

OURS = "ours"
HUMAN = "human"
REFERENCE = "reference"
FIXED_SIDES = (OURS, HUMAN, REFERENCE)

AUTHOR = {OURS: "hopperbench", REFERENCE: "definition"}


class SideKind(StrEnum):
    OURS = "ours"
    HUMAN = "human"
    REFERENCE = "reference"
    LIBRARY = "library"
    CANDIDATE = "candidate"


class SideError(ValueError):
    """A side cannot be turned into a Solution (it is unavailable or its files are unusable)."""


class Side(BaseModel):
    """One implementation of one track, and where its files are.

    `files` are relative to `source_dir`; `entry_point` is `<file>::<function>` with the
    file among `files`. The reference side has no files: its source is the definition's
    `reference` text, as flashinfer-bench's `build_reference` does it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    kind: SideKind
    track: str
    available: bool
    reason: str | None = None
    source_dir: Path | None = None
    files: tuple[str, ...] = ()
    entry_point: str = ""
    language: str = "python"
    destination_passing_style: bool = True
    # Human side only: whether the submodule is at its pinned commit and clean (None = not checked).
    pinned: bool | None = None
    description: str = ""
    # Library sides: a function of the entry file run untimed once per trial on the definition's
    # inputs, returning them stored as the library keeps them (see LibrarySide.prepare).
    prepare: str | None = None
    # Ours and candidates: a function of the entry module run untimed before each job's first call
    # (Track.kernel_start_up; see `run_start_up`).
    start_up: str | None = None

    def solution(self, definition: Definition) -> Solution:
        """This side as a flashinfer-bench Solution, its sources read from disk as they are."""
        from flashinfer_bench import BuildSpec, Solution, SourceFile

        if not self.available:
            raise SideError(f"side {self.name} of {self.track} is unavailable: {self.reason}")
        if self.kind == SideKind.REFERENCE:
            sources = [SourceFile(path="main.py", content=definition.reference)]
            entry_point = "main.py::run"
        else:
            assert self.source_dir is not None
            sources = [SourceFile(path=f, content=_read_source(self.source_dir / f)) for f in self.files]
            entry_point = self.entry_point
        return Solution(
            name=f"{self.track}__{self.name}",
            definition=definition.name,
            author=AUTHOR.get(self.name, self.name),
            spec=BuildSpec(
                language=self.language,
                target_hardware=["cuda"],
                entry_point=entry_point,
                destination_passing_style=self.destination_passing_style,
            ),
            sources=sources,
            description=self.description or self.name,
        )

    def build(self, definition: Definition) -> Runnable:
        """Build with flashinfer-bench's builder registry; the Runnable takes positional arguments."""
        from flashinfer_bench.compile import BuilderRegistry

        return BuilderRegistry.get_instance().build(definition, self.solution(definition))


def run_start_up(side: Side, runnable: Runnable, device: torch.device) -> None:
    """Run the side's start-up function (`Side.start_up`) on `device`, from the module the builder
    imported for `runnable` (so it sets up the state that the built entry reads); nothing for a side
    without one."""
    if side.start_up is None:
        return
    module = sys.modules[runnable.metadata.misc["module_name"]]
    start_up = getattr(module, side.start_up, None)
    if not callable(start_up):
        raise SideError(f"side {side.name} of {side.track}: its entry module has no function {side.start_up}")
    start_up(device)


def _read_source(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SideError(f"cannot read source file {path}: {e}") from None


def _unavailable(track: Track, name: str, kind: SideKind, reason: str, **fields: Any) -> Side:
    return Side(name=name, kind=kind, track=track.name, available=False, reason=reason, **fields)


def _text_files(folder: Path) -> tuple[str, ...]:
    """Top-level, non-hidden, non-empty text files: what a Solution can carry as SourceFiles."""
    names = []
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.name.startswith(".") or path.suffix in {".pyc", ".so", ".o"}:
            continue
        try:
            if path.read_text(encoding="utf-8").strip():
                names.append(path.name)
        except UnicodeDecodeError:
            continue
    return tuple(names)


# ------------------------------------------------------------------------------------------
# Resolvers: (track, context) -> sides of one kind


class SideContext(BaseModel):
    """What resolvers may consult besides the track."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    repo_root: Path = REPO_ROOT
    # Where library adapters are found; None = each track's own `adapters/` folder.
    adapters_dir: Path | None = None
    # Per track, hopperbench.integrity.GuardResult for the human side (None = guard not run).
    guard_results: Mapping[str, Any] | None = None
    # human_best manifest entries by track (None = load human_best/manifest.toml).
    manifest: Mapping[str, Any] | None = None


def _kernel_folder_side(
    track: Track, ctx: SideContext, name: str, kind: SideKind, entry: str, description: str, missing: str
) -> Side:
    """A side of ours from `entry` (`<path relative to the repository root>::<function>`) in the
    track's kernel folder. Its Solution carries the whole folder, so the entry may import its
    siblings (a candidate imports the current kernel)."""
    file_rel, _, function = entry.partition("::")
    path = ctx.repo_root / file_rel
    if not path.is_file():
        return _unavailable(track, name, kind, f"{file_rel} {missing}", description=description)
    return Side(
        name=name,
        kind=kind,
        track=track.name,
        available=True,
        source_dir=path.parent,
        files=_text_files(path.parent),
        entry_point=f"{path.name}::{function}",
        language="python",  # CuTe-DSL ships as python in flashinfer-bench
        destination_passing_style=True,
        description=description,
        start_up=track.kernel_start_up,
    )


def resolve_ours(track: Track, ctx: SideContext) -> list[Side]:
    kernel_rel = track.kernel_entry.split("::")[0]
    return [
        _kernel_folder_side(track, ctx, OURS, SideKind.OURS, track.kernel_entry, f"our kernel, {kernel_rel}",
                            "does not exist yet")  # fmt: skip
    ]


_LANGUAGE_FOR_BUILDER = {"cutedsl": "python"}


def resolve_candidates(track: Track, ctx: SideContext) -> list[Side]:
    """The track's registered candidates, built like `ours` from the same kernel folder."""
    folder_rel = Path(track.kernel_entry.split("::")[0]).parent
    return [
        _kernel_folder_side(track, ctx, c.name, SideKind.CANDIDATE, f"{folder_rel / c.entry}", c.description,
                            "does not exist")  # fmt: skip
        for c in track.candidates
    ]


def resolve_human(track: Track, ctx: SideContext) -> list[Side]:
    manifest = ctx.manifest
    if manifest is None:
        from hopperbench.human_best import ManifestError, load_manifest

        try:
            manifest = load_manifest()
        except ManifestError as e:
            return [_unavailable(track, HUMAN, SideKind.HUMAN, str(e))]
    entry = manifest.get(track.human_key)
    if entry is None:
        return [_unavailable(track, HUMAN, SideKind.HUMAN, f"no [{track.human_key}] entry in human_best/manifest.toml")]

    pinned: bool | None = None
    if ctx.guard_results is not None and track.name in ctx.guard_results:
        verdict = ctx.guard_results[track.name]  # hopperbench.integrity.GuardResult
        if not verdict.runs_human:
            return [_unavailable(track, HUMAN, SideKind.HUMAN, verdict.reason or "the integrity guard refused it")]
        pinned = verdict.human_pinned

    not_here = f"{entry.team}'s code ({entry.url}) {entry.availability}"
    if entry.entry is None or entry.source_dir is None:
        return [_unavailable(track, HUMAN, SideKind.HUMAN, f"{not_here}; its entry point is unknown", pinned=pinned)]
    if entry.language == "unknown" or entry.destination_passing == "unknown":
        return [_unavailable(track, HUMAN, SideKind.HUMAN, f"{not_here}; its calling convention is unknown")]
    source_dir = entry.checkout_dir(ctx.repo_root) / entry.source_dir
    missing = [p for p in entry.solution_paths(ctx.repo_root) if not p.is_file()]
    if missing:
        return [_unavailable(track, HUMAN, SideKind.HUMAN, not_here, pinned=pinned)]
    return [
        Side(
            name=HUMAN,
            kind=SideKind.HUMAN,
            track=track.name,
            available=True,
            source_dir=source_dir,
            files=tuple(entry.solution_files),
            entry_point=entry.entry,
            language=_LANGUAGE_FOR_BUILDER.get(entry.language, entry.language),
            destination_passing_style=bool(entry.destination_passing),
            pinned=pinned,
            description=f"{entry.team}, {entry.url}@{entry.commit}",
        )
    ]


def resolve_reference(track: Track, ctx: SideContext) -> list[Side]:
    return [
        Side(
            name=REFERENCE,
            kind=SideKind.REFERENCE,
            track=track.name,
            available=True,
            language="python",
            destination_passing_style=False,  # references return their outputs
            description=f"the definition's reference ({_shown(track.reference_path, REPO_ROOT)})",
        )
    ]


def resolve_libraries(track: Track, ctx: SideContext) -> list[Side]:
    sides = []
    for library in track.libraries:
        if library.name in FIXED_SIDES:
            raise SideError(f"library side of {track.name} may not be called {library.name!r}")
        file, _, function = library.entry.partition("::")
        adapter = (ctx.adapters_dir or track.adapters_dir) / file
        reason = None
        if not adapter.is_file():
            reason = f"{_shown(adapter, ctx.repo_root)} does not exist yet"
        elif library.package and (missing := _unmet_requirement(library.package)):
            reason = missing
        elif library.submodule and not library.package and not _populated(ctx.repo_root / library.submodule):
            # A library built from its submodule is pinned by its installed version (which carries
            # the commit); only a library imported from the checkout itself needs the files here.
            reason = f"{library.submodule} is not checked out"
        if reason:
            sides.append(_unavailable(track, library.name, SideKind.LIBRARY, reason, description=library.description))
            continue
        sides.append(
            Side(
                name=library.name,
                kind=SideKind.LIBRARY,
                track=track.name,
                available=True,
                source_dir=adapter.parent,
                files=(adapter.name,),
                entry_point=f"{adapter.name}::{function}",
                language="python",
                destination_passing_style=True,
                description=library.description,
                prepare=library.prepare,
            )
        )
    return sides


def _shown(path: Path, root: Path) -> str:
    """`path` relative to `root` where it lies below it, else as it is."""
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _unmet_requirement(requirement: str) -> str | None:
    """Why an installed-package requirement such as `fla-core==0.6.0` is not met, or None."""
    from packaging.requirements import Requirement  # matplotlib's dependency, always present

    wanted = Requirement(requirement)
    try:
        installed = importlib.metadata.version(wanted.name)
    except importlib.metadata.PackageNotFoundError:
        return f"package {wanted.name} is not installed (needs {requirement})"
    if wanted.specifier and not wanted.specifier.contains(installed, prereleases=True):
        return f"package {wanted.name} {installed} is installed, the adapter needs {requirement}"
    return None


def _populated(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


SideResolver = Callable[[Track, SideContext], list[Side]]

# In reporting order. The reference must stay: every other side is checked against it.
SIDE_RESOLVERS: dict[SideKind, SideResolver] = {
    SideKind.OURS: resolve_ours,
    SideKind.HUMAN: resolve_human,
    SideKind.REFERENCE: resolve_reference,
    SideKind.LIBRARY: resolve_libraries,
    SideKind.CANDIDATE: resolve_candidates,
}


def sides_for(track: Track, ctx: SideContext | None = None) -> list[Side]:
    """Every side of `track`, available or not (an unavailable side says why)."""
    ctx = ctx or SideContext()
    sides = [side for resolver in SIDE_RESOLVERS.values() for side in resolver(track, ctx)]
    names = [s.name for s in sides]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SideError(f"track {track.name} has several sides named {', '.join(duplicates)}")
    return sides


def known_side_names(tracks: Iterable[Track]) -> list[str]:
    """Side names that exist for any of `tracks`, without touching the disk."""
    names = list(FIXED_SIDES)
    for track in tracks:
        names += [lib.name for lib in track.libraries if lib.name not in names]
        names += [c.name for c in track.candidates if c.name not in names]
    return names


def canonical_side_order(names: Iterable[str]) -> list[str]:
    """ours, its candidates, human, reference, then the library sides, alphabetically within groups."""
    unique = set(names)
    candidates = sorted(n for n in unique if is_candidate_side(n))
    libraries = sorted(unique - set(FIXED_SIDES) - set(candidates))
    return [n for n in (OURS, *candidates, HUMAN, REFERENCE, *libraries) if n in unique]
