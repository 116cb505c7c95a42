"""Every entry the runner builds from our kernel folders (`kernel.py::run` and each registered candidate) takes
exactly the definition's inputs then its outputs as positional parameters: flashinfer-bench's builder refuses any
other count for a destination-passing solution, so a stray optional parameter would fail every workload of a run
(and lose that side of an A/B). Every library side's adapter entry passes the builder's count too (keyword-only
parameters count). Where the track names a start-up function (`Track.kernel_start_up`), each of those modules has
it, taking the device. Imports our modules on the CPU, reads the adapters' source; no GPU."""

from __future__ import annotations

import ast
import inspect

import pytest

from hopperbench.devcheck import load_folder_module
from hopperbench.tracks import TRACKS
from hopperbench.workloads import track_definition

ENTRIES = [
    (track.name, track.kernel_entry.split("/")[-1])
    for track in TRACKS.values()
] + [(track.name, side.entry) for track in TRACKS.values() for side in track.candidates]


@pytest.mark.parametrize(("track_name", "entry"), ENTRIES, ids=[f"{t}:{e}" for t, e in ENTRIES])
def test_entry_takes_the_definitions_inputs_then_outputs(track_name: str, entry: str) -> None:
    track = TRACKS[track_name]
    file_name, function_name = entry.split("::")
    module = load_folder_module(track.kernel_path.parent, f"signature_check_{track_name}", file_name.removesuffix(".py"))
    parameters = inspect.signature(getattr(module, function_name)).parameters.values()
    definition = track_definition(track_name)
    expected = [*definition.inputs, *definition.outputs]
    assert all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
    assert [p.name for p in parameters] == list(expected)
    if track.kernel_start_up is not None:
        start_up = getattr(module, track.kernel_start_up)
        assert list(inspect.signature(start_up).parameters) == ["device"]


LIBRARY_ENTRIES = [(track.name, side.name) for track in TRACKS.values() for side in track.libraries]


def _builder_parameter_count(function: ast.FunctionDef) -> tuple[int, bool]:
    """What flashinfer-bench's builder counts in a callable's signature: every named parameter, keyword-only ones
    included (not *args or **kwargs), and whether it has *args."""
    arguments = function.args
    named = len(arguments.posonlyargs) + len(arguments.args) + len(arguments.kwonlyargs)
    return named, arguments.vararg is not None


@pytest.mark.parametrize(("track_name", "side_name"), LIBRARY_ENTRIES, ids=[f"{t}:{s}" for t, s in LIBRARY_ENTRIES])
def test_library_entry_passes_the_builders_parameter_count(track_name: str, side_name: str) -> None:
    # Read from the adapter's source, as CI lacks the libraries the adapters import.
    track = TRACKS[track_name]
    side = next(side for side in track.libraries if side.name == side_name)
    file_name, function_name = side.entry.split("::")
    tree = ast.parse((track.adapters_dir / file_name).read_text())
    (function,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function_name]
    named, has_var_positional = _builder_parameter_count(function)
    definition = track_definition(track_name)
    expected = len(definition.inputs) + len(definition.outputs)
    assert named <= expected if has_var_positional else named == expected
