"""Every entry the runner builds from our kernel folders (`kernel.py::run` and each registered candidate) takes
exactly the definition's inputs then its outputs as positional parameters: flashinfer-bench's builder refuses any
other count for a destination-passing solution, so a stray optional parameter would fail every workload of a run
(and lose that side of an A/B). Where the track names a start-up function (`Track.kernel_start_up`), each of those
modules has it, taking the device. Imports the modules on the CPU; no GPU."""

from __future__ import annotations

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
