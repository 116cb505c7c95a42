"""flash-linear-attention's `chunk_gated_delta_rule` (fla-core 0.6.0, Triton) as a gdn_prefill side.

Definition `gdn_prefill_qk4_v8_d128_k_last` -> fla, as read in the fla-core 0.6.0 wheel
(`fla/ops/gated_delta_rule/{chunk.py,gate.py}`, `fla/ops/common/{chunk_delta_h.py,gate.py}`):

- q, k [T, 4, 128], v [T, 8, 128] -> `[B=1, T, H, D]` views. fla supports GVA itself: v-head h
  reads q/k head h // (HV / H) = h // 2.
- a, A_log, dt_bias -> `g=a` with `use_gate_in_kernel=True, A_log, dt_bias`: fla's gate kernel forms
  the log decay -exp(A_log) * softplus(a + dt_bias) in fp32.
- b -> `beta=b` with `use_beta_sigmoid_in_kernel=True`: sigmoid in fp32, fp32 result.
- state [N, 8, V, K] (k-last), None = zeros -> `initial_state` with `state_v_first=True` (fla's
  [V, K] layout); None allowed.
- cu_seqlens int64 [N + 1] -> `cu_seqlens` as is (fla types it LongTensor; its kernels cast every
  load to int64).
- scale, None or 0 = 1/sqrt(128) -> `scale` as a float.
- output [T, 8, 128] bf16, new_state [N, 8, V, K] f32 <- fla returns o [1, T, 8, 128] in q's dtype
  and, with `output_final_state=True`, an fp32 final state in the same [V, K] layout; both are
  copied into the destinations.

`use_qk_l2norm_in_kernel=False`: the definition takes q and k as given.

fla routes `chunk_gated_delta_rule` through a backend dispatcher that hands the call to
FlashQLA (a different kernel) whenever the `flash_qla` package is importable. This side is
FLA's own Triton chunk pipeline, so the dispatcher is unwrapped. What fla itself does per
call is kept: it derives chunk indices from `cu_seqlens` (one host sync), and memoises them
by the identity of the `cu_seqlens` tensor (`fla.utils.tensor_cache`), as it would across the
layers of a model.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

FLA_DISTRIBUTION = "fla-core"
FLA_VERSION = "0.6.0"
NUM_V_HEADS = 8
HEAD_SIZE = 128
DEFAULT_SCALE = 1.0 / math.sqrt(HEAD_SIZE)


class LibraryUnavailableError(RuntimeError):
    """The library this adapter calls is missing or is not the version it was written for."""


class AdapterInputError(ValueError):
    """The arguments do not describe a gdn_prefill call."""


@functools.cache
def load_chunk_gated_delta_rule() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """fla's Triton `chunk_gated_delta_rule`, past its backend dispatcher."""
    try:
        installed = importlib.metadata.version(FLA_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise LibraryUnavailableError(f"{FLA_DISTRIBUTION} is not installed (uv sync --extra fla)") from None
    if installed != FLA_VERSION:
        raise LibraryUnavailableError(
            f"{FLA_DISTRIBUTION} {installed} is installed; this adapter targets {FLA_VERSION}"
        )
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return inspect.unwrap(chunk_gated_delta_rule)


def resolve_scale(scale: float | torch.Tensor | None) -> float:
    """The definition's scale rule: None or 0 means 1/sqrt(128)."""
    value = 0.0 if scale is None else float(scale)  # a tensor scale costs a host read
    return DEFAULT_SCALE if value == 0.0 else value


def fla_arguments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor | None,
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | torch.Tensor | None,
) -> dict[str, Any]:
    """Keyword arguments of fla's `chunk_gated_delta_rule` for one definition call (views only)."""
    return {
        "q": q.unsqueeze(0),
        "k": k.unsqueeze(0),
        "v": v.unsqueeze(0),
        "g": a.unsqueeze(0),
        "beta": b.unsqueeze(0),
        "scale": resolve_scale(scale),
        "initial_state": state,
        "output_final_state": True,
        "use_qk_l2norm_in_kernel": False,
        "use_gate_in_kernel": True,
        "A_log": A_log,
        "dt_bias": dt_bias,
        "use_beta_sigmoid_in_kernel": True,
        "state_v_first": True,
        "cu_seqlens": cu_seqlens,
    }


def run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor | None,
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | torch.Tensor | None,
    output: torch.Tensor,
    new_state: torch.Tensor,
) -> None:
    """gdn_prefill_qk4_v8_d128_k_last in destination-passing style through fla."""
    num_seqs = cu_seqlens.shape[0] - 1
    if output.shape != v.shape:
        raise AdapterInputError(f"output must have v's shape {tuple(v.shape)}, got {tuple(output.shape)}")
    expected_state = (num_seqs, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE)
    if tuple(new_state.shape) != expected_state:
        raise AdapterInputError(f"new_state must have shape {expected_state}, got {tuple(new_state.shape)}")
    chunk_gated_delta_rule = load_chunk_gated_delta_rule()
    out, final_state = chunk_gated_delta_rule(**fla_arguments(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale))
    output.copy_(out.view(output.shape))
    new_state.copy_(final_state)
