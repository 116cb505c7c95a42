"""The package layout: a track is one folder, the core names no track, and nothing imports in a cycle."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hopperbench.paths import PACKAGE_DIR, REPO_ROOT
from hopperbench.tracks import TRACK_PACKAGES, TRACKS, LibrarySide, Track

TRACKS_DIR = PACKAGE_DIR / "tracks"
# The harness core: every module of the package outside hopperbench/tracks/.
CORE_FILES = sorted(p for p in PACKAGE_DIR.rglob("*.py") if TRACKS_DIR not in p.parents)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}


def test_the_registry_lists_every_track_folder() -> None:
    folders = {p.parent.name for p in TRACKS_DIR.glob("*/__init__.py")}
    assert folders == set(TRACK_PACKAGES)
    assert list(TRACKS) == list(TRACK_PACKAGES)


@pytest.mark.parametrize("track", TRACKS.values(), ids=lambda t: t.name)
def test_a_track_folder_holds_the_whole_track(track: Track) -> None:
    assert track.folder == TRACKS_DIR / track.name
    for path in (track.definition_path, track.reference_path, track.workload_list_path):
        assert path.parent == track.folder and path.is_file()
    for library in track.libraries:
        assert (track.adapters_dir / library.entry.split("::")[0]).is_file()
    assert callable(track.floor_model.work)
    assert callable(track.synth.absent_optional_inputs)
    # Every tensor input is drawn by the track's recipe (scalars may come from the workload).
    inputs = json.loads(track.definition_path.read_text())["inputs"]
    tensors = {name for name, spec in inputs.items() if spec.get("shape") is not None}
    assert tensors <= set(track.synth.RECIPE) <= set(inputs)


@pytest.mark.parametrize("track", [t for t in TRACKS.values() if t.absent_input_sample], ids=lambda t: t.name)
def test_an_absent_input_sample_withholds_an_optional_input(track: Track) -> None:
    assert track.absent_input_sample is not None
    inputs = json.loads(track.definition_path.read_text())["inputs"]
    assert inputs[track.absent_input_sample.input].get("optional") is True


# What a library adapter may import besides the standard library and torch: its own library, where it
# imports it by name (the others load theirs through importlib, after checking the pinned version), fla's
# Triton, whose autotuner caches the fla side fills with its pinned configurations, and Triton for the one
# fused gating kernel FlashInfer's GDN side runs before FlashInfer's kernels, as serving engines do.
ADAPTER_LIBRARY_IMPORTS = {
    "flashinfer_gdn": {"flashinfer", "triton"},
    "fla_chunk": {"fla", "triton"},
    "flashinfer_moe": {"flashinfer"},
}
LIBRARY_SIDES = [pytest.param(t, lib, id=lib.name) for t in TRACKS.values() for lib in t.libraries]


@pytest.mark.parametrize(("track", "library"), LIBRARY_SIDES)
def test_a_library_adapter_imports_only_stdlib_torch_and_its_library(track: Track, library: LibrarySide) -> None:
    """An adapter is one self-contained file (its side's Solution carries only it)."""
    tree = ast.parse((track.adapters_dir / library.entry.split("::")[0]).read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"} | ADAPTER_LIBRARY_IMPORTS.get(library.name, set())
    assert imported <= allowed


def test_no_core_module_names_a_track() -> None:
    """Dispatch goes through the Track: no string in the core equals a track's name."""
    found = [
        f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {node.value!r}"
        for path in CORE_FILES
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and node.value in TRACK_PACKAGES
    ]
    assert found == []


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules that `name` imports anywhere in its file (functions included)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                module = ".".join(base + ([module] if module else []))
            found |= {f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names}
    return {m for m in found if m in MODULES and m != name}


def test_no_module_imports_in_a_cycle() -> None:
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            pytest.fail("import cycle: " + " -> ".join([*stack[stack.index(name) :], name]))
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    # The track modules build on the core's machinery, which reaches them only through the registry.
    assert "hopperbench.synth" in graph["hopperbench.tracks.moe.synth"]
    assert not any(m.startswith("hopperbench.tracks.") for m in graph["hopperbench.synth"] | graph["hopperbench.floors"])


def test_the_registry_imports_no_torch() -> None:
    code = "import sys, hopperbench.tracks as t; t.TRACKS['moe'].definition_path; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


# A kernel file describes the code as it is: its history (work-period numbers, version names of
# earlier kernels, dated result files) lives in git and in the ideas table of the kernel's NOTES.md.
HISTORY = re.compile(r"\bv\d+\.\d+\b|\bsessions? \d+\b|\bissue #?\d+\b|\b20\d\d-\d\d-\d\d\b", re.IGNORECASE)


def test_kernel_code_carries_no_history() -> None:
    found = [
        f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
        for path in sorted((REPO_ROOT / "kernels").rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert not found, "\n".join(found)
