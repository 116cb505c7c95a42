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
drawn; their dtype and shape are checked against the definition.

Distributions, per track (the contest's actual random inputs were plain randn, which makes
the references numerically meaningless for MoE, see below):

GDN prefill (`gdn_prefill_qk4_v8_d128_k_last`):
- `cu_seqlens`: a uniform random composition of `total_seq_len` into `num_seqs` segments of
  at least one token (distinct cut points drawn without replacement). The real split is unknown.
- `q`, `k`: randn, L2-normalised per head in fp32 (the models normalise q and k), then bf16.
- `v`, `a`, `b`: randn bf16.
- Gates, regime "mamba2" (default, how GDN layers initialise): `A_log = log(U[1, 16])`,
  `dt_bias = softplus^-1(dt)` with `dt` log-uniform in [1e-3, 1e-1]. Long memory: the
  per-token decay has a median near 0.93, so the initial state matters.
  Regime "fast_decay" (stress test): same `A_log`, `dt_bias ~ U[-0.1, 0.1]`; the state is
  forgotten within a few tokens and chunked kernels that divide by cumulative decays lose
  accuracy (harness_facts.md §13).
- `state`: given on every synthesized workload: the case in which no side pays for a missing
  one (a kernel that zero-fills an absent state launches work a given state does not need).
  Official workloads give it when their blob holds it. Values N(0, 0.2^2) fp32: the magnitude the reference itself builds from a zero state
  (entry std ~0.18 after 300 tokens with these distributions, measured on CPU). Ignoring or
  transposing it then fails the 1e-2 tolerances (measured, mamba2 gates: 6-token sequence,
  32 % of `output` and 64 % of `new_state` elements off; 300 tokens, 2.5 % of `output` off,
  the first tokens, while `new_state` has forgotten it: even the slowest heads decay ~e^-4).
- `scale`: 1/sqrt(128). The contest's value is unknown; the reference substitutes this for 0/None.

MoE (`moe_fp8_block_scale_ds_routing_topk8_ng8_kg4_e32_h7168_i2048`):
- `routing_logits` randn fp32; `routing_bias` N(0, 0.1^2) bf16 (small, like a trained
  load-balancing bias: it shifts selection without dominating it).
- fp8 tensors (`hidden_states`, `gemm1_weights`, `gemm2_weights`): randn clamped to [-2, 2]
  then cast to e4m3, as flashinfer-bench does for random fp8.
- Block scales: U[0.5, 1.5] times a per-tensor base, not randn (randn scales are half
  negative and made the contest's reference outputs ~1e4 with ~1e4 errors still passing).
  The bases make each GEMM map unit-variance inputs to std ~ its gain: gemm1
  `MOE_GEMM1_GAIN / sqrt(7168)`, gemm2 `MOE_GEMM2_GAIN / sqrt(2048)`, hidden 1. Measured on
  CPU (seq_len 80): outputs of tokens with a local expert have std ~11 and 92 % of them
  exceed 1 in magnitude, so the MoE rule (|err| <= 1 or rel <= 0.3 on 90 %) rejects an
  all-zero output (62 % of elements off) or swapped hidden-scale blocks (44 % off).
- `local_expert_offset`, `routed_scaling_factor`: from the workload.

DSA sparse attention (`dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64`):
- `q_nope`, `q_pe` randn bf16; `ckv_cache`, `kpe_cache` N(0, c^2) bf16 with
  c = DSA_LOGIT_STD / (sm_scale * sqrt(512 + 64)), so scaled logits have std ~2: softmax is
  neither uniform nor one-hot.
- `sparse_indices`: like real decode. Each token has its own context of L tokens held in
  ceil(L/64) distinct random pages (the last one partial). Full rows (L in [2048, 64 * num_pages])
  select 2048 distinct context slots; short rows (L in [1, 2047]) hold their whole context in
  the first L entries and -1 after. ceil(T/4) rows are short when T >= 2 (none when T = 1),
  so every multi-token workload exercises both kinds of row.
- `sm_scale`: from the workload.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Literal

import torch
from flashinfer_bench.data import Definition
from safetensors import safe_open

from hopperbench.workloads import WorkloadSpec, track_definition

InputValue = torch.Tensor | int | float | None
GateRegime = Literal["mamba2", "fast_decay"]
GATE_REGIMES: tuple[str, ...] = ("mamba2", "fast_decay")

# Upper bound on the elements of one fp32 temporary when drawing big tensors (128 MiB).
CHUNK_ELEMENTS = 1 << 25

GDN_STATE_STD = 0.2
MOE_ROUTING_BIAS_STD = 0.1
MOE_GEMM1_GAIN = 4.0
MOE_GEMM2_GAIN = 2.0
DSA_LOGIT_STD = 2.0


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
    gate_regime: GateRegime = "mamba2",
    only: Collection[str] | None = None,
) -> dict[str, InputValue]:
    """All inputs of `workload`, in definition order: official blobs, workload scalars, synthesis.

    `only` restricts the result to those input names (still in definition order); each input
    has its own seed, so a subset holds exactly the bytes the full call would give.
    """
    if workload.track != track:
        raise SynthesisError(f"workload {workload.uuid} belongs to track {workload.track}, not {track}")
    if gate_regime not in GATE_REGIMES:
        raise SynthesisError(f"unknown gate regime {gate_regime!r}; choose from {', '.join(GATE_REGIMES)}")
    if gate_regime != "mamba2" and track != "gdn_prefill":
        raise SynthesisError("gate_regime applies to the gdn_prefill track only")
    recipe = _RECIPES.get(track)
    if recipe is None:
        raise SynthesisError(f"no input recipe for track {track!r}")
    definition = track_definition(track)
    ctx = _Context(
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
        if name in workload.blob_inputs:
            value: InputValue = blobs.load(workload.blob_inputs[name].path, workload.blob_inputs[name].tensor_key)
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


def input_bytes(track: str, workload: WorkloadSpec) -> int:
    """Bytes of all tensor inputs `make_inputs` returns for `workload` (for memory planning)."""
    definition = track_definition(track)
    shapes = dict(zip(definition.inputs, definition.get_input_shapes(workload.axes), strict=True))
    dtypes = dict(zip(definition.inputs, definition.torch_input_dtypes, strict=True))
    absent = absent_optional_inputs(track, workload)
    return sum(
        math.prod(shape) * dtypes[name].itemsize
        for name, shape in shapes.items()
        if shape is not None and name not in absent
    )


def gdn_has_initial_state(workload: WorkloadSpec) -> bool:
    """Whether a GDN workload gets an initial `state`: always when synthesized; an official one
    when its blob holds it."""
    return workload.data_source == "synthesized" or "state" in workload.blob_inputs


# ---------------------------------------------------------------------------------------------
# Shared machinery


@dataclass
class _Context:
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


Recipe = dict[str, Callable[[_Context, str], InputValue]]


def _randn(ctx: _Context, name: str, std: float = 1.0) -> torch.Tensor:
    """N(0, std^2) in the input's dtype (bf16/fp32), drawn directly in that dtype in fixed chunks."""
    shape, dtype = ctx.shapes[name], ctx.dtypes[name]
    out = torch.empty(shape, dtype=dtype, device=ctx.device)
    gen = ctx.generator(name)
    for chunk in _row_chunks(out):
        chunk.normal_(0.0, std, generator=gen)
    return out


def _random_fp8(ctx: _Context, name: str) -> torch.Tensor:
    """flashinfer-bench's random fp8: randn in fp32, clamped to [-2, 2], cast; fp32 only per chunk."""
    shape, dtype = ctx.shapes[name], ctx.dtypes[name]
    out = torch.empty(shape, dtype=dtype, device=ctx.device)
    gen = ctx.generator(name)
    for chunk in _row_chunks(out):
        values = torch.randn(chunk.shape, generator=gen, device=ctx.device, dtype=torch.float32)
        chunk.copy_(values.clamp_(-2.0, 2.0))
    return out


def _uniform(ctx: _Context, name: str, low: float, high: float) -> torch.Tensor:
    out = torch.empty(ctx.shapes[name], dtype=ctx.dtypes[name], device=ctx.device)
    return out.uniform_(low, high, generator=ctx.generator(name))


def _row_chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """Views of `t` along dim 0 with at most CHUNK_ELEMENTS each (a whole row if rows are bigger)."""
    if t.dim() == 0 or t.numel() <= CHUNK_ELEMENTS:
        return [t]
    rows_per_chunk = max(1, CHUNK_ELEMENTS // (t.numel() // t.shape[0]))
    return list(t.split(rows_per_chunk, dim=0))


def _check_tensor(name: str, value: InputValue, ctx: _Context) -> None:
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


def absent_optional_inputs(track: str, workload: WorkloadSpec) -> set[str]:
    """The optional inputs `make_inputs` passes as None for `workload`."""
    if track == "gdn_prefill" and not gdn_has_initial_state(workload):
        return {"state"}
    return set()


# ---------------------------------------------------------------------------------------------
# GDN prefill


def _gdn_cu_seqlens(ctx: _Context, name: str) -> torch.Tensor:
    total, num_seqs = ctx.workload.axes["total_seq_len"], ctx.workload.axes["num_seqs"]
    if total < num_seqs:
        raise SynthesisError(f"workload {ctx.workload.uuid}: {total} tokens cannot fill {num_seqs} sequences")
    gen = ctx.generator(name, torch.device("cpu"))
    # num_seqs - 1 distinct cut points in 1..total-1: a uniform composition with parts >= 1.
    cuts = (torch.randperm(total - 1, generator=gen)[: num_seqs - 1] + 1).sort().values
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([total])])
    return bounds.to(dtype=ctx.dtypes[name], device=ctx.device)


def _gdn_unit_rows(ctx: _Context, name: str) -> torch.Tensor:
    values = torch.randn(ctx.shapes[name], generator=ctx.generator(name), device=ctx.device, dtype=torch.float32)
    return torch.nn.functional.normalize(values, dim=-1).to(ctx.dtypes[name])


def _gdn_state(ctx: _Context, name: str) -> torch.Tensor | None:
    return _randn(ctx, name, GDN_STATE_STD) if gdn_has_initial_state(ctx.workload) else None


def _gdn_a_log(ctx: _Context, name: str) -> torch.Tensor:
    return _uniform(ctx, name, 1.0, 16.0).log_()


def _gdn_dt_bias(ctx: _Context, name: str) -> torch.Tensor:
    if ctx.gate_regime == "fast_decay":
        return _uniform(ctx, name, -0.1, 0.1)
    dt = _uniform(ctx, name, math.log(1e-3), math.log(1e-1)).exp_()
    return dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt) = log(exp(dt) - 1), stable form


def _gdn_scale(ctx: _Context, name: str) -> float:
    return 1.0 / math.sqrt(ctx.definition.const_axes["head_size"])


_GDN: Recipe = {
    "q": _gdn_unit_rows,
    "k": _gdn_unit_rows,
    "v": _randn,
    "state": _gdn_state,
    "A_log": _gdn_a_log,
    "a": _randn,
    "dt_bias": _gdn_dt_bias,
    "b": _randn,
    "cu_seqlens": _gdn_cu_seqlens,
    "scale": _gdn_scale,
}


# ---------------------------------------------------------------------------------------------
# MoE


def _moe_scale(base: Callable[[_Context], float]) -> Callable[[_Context, str], torch.Tensor]:
    def make(ctx: _Context, name: str) -> torch.Tensor:
        return _uniform(ctx, name, 0.5, 1.5).mul_(base(ctx))

    return make


_MOE: Recipe = {
    "routing_logits": _randn,
    "routing_bias": lambda ctx, name: _randn(ctx, name, MOE_ROUTING_BIAS_STD),
    "hidden_states": _random_fp8,
    "hidden_states_scale": _moe_scale(lambda ctx: 1.0),
    "gemm1_weights": _random_fp8,
    "gemm1_weights_scale": _moe_scale(lambda ctx: MOE_GEMM1_GAIN / math.sqrt(ctx.definition.const_axes["hidden_size"])),
    "gemm2_weights": _random_fp8,
    "gemm2_weights_scale": _moe_scale(
        lambda ctx: MOE_GEMM2_GAIN / math.sqrt(ctx.definition.const_axes["intermediate_size"])
    ),
}


# ---------------------------------------------------------------------------------------------
# DSA sparse attention


def _dsa_cache(ctx: _Context, name: str) -> torch.Tensor:
    const = ctx.definition.const_axes
    head_dim = const["head_dim_ckv"] + const["head_dim_kpe"]
    std = DSA_LOGIT_STD / (float(ctx.scalar("sm_scale")) * math.sqrt(head_dim))
    return _randn(ctx, name, std)


def _dsa_sparse_indices(ctx: _Context, name: str) -> torch.Tensor:
    const = ctx.definition.const_axes
    page_size, topk = const["page_size"], const["topk"]
    num_tokens, num_pages = ctx.workload.axes["num_tokens"], ctx.workload.axes["num_pages"]
    capacity = num_pages * page_size
    if capacity < topk:
        raise SynthesisError(
            f"workload {ctx.workload.uuid}: {num_pages} pages hold {capacity} slots, fewer than topk={topk}"
        )
    gen = ctx.generator(name, torch.device("cpu"))
    num_short = 0 if num_tokens < 2 else math.ceil(num_tokens / 4)
    short_rows = set(torch.randperm(num_tokens, generator=gen)[:num_short].tolist())
    indices = torch.full((num_tokens, topk), -1, dtype=torch.int64)
    for row in range(num_tokens):
        if row in short_rows:
            context = int(torch.randint(1, topk, (1,), generator=gen))
        else:
            context = int(torch.randint(topk, capacity + 1, (1,), generator=gen))
        slots = _context_slots(context, num_pages, page_size, gen)
        chosen = slots[torch.randperm(context, generator=gen)[: min(context, topk)]]
        indices[row, : chosen.numel()] = chosen
    return indices.to(dtype=ctx.dtypes[name], device=ctx.device)


def _context_slots(context: int, num_pages: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """Cache slots (page * page_size + offset) of a `context`-token sequence in random distinct pages."""
    pages_needed = math.ceil(context / page_size)
    pages = torch.randperm(num_pages, generator=gen)[:pages_needed]
    slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()
    return slots[:context]  # the last page is filled only up to the context length


_DSA: Recipe = {
    "q_nope": _randn,
    "q_pe": _randn,
    "ckv_cache": _dsa_cache,
    "kpe_cache": _dsa_cache,
    "sparse_indices": _dsa_sparse_indices,
}


_RECIPES: dict[str, Recipe] = {"gdn_prefill": _GDN, "moe": _MOE, "dsa_attention": _DSA}
