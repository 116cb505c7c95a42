"""flashmla_dsa adapter: the mapping onto FlashMLA's sparse prefill call on CPU (FlashMLA replaced by a
fake that follows its documented contract), the real kernel on an SM90 GPU against our reference."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hopperbench.acceptance import check_outputs
from hopperbench.tracks.dsa_attention.adapters import flashmla_dsa
from hopperbench.tracks import DSA_ATTENTION

from dsa_adapter_inputs import CKV, HEADS, PAGE, SM_SCALE, TOPK, destinations, dsa_inputs, load_reference


def _flashmla_contract(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA 9241ae3's documented sparse prefill semantics (interface docstring, tests/ref.py, the
    SM90 kernel's stores), in fp32: an index < 0 or >= s_kv is invalid; lse is the NATURAL log-sum-exp;
    a row with no valid index gets out 0, max_logits -inf and lse +inf. Its argument checks are
    asserted, so an adapter that breaks them fails here as it would on the GPU."""
    s_q, h_q, d_qk = q.shape
    s_kv = kv.shape[0]
    assert q.dtype == kv.dtype == torch.bfloat16 and indices.dtype == torch.int32
    assert h_q in (64, 128) and d_qk in (512, 576) and d_v == 512
    assert kv.shape == (s_kv, 1, d_qk) and indices.shape[:2] == (s_q, 1)
    assert indices.shape[2] % 128 == 0
    assert q.stride(-1) == kv.stride(-1) == indices.stride(-1) == 1
    assert isinstance(sm_scale, float)
    flat = indices[:, 0].long()
    invalid = (flat < 0) | (flat >= s_kv)
    keys = kv[:, 0][torch.where(invalid, 0, flat)].float()  # [s_q, topk, d_qk]
    logits = torch.bmm(q.float(), keys.transpose(1, 2)) * sm_scale
    logits.masked_fill_(invalid[:, None, :], -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    max_logits = logits.amax(dim=-1)
    lonely = lse == -math.inf
    probs = torch.exp(logits - torch.where(lonely, math.inf, lse)[..., None])
    out = torch.bmm(probs, keys[..., :d_v])
    return out.bfloat16(), max_logits, torch.where(lonely, math.inf, lse)


class _FakeFlashMla(types.ModuleType):
    """Stands in for the `flash_mla` package: records every call and answers by the contract."""

    def __init__(self) -> None:
        super().__init__("flash_mla")
        self.calls: list[dict[str, Any]] = []

    def flash_mla_sparse_fwd(
        self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        results = _flashmla_contract(q, kv, indices, sm_scale, d_v)
        self.calls.append({"q": q, "kv": kv, "indices": indices, "sm_scale": sm_scale, "d_v": d_v, "results": results})
        return results


@pytest.fixture
def fresh_loader() -> Iterator[None]:
    flashmla_dsa.load_sparse_fwd.cache_clear()
    yield
    flashmla_dsa.load_sparse_fwd.cache_clear()


@pytest.fixture
def fake_flash_mla(monkeypatch: pytest.MonkeyPatch, fresh_loader: None) -> _FakeFlashMla:
    fake = _FakeFlashMla()
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    monkeypatch.setattr(flashmla_dsa, "installed_flash_mla_version", lambda: flashmla_dsa.FLASH_MLA_VERSION)
    return fake


def test_the_timed_call_runs_on_the_cache_prepare_stored_and_copies_no_cache(fake_flash_mla: _FakeFlashMla) -> None:
    inputs = dsa_inputs(2, 40)
    prepared = flashmla_dsa.prepare(*inputs.values())
    assert list(prepared) == list(inputs)  # the same inputs by name, in definition order
    flashmla_dsa.run(*prepared.values(), *destinations(inputs).values())
    (call,) = fake_flash_mla.calls
    assert call["kv"].data_ptr() == prepared["ckv_cache"].data_ptr()  # the stored cache itself
    with pytest.raises(flashmla_dsa.AdapterInputError, match="packed cache"):
        flashmla_dsa.run(*inputs.values(), *destinations(inputs).values())  # the split caches: refused


def test_the_call_gets_padded_heads_a_packed_cache_and_the_indices_as_a_view(fake_flash_mla: _FakeFlashMla) -> None:
    inputs = dsa_inputs(3, 40)
    dest = destinations(inputs)

    flashmla_dsa.run(*flashmla_dsa.prepare(*inputs.values()).values(), *dest.values())

    (call,) = fake_flash_mla.calls
    q, kv, indices = call["q"], call["kv"], call["indices"]
    assert q.shape == (3, 64, 576) and q.dtype == torch.bfloat16
    assert torch.equal(q[:, :HEADS, :CKV], inputs["q_nope"]) and torch.equal(q[:, :HEADS, CKV:], inputs["q_pe"])
    assert not q[:, HEADS:].any()  # the 48 padded heads are zeros
    assert kv.shape == (40 * PAGE, 1, 576) and kv.dtype == torch.bfloat16 and kv.is_contiguous()
    row = 5 * PAGE + 17  # flat row id page*64 + offset is the same row of FlashMLA's kv
    assert torch.equal(kv[row, 0, :CKV], inputs["ckv_cache"][5, 17])
    assert torch.equal(kv[row, 0, CKV:], inputs["kpe_cache"][5, 17])
    assert indices.shape == (3, 1, TOPK) and indices.dtype == torch.int32
    assert indices.data_ptr() == inputs["sparse_indices"].data_ptr()  # -1 padding passes unchanged, no copy
    assert call["sm_scale"] == SM_SCALE and call["d_v"] == 512


def test_results_match_the_reference_under_the_track_rule_with_lse_in_base_2(fake_flash_mla: _FakeFlashMla) -> None:
    inputs = dsa_inputs(4, 40, empty_tokens=(2,))
    dest = destinations(inputs)

    flashmla_dsa.run(*flashmla_dsa.prepare(*inputs.values()).values(), *dest.values())

    ref_output, ref_lse = load_reference()(*inputs.values())
    verdict = check_outputs(DSA_ATTENTION.acceptance, dest, {"output": ref_output, "lse": ref_lse})
    assert verdict.passed, verdict.reason
    # The token without a valid index: FlashMLA says lse +inf, the definition -inf; output 0 both.
    assert torch.equal(dest["lse"][2], torch.full((HEADS,), -math.inf))
    assert not dest["output"][2].any()
    # Base 2, not natural: the library's natural lse divided by ln 2 wherever a row was valid.
    _, _, natural_lse = fake_flash_mla.calls[0]["results"]
    valid = [0, 1, 3]
    assert torch.allclose(dest["lse"][valid], natural_lse[valid, :HEADS] / math.log(2.0), rtol=1e-6, atol=0)


def test_write_results_keeps_the_first_16_heads_and_converts_lse() -> None:
    out = torch.arange(64, dtype=torch.float32)[None, :, None].expand(2, 64, CKV).bfloat16()
    natural_lse = torch.full((2, 64), math.log(8.0))
    natural_lse[1, 3] = math.inf  # FlashMLA's mark of a row with no valid index
    output = torch.empty(2, HEADS, CKV, dtype=torch.bfloat16)
    lse = torch.empty(2, HEADS)

    flashmla_dsa.write_results(out, natural_lse, output, lse)

    assert torch.equal(output, out[:, :HEADS])
    expected = torch.full((2, HEADS), 3.0)  # log2(8)
    expected[1, 3] = -math.inf
    assert torch.allclose(lse, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("installed", "message"),
    [
        (None, "flash_mla is not installed"),
        ("1.0.0+2026.5.1.10.0.0", "flash_mla 1.0.0+2026.5.1.10.0.0 is installed; this adapter needs"),  # no git
        ("1.0.0+0000000", "needs the build of FlashMLA@9241ae3 (1.0.0+9241ae3)"),
    ],
)
def test_a_missing_or_unpinned_build_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, fresh_loader: None, installed: str | None, message: str
) -> None:
    monkeypatch.setattr(flashmla_dsa, "installed_flash_mla_version", lambda: installed)
    inputs = dsa_inputs(1, 32)
    with pytest.raises(flashmla_dsa.LibraryUnavailableError, match=re.escape(message)) as e:
        flashmla_dsa.run(*flashmla_dsa.prepare(*inputs.values()).values(), *destinations(inputs).values())
    assert "\n" not in str(e.value)


def test_a_pinned_build_that_does_not_import_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, fresh_loader: None
) -> None:
    monkeypatch.setattr(flashmla_dsa, "installed_flash_mla_version", lambda: flashmla_dsa.FLASH_MLA_VERSION)
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # importing it raises ImportError
    with pytest.raises(flashmla_dsa.LibraryUnavailableError, match="is installed but does not import") as e:
        flashmla_dsa.load_sparse_fwd()
    assert "\n" not in str(e.value)


def test_pinned_version_is_what_flashmla_setup_stamps_for_the_commit() -> None:
    # setup.py: version="1.0.0" + "+" + `git rev-parse --short HEAD`.
    assert flashmla_dsa.FLASH_MLA_VERSION == "1.0.0+9241ae3"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sparse_indices": lambda t: t.long()}, "sparse_indices must be int32, got torch.int64"),
        ({"q_nope": lambda t: t.float()}, "q_nope must be bfloat16, got torch.float32"),
        ({"q_pe": lambda t: t[:, :8]}, r"q_pe must have shape \(2, 16, 64\), got \(2, 8, 64\)"),
        ({"sparse_indices": lambda t: t[:, :1024]}, r"sparse_indices must have shape \(2, 2048\)"),
    ],
)
def test_bad_arguments_are_rejected_before_the_library_is_touched(
    monkeypatch: pytest.MonkeyPatch,
    fresh_loader: None,
    change: dict[str, Callable[[torch.Tensor], torch.Tensor]],
    message: str,
) -> None:
    monkeypatch.setattr(flashmla_dsa, "installed_flash_mla_version", lambda: None)  # would fail if reached
    inputs = dsa_inputs(2, 32)
    for name, edit in change.items():
        inputs[name] = edit(inputs[name])
    with pytest.raises(flashmla_dsa.AdapterInputError, match=message):
        flashmla_dsa.run(*flashmla_dsa.prepare(*inputs.values()).values(), *destinations(dsa_inputs(2, 32)).values())


def _pinned_flash_mla_importable() -> bool:
    if flashmla_dsa.installed_flash_mla_version() != flashmla_dsa.FLASH_MLA_VERSION:
        return False
    return importlib.util.find_spec("flash_mla") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(
    not _pinned_flash_mla_importable(), reason="needs the pinned flash_mla build (third_party/README.md)"
)
@pytest.mark.parametrize(("num_tokens", "num_pages"), [(1, 64), (8, 64), (8, 8462)])
def test_flashmla_on_the_gpu_passes_the_track_rule(fresh_loader: None, num_tokens: int, num_pages: int) -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FlashMLA's sparse prefill side is built for SM90 only")
    empty = (num_tokens - 1,) if num_tokens > 1 else ()
    inputs = dsa_inputs(num_tokens, num_pages, empty_tokens=empty, device="cuda")
    dest = destinations(inputs)

    flashmla_dsa.run(*flashmla_dsa.prepare(*inputs.values()).values(), *dest.values())
    torch.cuda.synchronize()

    ref_output, ref_lse = load_reference()(*inputs.values())
    verdict = check_outputs(DSA_ATTENTION.acceptance, dest, {"output": ref_output, "lse": ref_lse})
    assert verdict.passed, verdict.reason
    if empty:
        assert torch.all(dest["lse"][empty[0]] == -math.inf) and not dest["output"][empty[0]].any()
