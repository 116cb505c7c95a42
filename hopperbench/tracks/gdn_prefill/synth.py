"""Inputs of the GDN prefill track (`gdn_prefill_qk4_v8_d128_k_last`), on the machinery of
`hopperbench.synth`:
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
  Official workloads give it when their blob holds it. The twins of the track's no-state sample
  (`absent_input_sample` in the spec) pass None instead, everything else the same.
  Values N(0, 0.2^2) fp32: the magnitude the reference itself builds from a zero state (entry
  std ~0.18 after 300 tokens with these distributions, measured on CPU). Ignoring or
  transposing it then fails the 1e-2 tolerances (measured, mamba2 gates: 6-token sequence,
  32 % of `output` and 64 % of `new_state` elements off; 300 tokens, 2.5 % of `output` off,
  the first tokens, while `new_state` has forgotten it: even the slowest heads decay ~e^-4).
- `scale`: 1/sqrt(128). The contest's value is unknown; the reference substitutes this for 0/None.

Recipe variants (`RECIPE_VARIANTS`, named by an off-list workload's `recipe_variant`,
`offlist.tsv`); each replaces `cu_seqlens` only:
- `listed`: the recipe above (with one sequence: the whole batch is that sequence).
- `one_long`: one long sequence first, then `num_seqs - 1` sequences of `SHORT_SEQ_TOKENS` each:
  the chain of the long one bounds a batched kernel while the short ones fill the other SMs.
"""

from __future__ import annotations

import math

import torch

from hopperbench.synth import Recipe, SynthContext, SynthesisError, randn, uniform
from hopperbench.workloads import WorkloadSpec

# The gate regimes this track synthesizes (hopperbench.synth.make_inputs; mamba2 is the default).
GATE_REGIMES: tuple[str, ...] = ("mamba2", "fast_decay")

STATE_STD = 0.2

# The short sequences of the `one_long` variant: one 64-token chunk each.
SHORT_SEQ_TOKENS = 64


def has_initial_state(workload: WorkloadSpec) -> bool:
    """Whether a GDN workload gets an initial `state`: always when synthesized; an official one
    when its blob holds it."""
    return workload.data_source == "synthesized" or "state" in workload.blob_inputs


def absent_optional_inputs(workload: WorkloadSpec) -> set[str]:
    """The optional inputs passed as None: `state` where the workload has none."""
    return set() if has_initial_state(workload) else {"state"}


def _cu_seqlens(ctx: SynthContext, name: str) -> torch.Tensor:
    total, num_seqs = ctx.workload.axes["total_seq_len"], ctx.workload.axes["num_seqs"]
    if total < num_seqs:
        raise SynthesisError(f"workload {ctx.workload.uuid}: {total} tokens cannot fill {num_seqs} sequences")
    gen = ctx.generator(name, torch.device("cpu"))
    # num_seqs - 1 distinct cut points in 1..total-1: a uniform composition with parts >= 1.
    cuts = (torch.randperm(total - 1, generator=gen)[: num_seqs - 1] + 1).sort().values
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([total])])
    return bounds.to(dtype=ctx.dtypes[name], device=ctx.device)


def _one_long_cu_seqlens(ctx: SynthContext, name: str) -> torch.Tensor:
    total, num_seqs = ctx.workload.axes["total_seq_len"], ctx.workload.axes["num_seqs"]
    longest = total - SHORT_SEQ_TOKENS * (num_seqs - 1)
    if longest <= SHORT_SEQ_TOKENS:
        raise SynthesisError(
            f"workload {ctx.workload.uuid}: {total} tokens leave no long sequence beside"
            f" {num_seqs - 1} of {SHORT_SEQ_TOKENS}"
        )
    lengths = torch.tensor([longest] + [SHORT_SEQ_TOKENS] * (num_seqs - 1), dtype=torch.int64)
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return bounds.to(dtype=ctx.dtypes[name], device=ctx.device)


def _unit_rows(ctx: SynthContext, name: str) -> torch.Tensor:
    values = torch.randn(ctx.shapes[name], generator=ctx.generator(name), device=ctx.device, dtype=torch.float32)
    return torch.nn.functional.normalize(values, dim=-1).to(ctx.dtypes[name])


def _state(ctx: SynthContext, name: str) -> torch.Tensor | None:
    return randn(ctx, name, STATE_STD) if has_initial_state(ctx.workload) else None


def _a_log(ctx: SynthContext, name: str) -> torch.Tensor:
    return uniform(ctx, name, 1.0, 16.0).log_()


def _dt_bias(ctx: SynthContext, name: str) -> torch.Tensor:
    if ctx.gate_regime == "fast_decay":
        return uniform(ctx, name, -0.1, 0.1)
    dt = uniform(ctx, name, math.log(1e-3), math.log(1e-1)).exp_()
    return dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt) = log(exp(dt) - 1), stable form


def _scale(ctx: SynthContext, name: str) -> float:
    return 1.0 / math.sqrt(ctx.definition.const_axes["head_size"])


RECIPE: Recipe = {
    "q": _unit_rows,
    "k": _unit_rows,
    "v": randn,
    "state": _state,
    "A_log": _a_log,
    "a": randn,
    "dt_bias": _dt_bias,
    "b": randn,
    "cu_seqlens": _cu_seqlens,
    "scale": _scale,
}

RECIPE_VARIANTS: dict[str, Recipe] = {
    "listed": {},
    "one_long": {"cu_seqlens": _one_long_cu_seqlens},
}
