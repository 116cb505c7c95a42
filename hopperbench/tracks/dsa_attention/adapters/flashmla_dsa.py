"""FlashMLA's SM90 sparse prefill kernel (`flash_mla_sparse_fwd`, bf16 KV) as a dsa_attention side.

Pinned source: deepseek-ai/FlashMLA@9241ae3ef9bac614dd25e45e507e089f888280e0 (third_party/FlashMLA,
built as third_party/README.md says). What the adapter relies on, read at that commit:

- `flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None)
  -> (out, max_logits, lse)` (flash_mla/flash_mla_interface.py:176-211), a thin wrapper over
  `flash_mla.cuda.sparse_prefill_fwd` (csrc/api/api.cpp:12).
- q [s_q, h_q, d_qk] bf16, kv [s_kv, h_kv, d_qk] bf16, indices [s_q, h_kv, topk] int32; d_qk is
  576 or 512, d_v must be 512 (csrc/api/sparse_fwd.h:117-156). Only the last dimension must be
  contiguous (sparse_fwd.h:152-156); the kernel takes the other strides (sparse_fwd.h:179-181).
- h_q must be 64 or 128 (sparse_fwd.h:192-198); the SM90 kernel also needs h_kv == 1, topk > 0
  and topk % 128 == 0 (csrc/sm90/prefill/sparse/phase1.cuh:576-579; B_H = B_TOPK = 64,
  csrc/sm90/prefill/sparse/config.h:26-27). Our topk 2048 qualifies; our 16 heads do not.
- An index is invalid when it is < 0 or >= s_kv (interface docstring, flash_mla_interface.py:191;
  kernel test `t >= 0 && t < params.s_kv`, phase1.cuh:485). Logits are `sm_scale * q.k` over the
  valid rows; V is the first d_v columns of each kv row (tests/ref.py:34-48).
- out [s_q, h_q, 512] bf16; lse [s_q, h_q] fp32 is the NATURAL log-sum-exp of the scaled logits:
  `logf(rL) + rM * ln2` (phase1.cuh:449, the kernel keeps rM in the base-2 domain). A row with no
  valid index gets out = 0 (phase1.cuh:207-208) and lse = +inf, max_logits = -inf
  (phase1.cuh:447-449; tests/ref.py:50-51).
- Grid = (h_q / 64) * s_q CTAs, one per (token, 64-head block), no split over top-k
  (phase1.cuh:629): at T <= 8 the kernel occupies at most 8 of 132 SMs.

Definition `dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64` -> FlashMLA, in two steps:

- `prepare` (untimed, once per input set): ckv_cache [P,64,512] | kpe_cache [P,64,64] -> kv
  [P*64, 1, 576], each key's nope and rope parts in one contiguous row: the layout FlashMLA reads
  and a serving engine that uses it keeps its cache in. Our definition stores the two parts apart,
  so the copy (624 MB read, 624 MB written at P = 8462) belongs to the cache's owner, not to a
  call: the timed call gets the packed cache as its `ckv_cache` argument (and a view of its rope
  columns as `kpe_cache`, unused).
- `run` (the timed call), three steps around one FlashMLA kernel:
  - q_nope [T,16,512] | q_pe [T,16,64] -> q [T, 64, 576]: one concatenation, heads 16..63 zero.
    Zero queries give finite logits (all 0), so the padded heads compute a harmless uniform
    softmax that is discarded. Padding to 64 quadruples the MMA work (hopper_anchors.md §2.2);
    FlashMLA accepts no fewer heads.
  - sparse_indices [T, 2048] int32, flat rows `page*64 + offset`, -1 padding -> indices
    [T, 1, 2048]: the flat row id is already the row of the kv view and -1 is already invalid to
    FlashMLA, so this is a view. sm_scale -> `sm_scale` as a Python float; d_v = 512.
  - output [T,16,512] <- out[:, :16]; lse [T,16] <- lse[:, :16] / ln 2 (the definition's lse is
    base 2), with FlashMLA's +inf for "no valid index" turned into the definition's -inf. Its
    output 0 for such rows already matches the definition.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import math
from collections.abc import Callable

import torch

FLASH_MLA_DISTRIBUTION = "flash_mla"
FLASH_MLA_COMMIT = "9241ae3ef9bac614dd25e45e507e089f888280e0"
# FlashMLA's setup.py stamps `1.0.0+<git rev-parse --short HEAD>` into the installed version.
FLASH_MLA_VERSION = f"1.0.0+{FLASH_MLA_COMMIT[:7]}"

NUM_HEADS = 16
HEAD_DIM_CKV = 512
HEAD_DIM_KPE = 64
HEAD_DIM_QK = HEAD_DIM_CKV + HEAD_DIM_KPE
PAGE_SIZE = 64
TOPK = 2048
# The SM90 kernel's head block; the API accepts 64 or 128 heads, 64 wastes least.
FLASH_MLA_HEADS = 64
LOG2_E = 1.0 / math.log(2.0)

SparseFwd = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class LibraryUnavailableError(RuntimeError):
    """The library this adapter calls is missing or is not the build it was written for."""


class AdapterInputError(ValueError):
    """The arguments do not describe a dsa_attention call."""


def installed_flash_mla_version() -> str | None:
    """The installed flash_mla distribution's version, None when it is not installed."""
    try:
        return importlib.metadata.version(FLASH_MLA_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def load_sparse_fwd() -> SparseFwd:
    """FlashMLA's `flash_mla_sparse_fwd` from the pinned build (checked once per process)."""
    installed = installed_flash_mla_version()
    if installed is None:
        raise LibraryUnavailableError(
            f"{FLASH_MLA_DISTRIBUTION} is not installed (build third_party/FlashMLA as third_party/README.md says)"
        )
    if installed != FLASH_MLA_VERSION:
        raise LibraryUnavailableError(
            f"{FLASH_MLA_DISTRIBUTION} {installed} is installed; this adapter needs the build of "
            f"FlashMLA@{FLASH_MLA_COMMIT[:7]} ({FLASH_MLA_VERSION})"
        )
    try:
        module = importlib.import_module("flash_mla")
    except ImportError as e:  # e.g. the extension was built against another torch
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise LibraryUnavailableError(f"flash_mla {installed} is installed but does not import: {first_line}") from None
    sparse_fwd = getattr(module, "flash_mla_sparse_fwd", None)
    if sparse_fwd is None:
        raise LibraryUnavailableError(f"flash_mla {installed} has no flash_mla_sparse_fwd")
    return sparse_fwd


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
    kv: torch.Tensor,
    sparse_indices: torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Shapes and dtypes of one timed call on the packed cache (host-side metadata only)."""
    num_tokens = q_nope.shape[0]
    _check_shape("q_nope", q_nope, (num_tokens, NUM_HEADS, HEAD_DIM_CKV))
    _check_shape("q_pe", q_pe, (num_tokens, NUM_HEADS, HEAD_DIM_KPE))
    if kv.dim() != 3 or kv.shape[0] % PAGE_SIZE or tuple(kv.shape[1:]) != (1, HEAD_DIM_QK):
        raise AdapterInputError(
            f"ckv_cache must be the packed cache [P*64, 1, {HEAD_DIM_QK}] that prepare() returns, "
            f"got {tuple(kv.shape)}"
        )
    _check_shape("sparse_indices", sparse_indices, (num_tokens, TOPK))
    _check_shape("output", output, (num_tokens, NUM_HEADS, HEAD_DIM_CKV))
    _check_shape("lse", lse, (num_tokens, NUM_HEADS))
    for name, tensor in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", kv)):
        if tensor.dtype != torch.bfloat16:
            raise AdapterInputError(f"{name} must be bfloat16, got {tensor.dtype}")
    if sparse_indices.dtype != torch.int32:
        raise AdapterInputError(f"sparse_indices must be int32, got {sparse_indices.dtype}")


def flashmla_query(q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """[T, 64, 576] bf16: q_nope | q_pe in heads 0..15, zeros in the padded heads."""
    num_tokens = q_nope.shape[0]
    q = q_nope.new_zeros(num_tokens, FLASH_MLA_HEADS, HEAD_DIM_QK)
    q[:, :NUM_HEADS, :HEAD_DIM_CKV] = q_nope
    q[:, :NUM_HEADS, HEAD_DIM_CKV:] = q_pe
    return q


def flashmla_kv(ckv_cache: torch.Tensor, kpe_cache: torch.Tensor) -> torch.Tensor:
    """[P*64, 1, 576] bf16: every cache row's ckv | kpe, contiguous (a copy of the whole cache)."""
    return torch.cat((ckv_cache, kpe_cache), dim=-1).view(-1, 1, HEAD_DIM_QK)


def prepare(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    sparse_indices: torch.Tensor,
    sm_scale: float | torch.Tensor,
) -> dict[str, torch.Tensor | float]:
    """The definition's inputs with the cache stored as FlashMLA reads it (untimed, once per input
    set): `ckv_cache` becomes the packed [P*64, 1, 576] cache, `kpe_cache` a view of its rope
    columns; the per-call inputs pass through."""
    check_caches(ckv_cache, kpe_cache)
    kv = flashmla_kv(ckv_cache, kpe_cache)
    return {
        "q_nope": q_nope,
        "q_pe": q_pe,
        "ckv_cache": kv,
        "kpe_cache": kv[..., HEAD_DIM_CKV:],
        "sparse_indices": sparse_indices,
        "sm_scale": sm_scale,
    }


def flashmla_indices(sparse_indices: torch.Tensor) -> torch.Tensor:
    """[T, 1, 2048] int32: flat rows of the kv view, -1 stays invalid (a view, no copy)."""
    return sparse_indices.unsqueeze(1)


def write_results(out: torch.Tensor, natural_lse: torch.Tensor, output: torch.Tensor, lse: torch.Tensor) -> None:
    """The first 16 heads into the destinations; lse to base 2 with -inf where no index was valid."""
    output.copy_(out[:, :NUM_HEADS])
    head_lse = natural_lse[:, :NUM_HEADS]
    torch.mul(head_lse, LOG2_E, out=lse)
    lse.masked_fill_(head_lse == math.inf, -math.inf)


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
    """dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64 in destination-passing style through FlashMLA,
    on the cache `prepare` packed (`ckv_cache` is the packed [P*64, 1, 576] cache; `kpe_cache`, a view
    of it, is not read)."""
    check_arguments(q_nope, q_pe, ckv_cache, sparse_indices, output, lse)
    sparse_fwd = load_sparse_fwd()
    out, _max_logits, natural_lse = sparse_fwd(
        flashmla_query(q_nope, q_pe),
        ckv_cache,
        flashmla_indices(sparse_indices),
        float(sm_scale),  # a tensor scale costs a host read
        d_v=HEAD_DIM_CKV,
    )
    write_results(out, natural_lse, output, lse)
