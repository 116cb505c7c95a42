"""The workload list of a track: official when downloaded, else our embedded list.

Official data lives in `benchmark_data/` (or another `data_dir`) in flashinfer-trace
layout, as `tools/download_workloads.py` writes it:
`workloads/<op_type>/<definition>.jsonl` plus the safetensors blobs the lines point to.
When that JSONL exists for a track, its workloads are read with flashinfer-bench's own
models and marked `official`. An input the JSONL declares as safetensors whose blob file
or tensor key is absent (a partial download, or the MoE JSONL 3dbeca5a that names six
tensors the blobs never held) is synthesized instead; `missing_blob_inputs` records it,
and the workload stays `official` because its uuid, axes and scalars still are.

Without official data the track's embedded `workloads.tsv` is used and every tensor
is synthesized (`hopperbench.synth`), marked `synthesized`. Its header comments give the
provenance: MoE is byte-exact from the official JSONL, GDN prefill and DSA are
reconstructed tables.

A track may also keep off-list workloads (`offlist.tsv`, `load_offlist`): synthesized rows beyond
the listed ones, each naming a variant of the track's input recipe (`recipe_variant` column, e.g.
MoE's routing patterns), for a results file of their own, never the canonical run.

Every list is validated on load against our definition: exactly the definition's var
axes, each >= 1; scalars that are scalar inputs of the right kind; dense indices; unique
uuids; and every definition constraint that mentions axes only
(e.g. `len_cu_seqlens == num_seqs + 1`).
"""

from __future__ import annotations

import ast
import csv
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Literal

from flashinfer_bench.data import Definition, SafetensorsInput, ScalarInput, Trace, load_jsonl_file
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from safetensors import SafetensorError, safe_open

from hopperbench.definitions import load_definition
from hopperbench.paths import BENCHMARK_DATA_DIR
from hopperbench.tracks import Track, get_track

DataSource = Literal["official", "synthesized"]
# Which list a run takes: the track's listed workloads (official or embedded), or its off-list ones.
WorkloadList = Literal["listed", "offlist"]
WORKLOAD_LISTS: tuple[WorkloadList, ...] = ("listed", "offlist")
OFFLIST: WorkloadList = "offlist"
# The protocol entry an off-list run records (its value OFFLIST), so that its rows never pass for
# the listed workloads' (a resume under the other list, a merge into the canonical run).
WORKLOAD_LIST_PROTOCOL_KEY = "workload_list"
ScalarValue = int | float


class WorkloadError(ValueError):
    """A workload list (embedded or official) is malformed or inconsistent with its definition."""


class WorkloadSelectionError(ValueError):
    """A requested workload selection (uuids, count) cannot be satisfied."""


class BlobRef(BaseModel):
    """One official input tensor: an absolute safetensors path and the tensor's key in it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Path
    tensor_key: str = Field(min_length=1)


class WorkloadSpec(BaseModel):
    """One workload of a track: its identity, axis values, scalar inputs and official blobs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    track: str
    index: int = Field(ge=0)
    uuid: str = Field(min_length=1)
    # Var axes only; const axes come from the definition.
    axes: dict[str, int]
    # Scalar inputs the workload fixes; the rest are supplied by hopperbench.synth.
    scalars: dict[str, ScalarValue]
    data_source: DataSource
    # Input name -> blob, official data only.
    blob_inputs: dict[str, BlobRef] = Field(default_factory=dict)
    # Inputs the official workload declares as safetensors but whose blob is absent; synthesized.
    missing_blob_inputs: tuple[str, ...] = ()
    # Optional inputs passed as None although the workload gives them (sorted): the twin of a
    # workload in its track's `absent_input_sample`, a row of its own beside the workload's.
    withheld_inputs: tuple[str, ...] = ()
    # The track recipe's variant its inputs are drawn with (`RECIPE_VARIANTS` of the track's synth,
    # e.g. MoE's routing patterns); off-list workloads only, None for the listed ones.
    recipe_variant: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _blobs_only_when_official(self) -> WorkloadSpec:
        if self.data_source == "synthesized" and (self.blob_inputs or self.missing_blob_inputs):
            raise ValueError("a synthesized workload cannot name official blobs")
        if self.recipe_variant is not None and self.data_source != "synthesized":
            raise ValueError("only a synthesized workload can name a recipe variant")
        overlap = set(self.blob_inputs) & set(self.missing_blob_inputs)
        if overlap:
            raise ValueError(f"inputs both present and missing as blobs: {sorted(overlap)}")
        if list(self.withheld_inputs) != sorted(set(self.withheld_inputs)):
            raise ValueError(f"withheld inputs must be sorted and distinct, got {list(self.withheld_inputs)}")
        return self

    @property
    def row_name(self) -> str:
        """The name of this row's files (stored reference outputs, logs): see `row_name`."""
        return row_name(self.uuid, self.withheld_inputs)

    def without(self, name: str) -> WorkloadSpec:
        """The twin of this workload that passes optional input `name` as None."""
        return self.model_copy(update={"withheld_inputs": tuple(sorted({*self.withheld_inputs, name}))})


def row_name(uuid: str, withheld_inputs: Sequence[str] = ()) -> str:
    """A workload's row in file names: its uuid, with `.without-<input>` per withheld input, so
    that a twin's files never overwrite its workload's."""
    return uuid + "".join(f".without-{name}" for name in withheld_inputs)


def official_workload_file(track: Track, data_dir: Path) -> Path:
    """Where the flashinfer-trace layout keeps this track's workload JSONL."""
    return data_dir / "workloads" / track.op_type / f"{track.definition_name}.jsonl"


def load_workloads(track: str, data_dir: Path | None = None) -> list[WorkloadSpec]:
    """The validated workload list of `track`: official if `data_dir` holds it, else embedded."""
    track_info = get_track(track)
    definition = track_definition(track_info.name)
    data_dir = BENCHMARK_DATA_DIR if data_dir is None else Path(data_dir)
    official = official_workload_file(track_info, data_dir)
    if official.is_file():
        workloads = _read_official(track_info, definition, official, data_dir)
    else:
        workloads = _read_embedded(track_info, definition)
    _validate(definition, workloads)
    named = [w.uuid for w in workloads if w.recipe_variant is not None]
    if named:
        raise WorkloadError(f"{track_info.name}: listed workload {named[0]} names a recipe variant (off-list only)")
    return workloads


def load_offlist(track: str) -> list[WorkloadSpec]:
    """The validated off-list workloads of `track` (its `offlist.tsv`): synthesized, each naming a
    variant of the track's recipe, none sharing a uuid with the listed workloads (a row's files
    and records are named by its uuid)."""
    track_info = get_track(track)
    if not track_info.offlist_path.is_file():
        raise WorkloadError(f"track {track_info.name} has no off-list workloads ({track_info.offlist_path.name})")
    definition = track_definition(track_info.name)
    workloads = _read_embedded(track_info, definition, track_info.offlist_path)
    _validate(definition, workloads)
    variants = set(getattr(track_info.synth, "RECIPE_VARIANTS", {}))
    listed = synthesized_workloads(track_info.name)
    for w in workloads:
        where = f"{track_info.offlist_path.name} workload {w.index} ({w.uuid})"
        if w.recipe_variant not in variants:
            known = ", ".join(sorted(variants)) or "none"
            raise WorkloadError(f"{where}: recipe variant {w.recipe_variant!r} is not one of the track's ({known})")
        if w.uuid in listed:
            raise WorkloadError(f"{where}: the uuid of a listed workload")
    return workloads


@cache
def synthesized_workloads(track: str) -> dict[str, WorkloadSpec]:
    """The embedded (synthesized) workload list of `track` by uuid, whatever data is downloaded:
    for regenerating what a run recorded on synthesized inputs."""
    track_info = get_track(track)
    definition = track_definition(track_info.name)
    workloads = _read_embedded(track_info, definition)
    _validate(definition, workloads)
    return {w.uuid: w for w in workloads}


def synthesized_workload(track: str, uuid: str, axes: Mapping[str, int]) -> WorkloadSpec | None:
    """The embedded workload `uuid` of `track` if it has these axes (what a record of a run on
    synthesized data names), else None."""
    spec = synthesized_workloads(track).get(uuid)
    return spec if spec is not None and spec.axes == dict(axes) else None


def select_workloads(
    workloads: list[WorkloadSpec], uuids: list[str] | None = None, max_count: int | None = None
) -> list[WorkloadSpec]:
    """Workloads whose uuid is in `uuids` (all when None), in list order, at most `max_count`."""
    track = workloads[0].track if workloads else "?"
    if max_count is not None and max_count < 1:
        raise WorkloadSelectionError(f"workload count must be >= 1, got {max_count}")
    selected = workloads
    if uuids is not None:
        if not uuids:
            raise WorkloadSelectionError(f"empty workload uuid list for track {track}")
        known = {w.uuid for w in workloads}
        unknown = [u for u in dict.fromkeys(uuids) if u not in known]
        if unknown:
            raise WorkloadSelectionError(
                f"unknown workload uuid(s) for track {track}: {', '.join(unknown)} "
                f"(the list has {len(workloads)} workloads)"
            )
        wanted = set(uuids)
        selected = [w for w in workloads if w.uuid in wanted]
    return selected if max_count is None else selected[:max_count]


# The shortest uuid prefix `resolve_uuids` accepts, and how many candidates an ambiguous one names.
MIN_UUID_PREFIX = 6
MAX_NAMED_CANDIDATES = 5


def resolve_uuids(requested: list[str], known: list[str]) -> tuple[list[str], list[str]]:
    """Each requested uuid, or unique prefix of at least MIN_UUID_PREFIX characters of one in
    `known`, as the full uuid (in request order, once each); and the requests that match none.

    Raises WorkloadSelectionError for a prefix that is too short or matches several uuids.
    """
    full = set(known)
    resolved: dict[str, None] = {}
    unknown: dict[str, None] = {}
    for text in requested:
        if text in full:
            resolved[text] = None
            continue
        if len(text) < MIN_UUID_PREFIX:
            raise WorkloadSelectionError(
                f"workload {text!r} is not a full uuid, and a uuid prefix needs at least {MIN_UUID_PREFIX} characters"
            )
        matches = list(dict.fromkeys(u for u in known if u.startswith(text)))
        if len(matches) > 1:
            named = ", ".join(matches[:MAX_NAMED_CANDIDATES])
            more = f" and {len(matches) - MAX_NAMED_CANDIDATES} more" if len(matches) > MAX_NAMED_CANDIDATES else ""
            raise WorkloadSelectionError(
                f"workload uuid prefix {text!r} is ambiguous: it matches {len(matches)} uuids ({named}{more})"
            )
        if matches:
            resolved[matches[0]] = None
        else:
            unknown[text] = None
    return list(resolved), list(unknown)


@cache
def track_definition(track: str) -> Definition:
    """Our definition of `track` (by track name), loaded once per process."""
    return load_definition(get_track(track))


# ---------------------------------------------------------------------------------------------
# Embedded TSV lists


# The embedded lists' column naming a recipe variant (off-list lists only, see load_offlist).
VARIANT_COLUMN = "recipe_variant"


def _read_embedded(track: Track, definition: Definition, path: Path | None = None) -> list[WorkloadSpec]:
    path = track.workload_list_path if path is None else path
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    except OSError as e:
        raise WorkloadError(f"cannot read workload list {path}: {e.strerror}") from None
    rows = list(csv.DictReader(lines, delimiter="\t"))
    columns = list(rows[0].keys()) if rows else []
    if columns[:2] != ["index", "uuid"]:
        raise WorkloadError(f"{path}: the first columns must be 'index' and 'uuid', got {columns[:2]}")
    scalar_inputs = _scalar_input_dtypes(definition)
    axis_columns = [c for c in columns[2:] if c in definition.var_axes]
    scalar_columns = [c for c in columns[2:] if c in scalar_inputs]
    unknown = [c for c in columns[2:] if c not in axis_columns and c not in scalar_columns and c != VARIANT_COLUMN]
    if unknown:
        raise WorkloadError(f"{path}: columns {unknown} are neither var axes nor scalar inputs of {definition.name}")
    workloads = []
    for line_no, row in enumerate(rows, start=1):
        where = f"{path.name} row {line_no}"
        if None in row or any(v is None or v == "" for v in row.values()):
            raise WorkloadError(f"{where}: wrong number of fields")
        workloads.append(
            _spec(
                where,
                track=track.name,
                index=_parse_int(row["index"], where),
                uuid=row["uuid"],
                axes={c: _parse_int(row[c], where) for c in axis_columns},
                scalars={c: _parse_scalar(row[c], scalar_inputs[c], where) for c in scalar_columns},
                data_source="synthesized",
                recipe_variant=row.get(VARIANT_COLUMN),
            )
        )
    return workloads


def _parse_int(text: str, where: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise WorkloadError(f"{where}: {text!r} is not an integer") from None


def _parse_scalar(text: str, dtype: str, where: str) -> ScalarValue:
    if dtype.startswith("int"):
        return _parse_int(text, where)
    try:
        return float(text)
    except ValueError:
        raise WorkloadError(f"{where}: {text!r} is not a number") from None


def _scalar_input_dtypes(definition: Definition) -> dict[str, str]:
    return {name: spec.dtype for name, spec in definition.inputs.items() if spec.shape is None}


def _spec(where: str, **fields: object) -> WorkloadSpec:
    try:
        return WorkloadSpec(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        raise WorkloadError(f"{where}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


# ---------------------------------------------------------------------------------------------
# Official flashinfer-trace data


def _read_official(track: Track, definition: Definition, jsonl: Path, data_dir: Path) -> list[WorkloadSpec]:
    try:
        traces = load_jsonl_file(Trace, jsonl)
    except ValidationError as e:
        first = e.errors()[0]
        raise WorkloadError(f"{jsonl}: not a flashinfer-bench workload file ({first['msg']})") from None
    except ValueError as e:  # malformed JSON
        raise WorkloadError(f"{jsonl}: not a flashinfer-bench workload file ({str(e).splitlines()[0]})") from None
    blob_keys = _BlobKeyCache()
    workloads = []
    for index, trace in enumerate(traces):
        where = f"{jsonl.name} line {index + 1}"
        if trace.definition != definition.name:
            raise WorkloadError(f"{where}: definition {trace.definition!r}, expected {definition.name!r}")
        if not trace.is_workload_trace():
            raise WorkloadError(f"{where}: a workload line must have no solution and no evaluation")
        workload = trace.workload
        unknown = sorted(set(workload.inputs) - set(definition.inputs))
        if unknown:
            raise WorkloadError(f"{where}: inputs {unknown} are not inputs of {definition.name}")
        scalars: dict[str, ScalarValue] = {}
        blobs: dict[str, BlobRef] = {}
        missing: list[str] = []
        for name, spec in workload.inputs.items():
            if isinstance(spec, ScalarInput):
                scalars[name] = spec.value
            elif isinstance(spec, SafetensorsInput):
                path = (data_dir / spec.path).resolve()
                shape = blob_keys.shape(path, spec.tensor_key)
                if shape is None:
                    missing.append(name)
                    continue
                expected = _expected_shape(definition, name, workload.axes)
                if expected is not None and shape != expected:
                    raise WorkloadError(
                        f"{where}: blob {path.name}[{spec.tensor_key}] has shape {shape}, expected {expected}"
                    )
                blobs[name] = BlobRef(path=path, tensor_key=spec.tensor_key)
        workloads.append(
            _spec(
                where,
                track=track.name,
                index=index,
                uuid=workload.uuid,
                axes=dict(workload.axes),
                scalars=scalars,
                data_source="official",
                blob_inputs=blobs,
                missing_blob_inputs=tuple(missing),
            )
        )
    return workloads


def _expected_shape(definition: Definition, name: str, axes: dict[str, int]) -> tuple[int, ...] | None:
    """The shape the definition implies, or None when the axes are too broken to say (validation reports it)."""
    try:
        shapes = dict(zip(definition.inputs, definition.get_input_shapes(axes), strict=True))
    except ValueError:
        return None
    shape = shapes[name]
    return tuple(shape) if shape is not None else None


class _BlobKeyCache:
    """Reads each safetensors header once; absent files and keys read as None."""

    def __init__(self) -> None:
        self._shapes: dict[Path, dict[str, tuple[int, ...]] | None] = {}

    def shape(self, path: Path, key: str) -> tuple[int, ...] | None:
        if path not in self._shapes:
            self._shapes[path] = self._read(path)
        shapes = self._shapes[path]
        return None if shapes is None else shapes.get(key)

    @staticmethod
    def _read(path: Path) -> dict[str, tuple[int, ...]] | None:
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise WorkloadError(f"blob {path} is not a readable safetensors file ({e})") from None


# ---------------------------------------------------------------------------------------------
# Validation


def _validate(definition: Definition, workloads: list[WorkloadSpec]) -> None:
    if not workloads:
        raise WorkloadError(f"the workload list of {definition.name} is empty")
    scalar_inputs = _scalar_input_dtypes(definition)
    axis_constraints = _axis_only_constraints(definition)
    seen: set[str] = set()
    for position, w in enumerate(workloads):
        where = f"{definition.name} workload {w.index} ({w.uuid})"
        if w.index != position:
            raise WorkloadError(f"{where}: index {w.index} out of order, expected {position}")
        if w.uuid in seen:
            raise WorkloadError(f"{where}: duplicate uuid")
        seen.add(w.uuid)
        if set(w.axes) != set(definition.var_axes):
            raise WorkloadError(f"{where}: axes {sorted(w.axes)}, expected the var axes {sorted(definition.var_axes)}")
        small = {k: v for k, v in w.axes.items() if v < 1}
        if small:
            raise WorkloadError(f"{where}: axes must be >= 1, got {small}")
        for name, value in w.scalars.items():
            if name not in scalar_inputs:
                raise WorkloadError(f"{where}: {name!r} is not a scalar input of {definition.name}")
            is_int_dtype = scalar_inputs[name].startswith("int")
            if isinstance(value, bool) or (is_int_dtype and not isinstance(value, int)):
                raise WorkloadError(f"{where}: scalar {name}={value!r} does not fit dtype {scalar_inputs[name]}")
        values = {**definition.const_axes, **w.axes}
        for text, code in axis_constraints:
            if not eval(code, {"__builtins__": {}}, values):  # our own definition's expressions over ints
                raise WorkloadError(f"{where}: constraint {text!r} fails for axes {w.axes}")


def _axis_only_constraints(definition: Definition) -> list[tuple[str, object]]:
    """The definition's constraints that mention axis names only (others need tensors)."""
    axis_names = set(definition.axes)
    selected = []
    for text in definition.constraints:
        tree = ast.parse(text, mode="eval")
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        allowed_nodes = (ast.Expression, ast.Name, ast.Load, ast.Constant, ast.Compare, ast.BinOp, ast.BoolOp,
                         ast.UnaryOp, ast.operator, ast.cmpop, ast.boolop, ast.unaryop)  # fmt: skip
        if names <= axis_names and all(isinstance(n, allowed_nodes) for n in ast.walk(tree)):
            selected.append((text, compile(tree, "<constraint>", "eval")))
    return selected


def data_source_label(workload: WorkloadSpec) -> str:
    """What a result row says about its inputs: `official`, `synthesized`, or, for an official
    workload whose blobs were missing, `official; synthesized: <inputs>` (the runner's fallback)."""
    if workload.data_source == "official" and workload.missing_blob_inputs:
        return f"official; synthesized: {','.join(workload.missing_blob_inputs)}"
    return workload.data_source
