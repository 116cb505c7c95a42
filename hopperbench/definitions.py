"""Our definitions: each track folder's `definition.json` and the `reference.py` it embeds.

A definition JSON is authored once (axes, inputs, outputs, constraints as the
official file) and its `reference` field is regenerated from the track's
`reference.py` by `tools/sync_definitions.py`. Loading refuses a JSON
whose embedded reference no longer matches the module, so a result is never
recorded against a definition whose reference differs from the code that ran.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from typing import Any

from flashinfer_bench import Definition

from hopperbench.tracks import Track


class DefinitionError(ValueError):
    """A definition JSON is missing, malformed, misnamed or stale."""


def reference_source(track: Track) -> str:
    """The source text of the track's reference module, exactly as embedded in its definition."""
    return track.reference_path.read_text(encoding="utf-8")


def _read_json(track: Track) -> dict[str, Any]:
    path = track.definition_path
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DefinitionError(f"{track.name}: definition file {path} is missing") from None
    except json.JSONDecodeError as exc:
        raise DefinitionError(f"{track.name}: {path.name} is not valid JSON ({exc})") from None
    if data.get("name") != track.definition_name:
        raise DefinitionError(f"{track.name}: {path.name} names {data.get('name')!r}, expected {track.definition_name!r}")
    return data


def render_definition(track: Track) -> dict[str, Any]:
    """The track's definition JSON object with `reference` set to the current module source."""
    data = _read_json(track)
    data["reference"] = reference_source(track)
    return data


def render_definition_text(track: Track) -> str:
    """The exact file text `tools/sync_definitions.py` writes for the track."""
    return json.dumps(render_definition(track), indent=2, ensure_ascii=False) + "\n"


def is_definition_current(track: Track) -> bool:
    """Whether the JSON on disk is exactly what rendering it now would write."""
    return track.definition_path.read_text(encoding="utf-8") == render_definition_text(track)


def load_definition(track: Track) -> Definition:
    """The track's definition, validated by flashinfer-bench; refuses a stale embedded reference."""
    data = _read_json(track)
    if data.get("reference") != reference_source(track):
        raise DefinitionError(
            f"{track.name}: {track.definition_path.name} embeds an outdated reference; "
            "run `uv run python tools/sync_definitions.py`"
        )
    return Definition.model_validate(data)


def reference_runner(track: Track) -> Callable[..., Any]:
    """The `run` function of the track's reference module, imported from its file."""
    path = track.reference_path
    spec = importlib.util.spec_from_file_location(f"hopperbench_reference_{track.name}", path)
    if spec is None or spec.loader is None:
        raise DefinitionError(f"{track.name}: cannot import reference module {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    run = getattr(module, "run", None)
    if not callable(run):
        raise DefinitionError(f"{track.name}: reference module {path} defines no run()")
    return run
