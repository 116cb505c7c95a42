"""flashinfer_gdn adapter: the mapping onto FlashInfer's `chunk_gated_delta_rule` on CPU (FlashInfer
replaced by a recorder), the real SM90 kernels against our reference on a GPU."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hopperbench.acceptance import check_outputs
from hopperbench.tracks.gdn_prefill.adapters import flashinfer_gdn
from hopperbench.tracks import GDN_PREFILL, get_track


def _gdn_inputs(lengths: list[int], *, with_state: bool = True, device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    total, n = sum(lengths), len(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    q = F.normalize(torch.randn(total, 4, 128, generator=gen), dim=-1).bfloat16()
    k = F.normalize(torch.randn(total, 4, 128, generator=gen), dim=-1).bfloat16()
    inputs = {
        "q": q,
        "k": k,
        "v": torch.randn(total, 8, 128, generator=gen).bfloat16(),
        "state": 0.2 * torch.randn(n, 8, 128, 128, generator=gen) if with_state else None,
        "A_log": torch.log(torch.rand(8, generator=gen) * 15 + 1),
        "a": torch.randn(total, 8, generator=gen).bfloat16(),
        "dt_bias": torch.rand(8, generator=gen) * -4 - 2.3,
        "b": torch.randn(total, 8, generator=gen).bfloat16(),
        "cu_seqlens": cu,
        "scale": 1 / math.sqrt(128),
    }
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _destinations(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    n = inputs["cu_seqlens"].shape[0] - 1
    return {
        "output": torch.full_like(inputs["v"], float("nan")),
        "new_state": torch.full((n, 8, 128, 128), float("nan"), device=inputs["v"].device),
    }


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def chunk_gated_delta_rule(q, k, v, **kwargs):
        calls.append({"q": q, "k": k, "v": v, **kwargs})
        kwargs["output"].zero_()
        kwargs["output_state"].zero_()

    monkeypatch.setattr(flashinfer_gdn, "load_chunk_gated_delta_rule", lambda: chunk_gated_delta_rule)
    # The gates' Triton kernel needs a GPU (or a process that interprets it: the test below).
    monkeypatch.setattr(flashinfer_gdn, "gates", lambda A_log, a, dt_bias, b: (a.float(), b.float()))
    return calls


def test_the_call_gets_the_gates_and_writes_the_destinations(recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = _gdn_inputs([5, 9])
    dest = _destinations(inputs)
    made = []

    def gates(A_log, a, dt_bias, b):
        assert A_log is inputs["A_log"] and a is inputs["a"] and dt_bias is inputs["dt_bias"] and b is inputs["b"]
        made.append((torch.rand(14, 8), torch.rand(14, 8)))
        return made[-1]

    monkeypatch.setattr(flashinfer_gdn, "gates", gates)
    flashinfer_gdn.run(*inputs.values(), *dest.values())
    (call,) = recorded
    assert call["q"] is inputs["q"] and call["k"] is inputs["k"] and call["v"] is inputs["v"]
    assert call["g"] is made[0][0] and call["beta"] is made[0][1]
    assert call["initial_state"] is inputs["state"] and call["output_final_state"] is True
    assert call["output"] is dest["output"] and call["output_state"] is dest["new_state"]
    assert call["cu_seqlens"] is inputs["cu_seqlens"] and call["scale"] == pytest.approx(1 / math.sqrt(128))
    assert call["use_cp"] is False  # 14 tokens in two sequences: FlashInfer's fused kernel


def test_the_side_takes_flashinfers_pipeline_for_one_or_two_long_sequences_and_its_fused_kernel_otherwise() -> None:
    assert flashinfer_gdn.use_cp_for(6, 1) is False
    assert flashinfer_gdn.use_cp_for(999, 1) is False
    assert flashinfer_gdn.use_cp_for(1000, 1) == "auto"
    assert flashinfer_gdn.use_cp_for(1999, 2) is False
    assert flashinfer_gdn.use_cp_for(2040, 2) == "auto"  # official workload 79: the pipeline 1.2x faster
    assert flashinfer_gdn.use_cp_for(8192, 1) == "auto"
    assert flashinfer_gdn.use_cp_for(4096, 3) is False  # 3-8 sequences: the fused kernel measured faster
    assert flashinfer_gdn.use_cp_for(8192, 8) is False
    assert flashinfer_gdn.use_cp_for(8192, 32) is False
    assert flashinfer_gdn.use_cp_for(0, 0) is False


GATES_ON_CPU = """
import torch, torch.nn.functional as F
from hopperbench.tracks.gdn_prefill.adapters import flashinfer_gdn
gen = torch.Generator().manual_seed(0)
T = 3000
A_log = torch.log(torch.rand(8, generator=gen) * 15 + 1)
dt_bias = torch.rand(8, generator=gen) * -4 - 2.3
a = (torch.randn(T, 8, generator=gen) * 8).bfloat16()
a[:8] = torch.tensor([-60.0, -30.0, -18.0, -8.0, 0.0, 17.0, 23.0, 60.0]).bfloat16()
b = (torch.randn(T, 8, generator=gen) * 6).bfloat16()
g, beta = flashinfer_gdn.gates(A_log, a, dt_bias, b)
decay = torch.exp(-torch.exp(A_log) * F.softplus(a.float() + dt_bias))
assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == (T, 8)
assert torch.allclose(g, decay, rtol=2e-5, atol=2e-7), (g - decay).abs().max()
assert torch.allclose(beta, torch.sigmoid(b.float()), rtol=2e-6, atol=1e-7)
empty = flashinfer_gdn.gates(A_log, a[:0], dt_bias, b[:0])
assert all(t.shape == (0, 8) for t in empty)
print("ok")
"""


def test_the_fused_gates_are_the_definitions_in_triton_s_interpreter() -> None:
    # The Triton kernel itself, run by Triton's CPU interpreter (chosen when the kernel is defined: a fresh process).
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", GATES_ON_CPU], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("scale", [None, 0.0])
def test_a_missing_scale_means_one_over_sqrt_128(recorded, scale) -> None:
    inputs = {**_gdn_inputs([4], with_state=False), "scale": scale}
    flashinfer_gdn.run(*inputs.values(), *_destinations(inputs).values())
    assert recorded[0]["scale"] == pytest.approx(1 / math.sqrt(128)) and recorded[0]["initial_state"] is None


def test_bad_shapes_are_rejected_before_the_library_is_touched(recorded) -> None:
    inputs = _gdn_inputs([4, 4])
    inputs["state"] = inputs["state"][:1]
    with pytest.raises(flashinfer_gdn.AdapterInputError, match="state must be"):
        flashinfer_gdn.run(*inputs.values(), *_destinations(_gdn_inputs([4, 4])).values())
    assert recorded == []


def test_an_other_release_is_refused_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    flashinfer_gdn.load_chunk_gated_delta_rule.cache_clear()
    monkeypatch.setattr(flashinfer_gdn.importlib.metadata, "version", lambda name: "0.6.4")
    try:
        with pytest.raises(flashinfer_gdn.LibraryUnavailableError, match="needs 0.7.2.post1"):
            flashinfer_gdn.load_chunk_gated_delta_rule()
    finally:
        flashinfer_gdn.load_chunk_gated_delta_rule.cache_clear()


def test_the_side_is_registered_as_the_gdn_flashinfer_baseline() -> None:
    (side,) = [lib for lib in get_track("gdn_prefill").libraries if lib.name == "flashinfer_gdn"]
    assert side.package == f"flashinfer-python=={flashinfer_gdn.FLASHINFER_VERSION}"
    assert "gates" in side.timed_call


def _reference():
    spec = importlib.util.spec_from_file_location("gdn_reference", GDN_PREFILL.reference_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run


def _flashinfer_importable() -> bool:
    try:
        return importlib.metadata.version("flashinfer-python") == flashinfer_gdn.FLASHINFER_VERSION
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not _flashinfer_importable(), reason="needs flashinfer-python 0.7.2.post1")
@pytest.mark.parametrize(("lengths", "with_state"), [([6], True), ([64, 130], True), ([300], False)])
def test_flashinfer_on_the_gpu_passes_the_track_rule(lengths: list[int], with_state: bool) -> None:
    flashinfer_gdn.load_chunk_gated_delta_rule.cache_clear()
    inputs = _gdn_inputs(lengths, with_state=with_state, device="cuda")
    dest = _destinations(inputs)
    flashinfer_gdn.run(*inputs.values(), *dest.values())
    torch.cuda.synchronize()
    output, new_state = _reference()(*inputs.values())
    verdict = check_outputs(GDN_PREFILL.acceptance, dest, {"output": output, "new_state": new_state})
    assert verdict.passed, verdict.reason
