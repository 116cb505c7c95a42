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

fla's Triton kernels autotune on their first call in a process, keyed on head counts, head sizes,
flags and dtypes but not on the token count, so one pick serves every later shape; picks among
configurations within the timing noise of each other vary between processes, and with them the
side's time (two runs of one commit on two H200 leases: +3-6 % on most GDN rows, up to +21 %).
So that a run repeats, every autotuned fla kernel gets a fixed configuration per GPU and tuning
key, `PINNED_CONFIGS`: the one fla's own autotuner measures fastest on the track's largest
workload, by the median over several tunings in fresh processes (`tools/tune_fla.py` writes the
block). It is put in each autotuner's cache when fla is imported, as fla's own config files do
(`fla/ops/utils/cache.py`); a GPU without an entry autotunes as fla does.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import math
import re
import sys
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


# GPU name (`gpu_key`) -> fla kernel (`module.function`) -> [{"key": the autotuner's tuning key, "config": a
# triton.Config's fields}]. Written by tools/tune_fla.py; everything between the markers is its output.
# generated:fla-configs:begin
PINNED_CONFIGS: dict[str, dict[str, list[dict[str, Any]]]] = {
    'NVIDIA_H200': {
        'fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64': [
            {
                'key': [4, 8, 128, 128, 64, True, 'torch.bfloat16', 'torch.bfloat16', 'torch.bfloat16', 'torch.bfloat16', 'torch.float32', 'torch.bfloat16', 'torch.float32', 'torch.float32', 'torch.int64', 'torch.int64'],
                'config': {'kwargs': {'BV': 64}, 'maxnreg': None, 'num_ctas': 1, 'num_stages': 4, 'num_warps': 4},
                'median_ms': 0.07114,
                'picked_by': '2 of 3 tunings',
            },
            {
                'key': [4, 8, 128, 128, 64, True, 'torch.bfloat16', 'torch.bfloat16', 'torch.bfloat16', 'torch.bfloat16', 'torch.float32', 'torch.bfloat16', 'torch.float32', 'torch.int64', 'torch.int64'],
                'config': {'kwargs': {'BV': 64}, 'maxnreg': None, 'num_ctas': 1, 'num_stages': 4, 'num_warps': 4},
                'median_ms': 0.06368,
                'picked_by': '3 of 3 tunings',
            },
        ],
        'fla.ops.common.chunk_o.chunk_fwd_kernel_o': [
            {
                'key': [4, 8, 128, 128, 64, True, 'torch.bfloat16', 'torch.bfloat16', 'torch.bfloat16', 'torch.bfloat16', 'torch.float32', 'torch.bfloat16', 'torch.int64', 'torch.int64'],
                'config': {'kwargs': {'BK': 64, 'BV': 64}, 'maxnreg': None, 'num_ctas': 1, 'num_stages': 3, 'num_warps': 4},
                'median_ms': 0.04565,
                'picked_by': '6 of 6 tunings',
            },
        ],
        'fla.ops.gated_delta_rule.chunk_fwd.chunk_gated_delta_rule_fwd_kkt_solve_kernel': [
            {
                'key': [4, 8, 128, 16, 'torch.bfloat16', 'torch.float32', 'torch.float32', 'torch.bfloat16', 'torch.int64', 'torch.int64'],
                'config': {'kwargs': {'BK': 64}, 'maxnreg': None, 'num_ctas': 1, 'num_stages': 3, 'num_warps': 1},
                'median_ms': 0.0444,
                'picked_by': '6 of 6 tunings',
            },
        ],
        'fla.ops.gated_delta_rule.gate.gdn_gate_chunk_cumsum_scalar_kernel': [
            {
                'key': [8, 64, True, False, 'torch.bfloat16', 'torch.float32', 'torch.float32', 'torch.float32', 'torch.int64', 'torch.int64'],
                'config': {'kwargs': {}, 'maxnreg': None, 'num_ctas': 1, 'num_stages': 3, 'num_warps': 4},
                'median_ms': 0.00568,
                'picked_by': '3 of 6 tunings',
            },
        ],
        'fla.ops.gated_delta_rule.wy_fast.recompute_w_u_fwd_kernel': [
            {
                'key': [4, 8, 128, 128, 64, 64, 64, True, 'torch.bfloat16', 'torch.bfloat16', 'torch.float32', 'torch.bfloat16', 'torch.bfloat16', 'torch.bfloat16', 'torch.float32', 'torch.int64', 'torch.int64'],
                'config': {'kwargs': {}, 'maxnreg': None, 'num_ctas': 1, 'num_stages': 2, 'num_warps': 4},
                'median_ms': 0.02957,
                'picked_by': '5 of 6 tunings',
            },
        ],
    },
}
# generated:fla-configs:end


def gpu_key(device_name: str) -> str:
    """`PINNED_CONFIGS`' name for a GPU: its device name with every run of other characters than letters and digits
    made one underscore (fla names its per-GPU config folders so too)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_")


def fla_autotuners() -> dict[str, Any]:
    """Every autotuned kernel of the imported fla modules (a Triton `Autotuner`, also under the `heuristics` that
    fla stacks on some), by `module.function` of the Python function it tunes."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for value in list(vars(module).values()):
            while isinstance(value, KernelInterface) and not isinstance(value, Autotuner):
                value = getattr(value, "fn", None)  # Heuristics -> what it wraps; a JITFunction -> its function
            if isinstance(value, Autotuner):
                found[f"{value.base_fn.__module__}.{value.base_fn.__name__}"] = value
    return found


def pin_configs(pinned: dict[str, list[dict[str, Any]]], autotuners: dict[str, Any]) -> int:
    """Put each pinned configuration in its kernel's autotuner cache under its tuning key, so that a call with that
    key runs it without tuning; returns how many. A pinned kernel fla no longer has is an error: the entries were
    made for another fla."""
    from triton import Config

    count = 0
    for kernel, entries in pinned.items():
        autotuner = autotuners.get(kernel)
        if autotuner is None:
            raise LibraryUnavailableError(f"fla has no autotuned kernel {kernel}; re-run tools/tune_fla.py")
        for entry in entries:
            fields = entry["config"]
            autotuner.cache[tuple(entry["key"])] = Config(
                fields["kwargs"],
                num_warps=fields["num_warps"],
                num_stages=fields["num_stages"],
                num_ctas=fields["num_ctas"],
                maxnreg=fields["maxnreg"],
            )
            count += 1
    return count


@functools.cache
def load_chunk_gated_delta_rule() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """fla's Triton `chunk_gated_delta_rule`, past its backend dispatcher, its kernels pinned to this GPU's
    `PINNED_CONFIGS` where it has some."""
    chunk_gated_delta_rule = import_chunk_gated_delta_rule()
    pinned = PINNED_CONFIGS.get(gpu_key(torch.cuda.get_device_name()), {})
    if pinned:
        pin_configs(pinned, fla_autotuners())
    return chunk_gated_delta_rule


@functools.cache
def import_chunk_gated_delta_rule() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """fla's Triton `chunk_gated_delta_rule`, past its backend dispatcher, as fla leaves it (autotuning)."""
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
