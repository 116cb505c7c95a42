"""Our definition JSONs: valid flashinfer-bench Definitions, equal to the official ones field by
field, embedding exactly the source of our reference modules."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
from typing import Any

import pytest
import torch
from flashinfer_bench import Definition

from hopperbench import definitions
from hopperbench.definitions import (
    DefinitionError,
    is_definition_current,
    load_definition,
    reference_runner,
    reference_source,
    render_definition,
)
from hopperbench.paths import REPO_ROOT, shared_contest_data_dir
from hopperbench.tracks import GDN_PREFILL, TRACKS, Track

ALL_TRACKS = pytest.mark.parametrize("track", list(TRACKS.values()), ids=list(TRACKS))
ALLOWED_IMPORTS = {"math", "torch", "torch.nn.functional"}


def official_json(track: Track) -> dict[str, Any]:
    data_dir = shared_contest_data_dir()
    if data_dir is None:
        pytest.skip("official contest data not found (../shared/contest_data or HOPPERBENCH_CONTEST_DATA)")
    name = track.definition_name
    return json.loads((data_dir / name / f"{name}.json").read_text())


@ALL_TRACKS
def test_definition_loads_as_flashinfer_bench_definition(track: Track) -> None:
    definition = load_definition(track)
    assert isinstance(definition, Definition)
    assert definition.name == track.definition_name
    assert definition.op_type == track.op_type
    assert "source:hopperbench" in definition.tags


@ALL_TRACKS
def test_definition_equals_official_field_by_field(track: Track) -> None:
    official = Definition.model_validate(official_json(track))
    ours = load_definition(track)
    assert ours.name == official.name
    assert ours.op_type == official.op_type
    assert list(ours.axes) == list(official.axes)
    for name, axis in official.axes.items():
        assert ours.axes[name].type == axis.type, name
        assert getattr(ours.axes[name], "value", None) == getattr(axis, "value", None), name
    for group in ("inputs", "outputs"):
        ours_specs, official_specs = getattr(ours, group), getattr(official, group)
        assert list(ours_specs) == list(official_specs), group
        for name, spec in official_specs.items():
            assert ours_specs[name].shape == spec.shape, f"{group}.{name}"
            assert ours_specs[name].dtype == spec.dtype, f"{group}.{name}"
    assert ours.constraints == official.constraints


def test_gdn_state_stays_optional_in_the_raw_json() -> None:
    """flashinfer-bench drops the key on load, so check the file itself (and the official one)."""
    raw = json.loads(GDN_PREFILL.definition_path.read_text())
    assert raw["inputs"]["state"].get("optional") is True
    assert official_json(GDN_PREFILL)["inputs"]["state"].get("optional") is True


@ALL_TRACKS
def test_embedded_reference_is_the_module_source(track: Track) -> None:
    raw = json.loads(track.definition_path.read_text())
    assert raw["reference"] == track.reference_path.read_text()
    assert is_definition_current(track)
    assert render_definition(track) == raw


def test_sync_check_passes_on_the_committed_files() -> None:
    spec = importlib.util.spec_from_file_location("sync_definitions", REPO_ROOT / "tools" / "sync_definitions.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--check"]) == 0


def test_stale_reference_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    edited = reference_source(GDN_PREFILL) + "\n# edited after the last sync\n"
    monkeypatch.setattr(definitions, "reference_source", lambda track: edited)
    assert not is_definition_current(GDN_PREFILL)
    assert render_definition(GDN_PREFILL)["reference"] == edited
    with pytest.raises(DefinitionError, match="outdated reference"):
        load_definition(GDN_PREFILL)


@ALL_TRACKS
def test_reference_signature_is_the_definition_inputs(track: Track) -> None:
    run = reference_runner(track)
    assert list(inspect.signature(run).parameters) == list(load_definition(track).inputs)


@ALL_TRACKS
def test_reference_module_is_self_contained(track: Track) -> None:
    tree = ast.parse(reference_source(track))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert imported <= ALLOWED_IMPORTS


def test_flashinfer_bench_builds_and_runs_our_reference(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The embedded text is what flashinfer-bench executes: build it as the bench would and call it."""
    from flashinfer_bench.compile.registry import BuilderRegistry

    monkeypatch.setenv("FIB_CACHE_PATH", str(tmp_path))
    runnable = BuilderRegistry.get_instance().build_reference(load_definition(GDN_PREFILL))
    gen = torch.Generator().manual_seed(0)
    total = 3
    inputs = [
        torch.randn(total, 4, 128, generator=gen).bfloat16(),
        (torch.randn(total, 4, 128, generator=gen) / 12).bfloat16(),
        torch.randn(total, 8, 128, generator=gen).bfloat16(),
        None,
        torch.zeros(8),
        torch.randn(total, 8, generator=gen).bfloat16(),
        torch.zeros(8),
        torch.randn(total, 8, generator=gen).bfloat16(),
        torch.tensor([0, 1, 3], dtype=torch.int64),
        0.0,
    ]
    built = runnable(*inputs)
    direct = reference_runner(GDN_PREFILL)(*inputs)
    assert len(built) == 2
    assert torch.equal(built[0], direct[0]) and torch.equal(built[1], direct[1])


def test_wrong_name_in_json_is_one_line_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"name": "something_else"}))
    monkeypatch.setattr(Track, "definition_path", property(lambda self: broken))
    with pytest.raises(DefinitionError, match="expected 'gdn_prefill_qk4_v8_d128_k_last'") as info:
        load_definition(GDN_PREFILL)
    assert "\n" not in str(info.value)
