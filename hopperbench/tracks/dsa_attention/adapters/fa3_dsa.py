"""FlashAttention-3's paged KV-cache forward (`flash_attn_with_kvcache`, bf16, MLA through `qv`) as a
dsa_attention side, called the way SGLang's NSA backend calls it for sparse decode ("fa3").

Pinned source: Dao-AILab/flash-attention@0251105a2fb19d2957484b7f023cd8c115286ced, folder `hopper/`
(FA3 3.0.0), with NVIDIA/cutlass@7127592069c2fe01b041e174ba4345ef9b279671 (its `csrc/cutlass`),
built as third_party/README.md says. What the adapter relies on, read at that commit (paths under
`hopper/`):

- `flash_attn_with_kvcache(q, k_cache, v_cache, ..., qv=None, cache_seqlens=None, page_table=None,
  softmax_scale=None, causal=False, ..., num_splits=0, ..., return_softmax_lse=False)`
  (flash_attn_interface.py:942-973) -> `(out, softmax_lse, *rest)` with `return_softmax_lse`
  (flash_attn_interface.py:1103). Imported as `from flash_attn_3 import flash_attn_interface`
  (README.md:61 of the repository).
- q [b, s_q, h, d], qv [b, s_q, h, dv]; with a page table, k_cache [num_pages, page_size, h_k, d] and
  v_cache [num_pages, page_size, h_k, dv], "page_block_size can be arbitrary (e.g, 1, 2, 3, 64,
  etc.)" (flash_attn_interface.py:1018-1026; checked in flash_api_stable.cpp:891-893). Only the last
  dimension of q, k, v must be contiguous (flash_api_stable.cpp:795-797): the other strides are the
  kernel's arguments, so views of our caches serve.
- d != dv is accepted for d <= 64 and dv <= 512 on Hopper, bf16/fp16 when dv > 256
  (flash_api_stable.cpp:850-860): our d = 64 (kpe) and dv = 512 (ckv) is FA3's MLA instantiation
  `hdim64_512` (instantiations/flash_fwd_hdim64_512_bf16_paged_split_sm90.cu). The logits are
  `softmax_scale * (q.k + qv.v)` (qv is the second half of the query, dotted with the V rows:
  the tests' reference `attention_ref`, test_util.py:289-293), which is our
  `(q_pe.kpe + q_nope.ckv) * sm_scale` with k = kpe rows and v = ckv rows.
- page_table [b, max_num_pages_per_seq] int32, last dimension contiguous (flash_api_stable.cpp:
  804-805). `cache_seqlens` [b] int32 (flash_attn_interface.py:1030) is passed as `seqused_k`
  (flash_attn_interface.py:1068-1082): key j < cache_seqlens[b] of batch b is row
  page_table[b, j // page_size] * page_size + j % page_size. Entries at or past cache_seqlens[b] are
  never read (paged_kv.h:148 loads 0 for rows >= seqlen_k).
- With s_q = 1 causal is turned off anyway (flash_api_stable.cpp:866-871); page size 1 is not a
  multiple of the key block, so the kernel takes the non-TMA paged path, which always packs the query
  heads of a KV head together (`get_pack_gqa`, flash_api_stable.cpp:491-494). `num_splits=0` lets FA3
  choose the split of the keys over SMs (flash_api_stable.cpp:1050) and combine the partial results
  (flash_fwd_combine.cu), as SGLang does outside its deterministic mode.
- softmax_lse [b, h, s_q] fp32 is the NATURAL log-sum-exp of the scaled logits
  (flash_api_stable.cpp:956; `row_max * softmax_scale_log2 * ln2 + log(sum)`, softmax.h:151). A batch
  entry with no keys gets out 0 and lse -inf (flash_fwd_kernel_sm90.h:446-448, epilogue_fwd.hpp:
  409-447); the split combine keeps an all -inf row at -inf (flash_fwd_combine_kernel.h:602-606).

How SGLang calls it (sgl-project/sglang, python/sglang/srt/layers/attention/nsa_backend.py, read at
005e8bf8): `forward_decode` with `nsa_decode_impl == "fa3"` passes q_rope, q_nope, the top-k page
table `page_table_1` ("always with page_size = 1", `NSAMetadata`) and `nsa_cache_seqlens_int32` (the
context length clipped to top-k) to `_forward_fa3`, which views the cache's rope columns as k_cache
[-1, 1, 1, 64] and its nope columns as v_cache [-1, 1, 1, 512] and calls
`flash_attn_with_kvcache(q=q_rope, k_cache, v_cache, qv=q_nope, page_table, cache_seqlens, ...,
softmax_scale=sm_scale, causal=True, num_splits=self.num_splits)` (0 unless deterministic inference
is on). SGLang's top-k puts the -1 padding last, so its seqlens are the count of valid entries.

Definition `dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64` -> FA3, in two steps:

- `prepare` (untimed, once per input set): kpe_cache [P,64,64] -> k cache [P*64, 1, 1, 64] and
  ckv_cache [P,64,512] -> v cache [P*64, 1, 1, 512], pages of one row each, so a flat row id
  `page*64 + offset` is a page id. Both are views (no copy): our cache already is the layout SGLang
  keeps with page size 1.
  It also checks, with a host read, that every row's -1 padding comes after its valid ids: FA3
  reads the first cache_seqlens entries of a row, and SGLang's top-k writes its padding last, so its
  page table is the index row itself. Our definition allows -1 anywhere; a row that has one before a
  valid id is refused with one line (compacting it inside the call would time a sort that no engine
  runs).
- `run` (the timed call):
  - sparse_indices [T, 2048] int32 is the page table as it is (no copy); cache_seqlens [T] int32 =
    the count of ids >= 0 per row (2 torch kernels), computed once per index tensor and kept
    (`ValidCounts`): an engine derives it once per step from the context lengths, for every layer, so
    it is not per-call work of the attention (as the fla side keeps its chunk indices per
    `cu_seqlens` tensor).
  - q_pe [T,16,64] -> q [T,1,16,64] and q_nope [T,16,512] -> qv [T,1,16,512] (views: batch T, one
    query each, 16 heads over one KV head); sm_scale -> `softmax_scale` as a Python float.
  - output [T,16,512] <- out [T,1,16,512] (one copy); lse [T,16] <- softmax_lse [T,16,1] / ln 2
    (one kernel; -inf, FA3's mark of a token with no valid index, stays -inf as the definition
    wants, with output 0).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import math
from collections.abc import Callable

import torch

FA3_DISTRIBUTION = "flash_attn_3"
FA3_COMMIT = "0251105a2fb19d2957484b7f023cd8c115286ced"
# hopper/__init__.py says 3.0.0; our build sets FLASH_ATTN_LOCAL_VERSION to the short commit, which
# hopper/setup.py appends as the local version (`get_package_version`).
FA3_VERSION = f"3.0.0+{FA3_COMMIT[:8]}"

NUM_HEADS = 16
HEAD_DIM_CKV = 512
HEAD_DIM_KPE = 64
PAGE_SIZE = 64
TOPK = 2048
LOG2_E = 1.0 / math.log(2.0)

WithKVCache = Callable[..., tuple[torch.Tensor, ...]]


class LibraryUnavailableError(RuntimeError):
    """The library this adapter calls is missing or is not the build it was written for."""


class AdapterInputError(ValueError):
    """The arguments do not describe a dsa_attention call."""


def installed_fa3_version() -> str | None:
    """The installed flash_attn_3 distribution's version, None when it is not installed."""
    try:
        return importlib.metadata.version(FA3_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def load_with_kvcache() -> WithKVCache:
    """FA3's `flash_attn_with_kvcache` from the pinned build (checked once per process)."""
    installed = installed_fa3_version()
    if installed is None:
        raise LibraryUnavailableError(
            f"{FA3_DISTRIBUTION} is not installed (build FlashAttention-3 as third_party/README.md says)"
        )
    if installed != FA3_VERSION:
        raise LibraryUnavailableError(
            f"{FA3_DISTRIBUTION} {installed} is installed; this adapter needs the build of "
            f"flash-attention@{FA3_COMMIT[:8]} ({FA3_VERSION})"
        )
    try:
        module = importlib.import_module("flash_attn_3.flash_attn_interface")
    except ImportError as e:  # e.g. the extension was built against another torch
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise LibraryUnavailableError(f"flash_attn_3 {installed} is installed but does not import: {first_line}") from None
    with_kvcache = getattr(module, "flash_attn_with_kvcache", None)
    if with_kvcache is None:
        raise LibraryUnavailableError(f"flash_attn_3 {installed} has no flash_attn_with_kvcache")
    return with_kvcache


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise AdapterInputError(f"{name} must have shape {expected}, got {tuple(tensor.shape)}")


def check_caches(ckv_cache: torch.Tensor, kpe_cache: torch.Tensor) -> None:
    """Shapes and dtypes of the definition's two caches (host-side metadata only)."""
    num_pages = ckv_cache.shape[0]
    _check_shape("ckv_cache", ckv_cache, (num_pages, PAGE_SIZE, HEAD_DIM_CKV))
    _check_shape("kpe_cache", kpe_cache, (num_pages, PAGE_SIZE, HEAD_DIM_KPE))
    for name, tensor in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        if tensor.dtype != torch.bfloat16:
            raise AdapterInputError(f"{name} must be bfloat16, got {tensor.dtype}")


def check_arguments(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    v_cache: torch.Tensor,
    k_cache: torch.Tensor,
    sparse_indices: torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Shapes and dtypes of one timed call on the cache views (host-side metadata only)."""
    num_tokens = q_nope.shape[0]
    _check_shape("q_nope", q_nope, (num_tokens, NUM_HEADS, HEAD_DIM_CKV))
    _check_shape("q_pe", q_pe, (num_tokens, NUM_HEADS, HEAD_DIM_KPE))
    for name, cache, width in (("ckv_cache", v_cache, HEAD_DIM_CKV), ("kpe_cache", k_cache, HEAD_DIM_KPE)):
        if cache.dim() != 4 or cache.shape[0] % PAGE_SIZE or tuple(cache.shape[1:]) != (1, 1, width):
            raise AdapterInputError(
                f"{name} must be the cache view [P*64, 1, 1, {width}] that prepare() returns, got {tuple(cache.shape)}"
            )
    if v_cache.shape[0] != k_cache.shape[0]:
        raise AdapterInputError(f"ckv_cache and kpe_cache views hold {v_cache.shape[0]} and {k_cache.shape[0]} rows")
    _check_shape("sparse_indices", sparse_indices, (num_tokens, TOPK))
    _check_shape("output", output, (num_tokens, NUM_HEADS, HEAD_DIM_CKV))
    _check_shape("lse", lse, (num_tokens, NUM_HEADS))
    for name, tensor in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", v_cache), ("kpe_cache", k_cache)):
        if tensor.dtype != torch.bfloat16:
            raise AdapterInputError(f"{name} must be bfloat16, got {tensor.dtype}")
    if sparse_indices.dtype != torch.int32:
        raise AdapterInputError(f"sparse_indices must be int32, got {sparse_indices.dtype}")


def fa3_cache_views(ckv_cache: torch.Tensor, kpe_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache [P*64, 1, 1, 64], v_cache [P*64, 1, 1, 512]): one-row pages, views of our caches."""
    return kpe_cache.view(-1, 1, 1, HEAD_DIM_KPE), ckv_cache.view(-1, 1, 1, HEAD_DIM_CKV)


def prepare(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    sparse_indices: torch.Tensor,
    sm_scale: float | torch.Tensor,
) -> dict[str, torch.Tensor | float]:
    """The definition's inputs with the caches viewed as FA3's paged caches of page size 1 (untimed,
    once per input set): `ckv_cache` becomes the v cache [P*64, 1, 1, 512], `kpe_cache` the k cache
    [P*64, 1, 1, 64], both views; the per-call inputs pass through."""
    check_caches(ckv_cache, kpe_cache)
    check_padding_last(sparse_indices)
    k_cache, v_cache = fa3_cache_views(ckv_cache, kpe_cache)
    return {
        "q_nope": q_nope,
        "q_pe": q_pe,
        "ckv_cache": v_cache,
        "kpe_cache": k_cache,
        "sparse_indices": sparse_indices,
        "sm_scale": sm_scale,
    }


def check_padding_last(sparse_indices: torch.Tensor) -> None:
    """Every row's -1 entries come after its valid ids (one host read; `prepare` only)."""
    valid = sparse_indices >= 0
    early = (valid[:, 1:] & ~valid[:, :-1]).any(dim=1)
    if bool(early.any()):
        row = int(early.nonzero()[0, 0])
        raise AdapterInputError(
            f"sparse_indices row {row} has -1 before a valid index: FA3 reads the first cache_seqlens "
            "entries of a row, so the padding must come last (as SGLang's top-k writes it)"
        )


def fa3_page_table(sparse_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(page_table [T, 2048] int32, cache_seqlens [T] int32): the index rows themselves (their padding
    last, `check_padding_last`) and the count of valid ids per row. On the device, no host sync."""
    return sparse_indices, (sparse_indices >= 0).sum(dim=1, dtype=torch.int32)


class ValidCounts:
    """cache_seqlens of the last index tensor seen, computed once per tensor: it is held (so its memory
    cannot be reused by another tensor while it is the key) and compared by identity and by its version
    counter (an in-place write changes it); a new tensor or a new version computes the counts again.
    Inside a CUDA-graph capture a miss computes them on the capture's stream, so the graph holds them."""

    def __init__(self) -> None:
        self._indices: torch.Tensor | None = None
        self._version = -1
        self._counts: torch.Tensor | None = None

    def __call__(self, sparse_indices: torch.Tensor) -> torch.Tensor:
        if self._indices is not sparse_indices or self._version != sparse_indices._version:
            _, self._counts = fa3_page_table(sparse_indices)
            self._indices, self._version = sparse_indices, sparse_indices._version
        assert self._counts is not None
        return self._counts


valid_counts = ValidCounts()


def write_results(out: torch.Tensor, natural_lse: torch.Tensor, output: torch.Tensor, lse: torch.Tensor) -> None:
    """FA3's [T, 1, 16, 512] output and natural [T, 16, 1] lse into the destinations, lse in base 2."""
    output.copy_(out.squeeze(1))
    torch.mul(natural_lse.squeeze(-1), LOG2_E, out=lse)


def run(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    sparse_indices: torch.Tensor,
    sm_scale: float | torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64 in destination-passing style through FA3, on
    the cache views `prepare` returned (`ckv_cache` is the v cache [P*64, 1, 1, 512], `kpe_cache` the
    k cache [P*64, 1, 1, 64])."""
    check_arguments(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, output, lse)
    with_kvcache = load_with_kvcache()
    out, natural_lse, *_ = with_kvcache(
        q_pe.unsqueeze(1),
        kpe_cache,
        ckv_cache,
        qv=q_nope.unsqueeze(1),
        cache_seqlens=valid_counts(sparse_indices),
        page_table=sparse_indices,
        softmax_scale=float(sm_scale),  # a tensor scale costs a host read
        causal=False,
        num_splits=0,
        return_softmax_lse=True,
    )
    write_results(out, natural_lse, output, lse)
