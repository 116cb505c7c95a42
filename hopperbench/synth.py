"""Deterministic inputs for one (track, workload, seed, trial).

Upstream flashinfer-bench seeds nothing; we derive a 64-bit seed per input tensor from
sha256(track, workload uuid, seed, trial, input name), so every tensor is reproducible in any
process and independent of which other inputs were generated (an official blob replacing
one input does not shift the others).

Determinism contract: the same arguments on the same device type give identical bytes.
Structural index tensors (GDN `cu_seqlens`, DSA `sparse_indices`) are drawn on the CPU and
copied, so they are identical on every device. Value tensors are drawn with a
`torch.Generator` on the target device; CUDA's Philox streams depend on the launch grid and
so on the GPU model: identical on the same model, different (but equally valid) elsewhere.
Large tensors are drawn in chunks of a fixed element count, never a memory-dependent one.

Official blob inputs (`WorkloadSpec.blob_inputs`) are loaded from safetensors instead of
drawn; their dtype and shape are checked against the definition. A twin's withheld inputs
(`WorkloadSpec.withheld_inputs`) are None; every other input is what its workload gets.

The distributions are the track's: each track folder's `synth.py` gives one recipe per input
(`RECIPE`: input name -> function of (SynthContext, name)) and says which optional inputs a
workload passes as None (`absent_optional_inputs`); a track with several gate regimes lists them
(`GATE_REGIMES`, `DEFAULT_GATE_REGIME` among them; a track without the list takes the default only);
a track with off-list workloads names its recipe's variants (`RECIPE_VARIANTS`: variant -> the
inputs it draws otherwise, a workload's `recipe_variant` picks one). This module is the machinery the recipes share (the
context with its per-input generators, chunked draws) and the entry points, which reach a track's
recipe through its registry entry (`Track.synth`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from types import ModuleType

import torch
from flashinfer_bench.data import Definition
from safetensors import safe_open

from hopperbench.tracks import TRACKS, get_track
from hopperbench.workloads import WorkloadSpec, track_definition

InputValue = torch.Tensor | int | float | None
# A track's gate regime (GATE_REGIMES of its synth module); every track accepts the default.
GateRegime = str
DEFAULT_GATE_REGIME = "mamba2"

# Upper bound on the elements of one fp32 temporary when drawing big tensors (128 MiB).
CHUNK_ELEMENTS = 1 << 25


class SynthesisError(ValueError):
    """Inputs cannot be made for this workload (bad arguments, or a blob that does not fit)."""


def derive_seed(*parts: object) -> int:
    """A 64-bit seed from the parts' string forms (sha256; stable across processes and platforms)."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def make_inputs(
    track: str,
    workload: WorkloadSpec,
    seed: int,
    trial: int,
    device: str | torch.device,
    *,
    gate_regime: GateRegime = DEFAULT_GATE_REGIME,
    only: Collection[str] | None = None,
) -> dict[str, InputValue]:
    """All inputs of `workload`, in definition order: official blobs, workload scalars, synthesis.

    `only` restricts the result to those input names (still in definition order); each input
    has its own seed, so a subset holds exactly the bytes the full call would give.
    """
    if workload.track != track:
        raise SynthesisError(f"workload {workload.uuid} belongs to track {workload.track}, not {track}")
    regimes = gate_regimes(track)
    if gate_regime not in regimes:
        with_regimes = [t for t in TRACKS if len(gate_regimes(t)) > 1]
        if gate_regime in {r for t in with_regimes for r in gate_regimes(t)}:
            raise SynthesisError(f"gate_regime applies to the {', '.join(with_regimes)} track only")
        raise SynthesisError(f"unknown gate regime {gate_regime!r}; choose from {', '.join(regimes)}")
    recipe = _recipe(track, workload)
    definition = track_definition(track)
    ctx = SynthContext(
        track=track,
        workload=workload,
        seed=seed,
        trial=trial,
        device=torch.device(device),
        definition=definition,
        gate_regime=gate_regime,
    )
    if only is not None:
        unknown = sorted(set(only) - set(definition.inputs))
        if unknown:
            raise SynthesisError(f"{track}: {unknown} are not inputs of {definition.name}")
    blobs = _BlobReader()
    inputs: dict[str, InputValue] = {}
    for name, spec in definition.inputs.items():
        if only is not None and name not in only:
            continue
        if name in workload.withheld_inputs:
            value: InputValue = None
        elif name in workload.blob_inputs:
            value = blobs.load(workload.blob_inputs[name].path, workload.blob_inputs[name].tensor_key)
            value = value.to(ctx.device)
        elif name in workload.scalars:
            value = workload.scalars[name]
        elif name in recipe:
            value = recipe[name](ctx, name)
        else:
            raise SynthesisError(f"{track}: no way to make input {name!r}")
        if spec.shape is not None and value is not None:
            _check_tensor(name, value, ctx)
        inputs[name] = value
    return inputs


def absent_optional_inputs(track: str, workload: WorkloadSpec) -> set[str]:
    """The optional inputs `make_inputs` passes as None for `workload`: those the track's synth
    says the workload lacks, and those its twin withholds."""
    return set(_track_synth(track).absent_optional_inputs(workload)) | set(workload.withheld_inputs)


def gate_regimes(track: str) -> tuple[str, ...]:
    """The gate regimes `make_inputs` accepts for `track`: its synth's GATE_REGIMES, else the default."""
    return tuple(getattr(_track_synth(track), "GATE_REGIMES", (DEFAULT_GATE_REGIME,)))


def recipe_variants(track: str) -> tuple[str, ...]:
    """The recipe variants an off-list workload of `track` may name (its synth's RECIPE_VARIANTS)."""
    return tuple(getattr(_track_synth(track), "RECIPE_VARIANTS", {}))


def _recipe(track: str, workload: WorkloadSpec) -> Recipe:
    """The track's recipe, with the inputs of the workload's recipe variant replaced."""
    recipes = _track_synth(track)
    if workload.recipe_variant is None:
        return recipes.RECIPE
    variants: dict[str, Recipe] = getattr(recipes, "RECIPE_VARIANTS", {})
    if workload.recipe_variant not in variants:
        known = ", ".join(variants) or "none"
        raise SynthesisError(f"{track}: unknown recipe variant {workload.recipe_variant!r} (the track's: {known})")
    return {**recipes.RECIPE, **variants[workload.recipe_variant]}


def _track_synth(track: str) -> ModuleType:
    try:
        return get_track(track).synth
    except ValueError:
        raise SynthesisError(f"no input recipe for track {track!r}") from None


# ---------------------------------------------------------------------------------------------
# Shared machinery


@dataclass
class SynthContext:
    """What a recipe may consult: the workload, the definition's shapes and dtypes, the generators."""

    track: str
    workload: WorkloadSpec
    seed: int
    trial: int
    device: torch.device
    definition: Definition
    gate_regime: str
    shapes: dict[str, tuple[int, ...] | None] = field(init=False)
    dtypes: dict[str, torch.dtype] = field(init=False)

    def __post_init__(self) -> None:
        try:
            shapes = self.definition.get_input_shapes(self.workload.axes)
        except ValueError as e:
            raise SynthesisError(f"workload {self.workload.uuid}: {e}") from None
        self.shapes = {
            n: (tuple(s) if s is not None else None) for n, s in zip(self.definition.inputs, shapes, strict=True)
        }
        self.dtypes = dict(zip(self.definition.inputs, self.definition.torch_input_dtypes, strict=True))

    def generator(self, name: str, device: torch.device | None = None) -> torch.Generator:
        """The generator for input `name`; on the CPU for structural tensors, else the target device."""
        device = self.device if device is None else device
        seed = derive_seed(self.track, self.workload.uuid, self.seed, self.trial, name)
        return torch.Generator(device=device).manual_seed(seed)

    def scalar(self, name: str) -> float:
        value = self.workload.scalars.get(name)
        if value is None:
            raise SynthesisError(f"workload {self.workload.uuid} gives no value for scalar {name!r}")
        return value


# One track's recipe: input name -> the function that makes it.
Recipe = dict[str, Callable[[SynthContext, str], InputValue]]


def randn(ctx: SynthContext, name: str, std: float = 1.0) -> torch.Tensor:
    """N(0, std^2) in the input's dtype (bf16/fp32), drawn directly in that dtype in fixed chunks."""
    shape, dtype = ctx.shapes[name], ctx.dtypes[name]
    out = torch.empty(shape, dtype=dtype, device=ctx.device)
    gen = ctx.generator(name)
    for chunk in _row_chunks(out):
        chunk.normal_(0.0, std, generator=gen)
    return out


def random_fp8(ctx: SynthContext, name: str) -> torch.Tensor:
    """flashinfer-bench's random fp8: randn in fp32, clamped to [-2, 2], cast; fp32 only per chunk."""
    shape, dtype = ctx.shapes[name], ctx.dtypes[name]
    out = torch.empty(shape, dtype=dtype, device=ctx.device)
    gen = ctx.generator(name)
    for chunk in _row_chunks(out):
        values = torch.randn(chunk.shape, generator=gen, device=ctx.device, dtype=torch.float32)
        chunk.copy_(values.clamp_(-2.0, 2.0))
    return out


def uniform(ctx: SynthContext, name: str, low: float, high: float) -> torch.Tensor:
    out = torch.empty(ctx.shapes[name], dtype=ctx.dtypes[name], device=ctx.device)
    return out.uniform_(low, high, generator=ctx.generator(name))


def _row_chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """Views of `t` along dim 0 with at most CHUNK_ELEMENTS each (a whole row if rows are bigger)."""
    if t.dim() == 0 or t.numel() <= CHUNK_ELEMENTS:
        return [t]
    rows_per_chunk = max(1, CHUNK_ELEMENTS // (t.numel() // t.shape[0]))
    return list(t.split(rows_per_chunk, dim=0))


def _check_tensor(name: str, value: InputValue, ctx: SynthContext) -> None:
    if not isinstance(value, torch.Tensor):
        raise SynthesisError(f"input {name!r} must be a tensor, got {type(value).__name__}")
    if tuple(value.shape) != ctx.shapes[name] or value.dtype != ctx.dtypes[name]:
        raise SynthesisError(
            f"input {name!r} is {value.dtype} {tuple(value.shape)}, the definition wants "
            f"{ctx.dtypes[name]} {ctx.shapes[name]}"
        )


class _BlobReader:
    """Opens each safetensors file once per call."""

    def __init__(self) -> None:
        self._handles: dict[str, object] = {}

    def load(self, path: object, key: str) -> torch.Tensor:
        path = str(path)
        try:
            if path not in self._handles:
                self._handles[path] = safe_open(path, framework="pt", device="cpu")
            return self._handles[path].get_tensor(key)
        except Exception as e:  # safetensors raises several unrelated types for missing files/keys
            raise SynthesisError(f"cannot load tensor {key!r} from blob {path}: {e}") from None
