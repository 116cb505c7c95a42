"""fa3_dsa adapter: the mapping onto FlashAttention-3's paged `flash_attn_with_kvcache` on CPU (FA3
replaced by a fake that follows its documented contract), the real kernel on an SM90 GPU against our
reference."""

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
from hopperbench.tracks import DSA_ATTENTION
from hopperbench.tracks.dsa_attention.adapters import fa3_dsa

from dsa_adapter_inputs import CKV, HEADS, KPE, PAGE, SM_SCALE, destinations, dsa_inputs, load_reference


def _fa3_contract(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    qv: torch.Tensor,
    cache_seqlens: torch.Tensor,
    page_table: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    return_softmax_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA3 0251105a's documented paged-KV semantics (hopper/flash_attn_interface.py's docstring, the
    tests' attention_ref, the kernel's empty-row store), in fp32: key j < cache_seqlens[b] of batch b is
    row page_table[b, j // page_size] * page_size + j % page_size; logits are softmax_scale * (q.k +
    qv.v); lse is the NATURAL log-sum-exp, [b, h, s_q]; a batch entry without keys gets out 0 and lse
    -inf. Entries past cache_seqlens are never read, so they are poisoned here. The argument checks of
    flash_api_stable.cpp are asserted, so an adapter that breaks them fails here as on the GPU."""
    b, s_q, h, d = q.shape
    num_pages, page_size, h_k, _ = k_cache.shape
    dv = v_cache.shape[-1]
    assert q.dtype == k_cache.dtype == v_cache.dtype == qv.dtype == torch.bfloat16
    assert v_cache.shape == (num_pages, page_size, h_k, dv) and qv.shape == (b, s_q, h, dv)
    assert h % h_k == 0 and d <= 64 and dv <= 512
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == qv.stride(-1) == 1
    assert page_table.dtype == cache_seqlens.dtype == torch.int32 and page_table.stride(-1) == 1
    assert page_table.shape[0] == b and cache_seqlens.shape == (b,) and cache_seqlens.is_contiguous()
    assert isinstance(softmax_scale, float) and return_softmax_lse and num_splits >= 0
    k_rows = k_cache.reshape(num_pages * page_size, h_k, d)
    v_rows = v_cache.reshape(num_pages * page_size, h_k, dv)
    out = torch.zeros(b, s_q, h, dv)
    lse = torch.full((b, h, s_q), -math.inf)
    for i in range(b):
        n = int(cache_seqlens[i])
        assert 0 <= n <= page_table.shape[1] * page_size
        if n == 0:
            continue
        j = torch.arange(n)
        pages = page_table[i, j // page_size].long()
        assert bool(((pages >= 0) & (pages < num_pages)).all()), "a page id FA3 reads is out of range"
        rows = pages * page_size + j % page_size
        k = k_rows[rows, 0].float()  # h_k == 1 here
        v = v_rows[rows, 0].float()
        logits = (q[i].float() @ k.T + qv[i].float() @ v.T) * softmax_scale  # [s_q, h, n]
        row_lse = torch.logsumexp(logits, dim=-1)
        out[i] = torch.exp(logits - row_lse[..., None]) @ v
        lse[i] = row_lse.transpose(0, 1)
    return out.bfloat16(), lse, torch.empty(0), torch.empty(0)


class _FakeFa3Interface(types.ModuleType):
    """Stands in for `flash_attn_3.flash_attn_interface`: records every call and answers by the contract."""

    def __init__(self) -> None:
        super().__init__("flash_attn_3.flash_attn_interface")
        self.calls: list[dict[str, Any]] = []

    def flash_attn_with_kvcache(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, ...]:
        # The page table's entries past cache_seqlens must not matter: scramble a copy of them.
        table = kwargs["page_table"].clone()
        seen = table.clone()
        for i, n in enumerate(kwargs["cache_seqlens"].tolist()):
            table[i, n:] = -12345
        results = _fa3_contract(q, k_cache, v_cache, **{**kwargs, "page_table": table})
        self.calls.append({"q": q, "k_cache": k_cache, "v_cache": v_cache, "page_table_seen": seen, **kwargs})
        self.calls[-1]["results"] = results
        return results


@pytest.fixture
def fresh_loader() -> Iterator[None]:
    fa3_dsa.load_with_kvcache.cache_clear()
    yield
    fa3_dsa.load_with_kvcache.cache_clear()


@pytest.fixture
def fake_fa3(monkeypatch: pytest.MonkeyPatch, fresh_loader: None) -> _FakeFa3Interface:
    fake = _FakeFa3Interface()
    monkeypatch.setitem(sys.modules, "flash_attn_3", types.ModuleType("flash_attn_3"))
    monkeypatch.setitem(sys.modules, "flash_attn_3.flash_attn_interface", fake)
    monkeypatch.setattr(fa3_dsa, "installed_fa3_version", lambda: fa3_dsa.FA3_VERSION)
    return fake


def test_prepare_views_the_caches_as_one_row_pages_and_copies_nothing(fake_fa3: _FakeFa3Interface) -> None:
    inputs = dsa_inputs(2, 40)
    prepared = fa3_dsa.prepare(*inputs.values())
    assert list(prepared) == list(inputs)  # the same inputs by name, in definition order
    v_cache, k_cache = prepared["ckv_cache"], prepared["kpe_cache"]
    assert v_cache.shape == (40 * PAGE, 1, 1, CKV) and k_cache.shape == (40 * PAGE, 1, 1, KPE)
    assert v_cache.data_ptr() == inputs["ckv_cache"].data_ptr()  # views of our caches
    assert k_cache.data_ptr() == inputs["kpe_cache"].data_ptr()
    row = 5 * PAGE + 17  # flat row id page*64 + offset is FA3's page id at page size 1
    assert torch.equal(v_cache[row, 0, 0], inputs["ckv_cache"][5, 17])
    assert torch.equal(k_cache[row, 0, 0], inputs["kpe_cache"][5, 17])

    fa3_dsa.run(*prepared.values(), *destinations(inputs).values())
    (call,) = fake_fa3.calls
    assert call["k_cache"] is k_cache and call["v_cache"] is v_cache  # the prepared views themselves
    with pytest.raises(fa3_dsa.AdapterInputError, match="cache view"):
        fa3_dsa.run(*inputs.values(), *destinations(inputs).values())  # the raw caches: refused


def test_the_call_gets_q_pe_as_q_q_nope_as_qv_and_the_index_rows_as_page_table(fake_fa3: _FakeFa3Interface) -> None:
    inputs = dsa_inputs(3, 40)

    fa3_dsa.run(*fa3_dsa.prepare(*inputs.values()).values(), *destinations(inputs).values())

    (call,) = fake_fa3.calls
    q, qv = call["q"], call["qv"]
    assert q.shape == (3, 1, HEADS, KPE) and q.data_ptr() == inputs["q_pe"].data_ptr()  # views, no copy
    assert qv.shape == (3, 1, HEADS, CKV) and qv.data_ptr() == inputs["q_nope"].data_ptr()
    table, seqlens = call["page_table_seen"], call["cache_seqlens"]
    assert table.dtype == torch.int32 and torch.equal(table, inputs["sparse_indices"])  # the rows as they are
    assert seqlens.dtype == torch.int32 and seqlens.tolist() == [2048, 1748, 1448]
    assert call["softmax_scale"] == SM_SCALE and call["causal"] is False
    assert call["num_splits"] == 0 and call["return_softmax_lse"] is True


def test_prepare_refuses_padding_before_a_valid_index_with_one_line() -> None:
    inputs = dsa_inputs(3, 40, scattered=True)
    with pytest.raises(fa3_dsa.AdapterInputError, match=r"row 1 has -1 before a valid index") as e:
        fa3_dsa.prepare(*inputs.values())
    assert "\n" not in str(e.value)
    # Rows of padding only, or of no padding, are fine.
    fa3_dsa.check_padding_last(torch.tensor([[-1, -1, -1], [4, 2, 9], [3, -1, -1]], dtype=torch.int32))


def test_results_match_the_reference_under_the_track_rule_with_lse_in_base_2(fake_fa3: _FakeFa3Interface) -> None:
    inputs = dsa_inputs(4, 40, empty_tokens=(2,))
    dest = destinations(inputs)

    fa3_dsa.run(*fa3_dsa.prepare(*inputs.values()).values(), *dest.values())

    ref_output, ref_lse = load_reference()(*inputs.values())
    verdict = check_outputs(DSA_ATTENTION.acceptance, dest, {"output": ref_output, "lse": ref_lse})
    assert verdict.passed, verdict.reason
    # The token without a valid index: FA3 writes out 0 and lse -inf, as the definition wants.
    assert fake_fa3.calls[0]["cache_seqlens"][2] == 0
    assert torch.equal(dest["lse"][2], torch.full((HEADS,), -math.inf))
    assert not dest["output"][2].any()
    # Base 2, not natural: the library's natural lse divided by ln 2.
    _, natural_lse, *_ = fake_fa3.calls[0]["results"]
    valid = [0, 1, 3]
    assert torch.allclose(dest["lse"][valid], natural_lse[valid, :, 0] / math.log(2.0), rtol=1e-6, atol=0)


def test_page_table_of_padding_only_and_full_rows() -> None:
    indices = torch.tensor([[-1, -1, -1, -1], [7, 3, 9, 1], [5, 2, -1, -1]], dtype=torch.int32)
    table, seqlens = fa3_dsa.fa3_page_table(indices)
    assert table is indices
    assert seqlens.dtype == torch.int32 and seqlens.tolist() == [0, 4, 2]


def test_valid_counts_are_computed_once_per_index_tensor_and_version() -> None:
    counts = fa3_dsa.ValidCounts()
    indices = torch.tensor([[7, 3, -1, -1], [5, 2, 9, -1]], dtype=torch.int32)
    first = counts(indices)
    assert first.tolist() == [2, 3] and counts(indices) is first  # kept: no work on the next call
    indices[0, 2] = 4  # an in-place write: its version changes, the counts follow
    assert counts(indices).tolist() == [3, 3]
    same_values = indices.clone()  # another tensor, even with equal values, is counted afresh
    assert counts(same_values) is not counts(indices)


def test_write_results_drops_the_query_axis_and_converts_lse() -> None:
    out = torch.arange(HEADS, dtype=torch.float32)[None, None, :, None].expand(2, 1, HEADS, CKV).bfloat16()
    natural_lse = torch.full((2, HEADS, 1), math.log(8.0))
    natural_lse[1, 3, 0] = -math.inf  # FA3's mark of a batch entry with no keys
    output = torch.empty(2, HEADS, CKV, dtype=torch.bfloat16)
    lse = torch.empty(2, HEADS)

    fa3_dsa.write_results(out, natural_lse, output, lse)

    assert torch.equal(output, out[:, 0])
    expected = torch.full((2, HEADS), 3.0)  # log2(8)
    expected[1, 3] = -math.inf
    assert torch.allclose(lse, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("installed", "message"),
    [
        (None, "flash_attn_3 is not installed"),
        ("3.0.0", "flash_attn_3 3.0.0 is installed; this adapter needs"),  # upstream's unstamped build
        ("3.0.0+00000000", "needs the build of flash-attention@0251105a (3.0.0+0251105a)"),
    ],
)
def test_a_missing_or_unpinned_build_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, fresh_loader: None, installed: str | None, message: str
) -> None:
    monkeypatch.setattr(fa3_dsa, "installed_fa3_version", lambda: installed)
    inputs = dsa_inputs(1, 32)
    with pytest.raises(fa3_dsa.LibraryUnavailableError, match=re.escape(message)) as e:
        fa3_dsa.run(*fa3_dsa.prepare(*inputs.values()).values(), *destinations(inputs).values())
    assert "\n" not in str(e.value)


def test_a_pinned_build_that_does_not_import_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, fresh_loader: None
) -> None:
    monkeypatch.setattr(fa3_dsa, "installed_fa3_version", lambda: fa3_dsa.FA3_VERSION)
    monkeypatch.setitem(sys.modules, "flash_attn_3.flash_attn_interface", None)  # importing it raises
    with pytest.raises(fa3_dsa.LibraryUnavailableError, match="is installed but does not import") as e:
        fa3_dsa.load_with_kvcache()
    assert "\n" not in str(e.value)


def test_pinned_version_is_what_our_build_stamps_for_the_commit() -> None:
    # hopper/__init__.py: __version__ = "3.0.0"; FLASH_ATTN_LOCAL_VERSION=0251105a adds the local part.
    assert fa3_dsa.FA3_VERSION == "3.0.0+0251105a"
    (side,) = [lib for lib in DSA_ATTENTION.libraries if lib.name == "fa3"]
    assert side.package == f"flash_attn_3=={fa3_dsa.FA3_VERSION}" and side.prepare == "prepare"


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
    monkeypatch.setattr(fa3_dsa, "installed_fa3_version", lambda: None)  # would fail if reached
    inputs = dsa_inputs(2, 32)
    for name, edit in change.items():
        inputs[name] = edit(inputs[name])
    with pytest.raises(fa3_dsa.AdapterInputError, match=message):
        fa3_dsa.run(*fa3_dsa.prepare(*inputs.values()).values(), *destinations(dsa_inputs(2, 32)).values())


def _pinned_fa3_importable() -> bool:
    if fa3_dsa.installed_fa3_version() != fa3_dsa.FA3_VERSION:
        return False
    return importlib.util.find_spec("flash_attn_3") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not _pinned_fa3_importable(), reason="needs the pinned flash_attn_3 build (third_party/README.md)")
@pytest.mark.parametrize(
    ("num_tokens", "num_pages"), [(1, 64), (8, 64), (2, 8462), (8, 8462)]
)
def test_fa3_on_the_gpu_passes_the_track_rule(fresh_loader: None, num_tokens: int, num_pages: int) -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FA3 build is for SM90 only")
    empty = (num_tokens - 1,) if num_tokens > 1 else ()
    inputs = dsa_inputs(num_tokens, num_pages, empty_tokens=empty, device="cuda")
    dest = destinations(inputs)

    fa3_dsa.run(*fa3_dsa.prepare(*inputs.values()).values(), *dest.values())
    torch.cuda.synchronize()

    ref_output, ref_lse = load_reference()(*inputs.values())
    verdict = check_outputs(DSA_ATTENTION.acceptance, dest, {"output": ref_output, "lse": ref_lse})
    assert verdict.passed, verdict.reason
    if empty:
        assert torch.all(dest["lse"][empty[0]] == -math.inf) and not dest["output"][empty[0]].any()
