"""Library adapters. fla_gdn: argument mapping on CPU (fla replaced by fakes), results on GPU against our reference."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hopperbench.tracks.gdn_prefill.adapters import fla_gdn
from hopperbench.tracks import GDN_PREFILL

HEAD = 128


def _gdn_inputs(
    lengths: list[int], *, with_state: bool, scale: float, device: str = "cpu", seed: int = 0
) -> dict[str, Any]:
    """Definition-ordered inputs with long-memory (Mamba2-style) gates, so the input state matters."""
    gen = torch.Generator().manual_seed(seed)
    total, num_seqs = sum(lengths), len(lengths)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    dt = torch.empty(8).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
    inputs = {
        "q": F.normalize(randn(total, 4, HEAD), dim=-1).bfloat16(),
        "k": F.normalize(randn(total, 4, HEAD), dim=-1).bfloat16(),
        "v": randn(total, 8, HEAD).bfloat16(),
        "state": randn(num_seqs, 8, HEAD, HEAD) * 0.1 if with_state else None,
        "A_log": torch.empty(8).uniform_(1.0, 16.0, generator=gen).log(),
        "a": randn(total, 8).bfloat16(),
        "dt_bias": dt + torch.log(-torch.expm1(-dt)),  # softplus^-1(dt)
        "b": randn(total, 8).bfloat16(),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
        "scale": scale,
    }
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}


def _destinations(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    num_seqs = inputs["cu_seqlens"].shape[0] - 1
    device = inputs["q"].device
    return {
        "output": torch.empty_like(inputs["v"]),
        "new_state": torch.empty(num_seqs, 8, HEAD, HEAD, dtype=torch.float32, device=device),
    }


def _load_reference() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Our reference, loaded from its file as the runner does."""
    spec = importlib.util.spec_from_file_location("gdn_prefill_reference", GDN_PREFILL.reference_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run


class _RecordingFla:
    """Stands in for fla: records its keyword arguments and returns recognisable results."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(kwargs)
        v, cu_seqlens = kwargs["v"], kwargs["cu_seqlens"]
        o = torch.arange(v.numel(), dtype=torch.float32).reshape(v.shape).to(v.dtype)
        per_sequence = torch.arange(cu_seqlens.shape[0] - 1, dtype=torch.float32) + 0.5
        return o, per_sequence[:, None, None, None].expand(-1, 8, HEAD, HEAD).contiguous()


def _fla_contract(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    use_beta_sigmoid_in_kernel: bool,
    state_v_first: bool,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla 0.6.0's documented semantics, token by token (fla/ops/gated_delta_rule/chunk.py docstring and kernels).

    g is a log decay (computed from the raw g when use_gate_in_kernel); beta is post-sigmoid
    unless use_beta_sigmoid_in_kernel; states are [K, V] per head, [V, K] with state_v_first;
    v-head h reads q/k head h // (HV // H).
    """
    assert output_final_state and not use_qk_l2norm_in_kernel
    log_decay = -A_log.exp() * F.softplus(g.float() + dt_bias) if use_gate_in_kernel else g.float()
    beta = torch.sigmoid(beta.float()) if use_beta_sigmoid_in_kernel else beta.float()
    heads, v_heads = q.shape[2], v.shape[2]
    out = torch.zeros(v.shape, dtype=torch.float32)
    finals = []
    bounds = cu_seqlens.tolist()
    for n in range(len(bounds) - 1):
        finals_n = []
        for h in range(v_heads):
            if initial_state is None:
                s = torch.zeros(HEAD, HEAD)
            else:
                s = initial_state[n, h].T.clone() if state_v_first else initial_state[n, h].clone()
            for t in range(bounds[n], bounds[n + 1]):
                q_t, k_t = q[0, t, h // (v_heads // heads)].float(), k[0, t, h // (v_heads // heads)].float()
                s = s * log_decay[0, t, h].exp()
                s = s + torch.outer(k_t, beta[0, t, h] * (v[0, t, h].float() - k_t @ s))
                out[0, t, h] = scale * (q_t @ s)
            finals_n.append(s.T if state_v_first else s)
        finals.append(torch.stack(finals_n))
    return out.to(q.dtype), torch.stack(finals)


def test_arguments_are_views_in_fla_layout_and_results_land_in_the_destinations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inputs = _gdn_inputs([3, 5], with_state=True, scale=0.0)
    dest = _destinations(inputs)
    fake = _RecordingFla()
    monkeypatch.setattr(fla_gdn, "load_chunk_gated_delta_rule", lambda: fake)

    fla_gdn.run(*inputs.values(), *dest.values())

    (kw,) = fake.calls
    for fla_name, ours in [("q", "q"), ("k", "k"), ("v", "v"), ("g", "a"), ("beta", "b")]:
        assert kw[fla_name].shape == (1, *inputs[ours].shape)
        assert kw[fla_name].data_ptr() == inputs[ours].data_ptr()  # a view, no copy
    assert kw["initial_state"] is inputs["state"]
    assert kw["A_log"] is inputs["A_log"] and kw["dt_bias"] is inputs["dt_bias"]
    assert kw["cu_seqlens"] is inputs["cu_seqlens"]
    assert kw["state_v_first"] is True  # our k-last [V, K] is fla's v-first layout
    assert kw["use_gate_in_kernel"] is True and kw["use_beta_sigmoid_in_kernel"] is True
    assert kw["use_qk_l2norm_in_kernel"] is False and kw["output_final_state"] is True
    assert kw["scale"] == pytest.approx(1 / math.sqrt(128))
    expected_o, expected_final = _RecordingFla()(**kw)
    assert torch.equal(dest["output"], expected_o[0])
    assert torch.equal(dest["new_state"], expected_final)


def test_missing_state_is_passed_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = _gdn_inputs([4], with_state=False, scale=0.3)
    fake = _RecordingFla()
    monkeypatch.setattr(fla_gdn, "load_chunk_gated_delta_rule", lambda: fake)
    fla_gdn.run(*inputs.values(), *_destinations(inputs).values())
    assert fake.calls[0]["initial_state"] is None
    assert fake.calls[0]["scale"] == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("scale", "expected"),
    [(None, 1 / math.sqrt(128)), (0.0, 1 / math.sqrt(128)), (0.25, 0.25), (torch.tensor(0.0), 1 / math.sqrt(128))],
)
def test_scale_rule(scale: float | torch.Tensor | None, expected: float) -> None:
    assert fla_gdn.resolve_scale(scale) == pytest.approx(expected)


def test_mapping_reproduces_our_reference_under_fla_semantics(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = _gdn_inputs([3, 5, 1], with_state=True, scale=0.0, seed=1)
    reference_output, reference_state = _load_reference()(**inputs)

    monkeypatch.setattr(fla_gdn, "load_chunk_gated_delta_rule", lambda: _fla_contract)
    dest = _destinations(inputs)
    fla_gdn.run(*inputs.values(), *dest.values())
    torch.testing.assert_close(dest["output"], reference_output, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(dest["new_state"], reference_state, atol=1e-4, rtol=1e-4)

    # The check can see a layout mistake: fla reading our k-last state as [K, V] disagrees.
    monkeypatch.setattr(
        fla_gdn, "load_chunk_gated_delta_rule", lambda: lambda **kw: _fla_contract(**{**kw, "state_v_first": False})
    )
    fla_gdn.run(*inputs.values(), *dest.values())
    assert not torch.allclose(dest["new_state"], reference_state, atol=1e-2, rtol=1e-2)


def test_wrong_destination_shape_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = _gdn_inputs([2, 2], with_state=True, scale=0.0)
    dest = _destinations(inputs)
    monkeypatch.setattr(fla_gdn, "load_chunk_gated_delta_rule", lambda: _RecordingFla())
    with pytest.raises(fla_gdn.AdapterInputError, match="new_state must have shape"):
        fla_gdn.run(*inputs.values(), dest["output"], dest["new_state"][:1])


def test_library_absent_or_other_version_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    load_uncached = fla_gdn.import_chunk_gated_delta_rule.__wrapped__

    def absent(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", absent)
    with pytest.raises(fla_gdn.LibraryUnavailableError, match="fla-core is not installed"):
        load_uncached()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.0")
    with pytest.raises(fla_gdn.LibraryUnavailableError, match="targets 0.6.0"):
        load_uncached()


@triton.autotune(
    configs=[triton.Config({"BLOCK": 16}, num_warps=4), triton.Config({"BLOCK": 32}, num_warps=8)], key=["N"]
)
@triton.jit
def _autotuned_kernel(x, N, BLOCK: tl.constexpr):  # never launched: its autotuner is what the pinning fills
    pass


@triton.jit
def _plain_kernel(x, N):  # not autotuned: nothing to pin
    pass


PINNED_FIELDS = {"kwargs": {"BLOCK": 32}, "num_warps": 8, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
KERNEL_NAME = f"{__name__}._autotuned_kernel"


def test_gpu_key_is_the_device_name_with_underscores() -> None:
    assert fla_gdn.gpu_key("NVIDIA H200") == "NVIDIA_H200"
    assert fla_gdn.gpu_key(" NVIDIA H100 80GB HBM3 ") == "NVIDIA_H100_80GB_HBM3"


def test_pinned_configs_fill_the_autotuner_cache_under_their_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_autotuned_kernel, "cache", {})
    pinned = {KERNEL_NAME: [{"key": [4096, "torch.bfloat16"], "config": PINNED_FIELDS, "median_ms": 0.1}]}
    assert fla_gdn.pin_configs(pinned, {KERNEL_NAME: _autotuned_kernel}) == 1
    config = _autotuned_kernel.cache[(4096, "torch.bfloat16")]
    assert config == triton.Config({"BLOCK": 32}, num_warps=8, num_stages=3)
    with pytest.raises(fla_gdn.LibraryUnavailableError, match="re-run tools/tune_fla.py"):
        fla_gdn.pin_configs({"fla.gone.kernel": []}, {KERNEL_NAME: _autotuned_kernel})


@triton.heuristics({"BLOCK": lambda args: 16})
@triton.autotune(configs=[triton.Config({}, num_warps=4), triton.Config({}, num_warps=8)], key=["N"])
@triton.jit
def _heuristic_autotuned_kernel(x, N, BLOCK: tl.constexpr):  # fla stacks heuristics on some autotuned kernels
    pass


def test_fla_autotuners_are_found_by_module_and_function(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("fla.ops.fake")
    fake.kernel = _autotuned_kernel
    fake.wrapped = _heuristic_autotuned_kernel
    fake.plain = _plain_kernel
    monkeypatch.setitem(sys.modules, "fla.ops.fake", fake)
    found = fla_gdn.fla_autotuners()
    assert found[KERNEL_NAME] is _autotuned_kernel
    assert found[f"{__name__}._heuristic_autotuned_kernel"] is _heuristic_autotuned_kernel.fn
    assert f"{__name__}._plain_kernel" not in found


def test_loading_fla_pins_this_gpus_configs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    pinned_with: list[dict[str, Any]] = []
    monkeypatch.setattr(fla_gdn, "import_chunk_gated_delta_rule", lambda: "fla's function")
    monkeypatch.setattr(fla_gdn, "fla_autotuners", lambda: {})
    monkeypatch.setattr(fla_gdn, "pin_configs", lambda pinned, autotuners: pinned_with.append(pinned) or 1)
    monkeypatch.setattr(fla_gdn, "PINNED_CONFIGS", {"NVIDIA_H200": {KERNEL_NAME: []}})
    load = fla_gdn.load_chunk_gated_delta_rule.__wrapped__
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200")
    assert load() == "fla's function" and pinned_with == [{KERNEL_NAME: []}]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100")
    assert load() == "fla's function" and len(pinned_with) == 1  # no entry: fla autotunes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("lengths", "with_state", "scale"),
    [([1, 63, 64, 130, 7], True, 0.0), ([200], False, 0.3), ([6], True, 0.2)],
)
def test_fla_matches_our_reference_on_gpu(lengths: list[int], with_state: bool, scale: float) -> None:
    try:
        fla_gdn.load_chunk_gated_delta_rule()
    except fla_gdn.LibraryUnavailableError as error:
        pytest.skip(str(error))
    inputs = _gdn_inputs(lengths, with_state=with_state, scale=scale, device="cuda", seed=len(lengths))
    state_before = None if inputs["state"] is None else inputs["state"].clone()
    reference_output, reference_state = _load_reference()(**inputs)

    dest = _destinations(inputs)
    fla_gdn.run(*inputs.values(), *dest.values())
    torch.cuda.synchronize()
    torch.testing.assert_close(dest["output"], reference_output, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(dest["new_state"], reference_state, atol=1e-2, rtol=1e-2)
    if state_before is not None:
        assert torch.equal(inputs["state"], state_before)  # the input state is read, not written
