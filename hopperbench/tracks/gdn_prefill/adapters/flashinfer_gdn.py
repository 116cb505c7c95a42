"""FlashInfer's SM90 GDN prefill (`flashinfer.gdn_prefill.chunk_gated_delta_rule`, flashinfer-python
0.7.2.post1) as a gdn_prefill side: the FlashInfer baseline of the Hopper edition.

The contest's own FlashInfer baseline for this definition is an SM100 kernel; on SM90 FlashInfer runs its CuTe-DSL
Hopper kernels: a fused persistent chunked kernel, or, when few (sequence, head) pairs would leave SMs idle
(`use_cp="auto"`, `should_use_cp_host`: N <= 8 on the H200), a context-parallel pipeline of four kernels. Its auto
rule looks at N alone. Measured on the H200 (`tools/flashinfer_gdn_paths.py`: graph replay, cold L2; every
official workload of at most 8 sequences from 341 tokens, three splits each, and even splits of 1024-4096 tokens
in 2-8 sequences): the pipeline is the faster of the two for one or two sequences of a mean of ~1000 tokens or
more (1.10-1.45x at 1377-2107 tokens in one, 1.10-1.48x at 2040-4096 in two), the fused kernel on every other
batch (1.1-3.3x below a mean of 1000; at 3 to 8 sequences up to 4096 tokens, but for 3072 in 4, where the two are
within 3 %). An engine knows T and N for each batch, so the side takes FlashInfer's auto rule (its pipeline) for
at most CP_MAX_SEQS sequences of a mean of CP_MIN_MEAN_TOKENS or more, and its fused kernel (use_cp=False)
otherwise (`use_cp_for`).

Read in the 0.7.2.post1 wheel (`flashinfer/gdn_prefill.py`, `chunk_gated_delta_rule`):

- q, k [T, 4, 128], v [T, 8, 128] bf16 as they are: FlashInfer supports GVA (num_v_heads >
  num_q_heads = num_k_heads; v-head h reads q/k head h // 2, as the definition).
- The definition's gates are FlashInfer's inputs `g` (the per-token decay alpha, fp32) and `beta`
  (fp32), both [T, 8]. FlashInfer takes them precomputed, so **each timed call first computes
  them** from A_log, a, dt_bias and b in fp32 as the definition says, `g = exp(-exp(A_log) *
  softplus(a + dt_bias))`, `beta = sigmoid(b)`, in one fused kernel of this adapter's (`_gates`),
  as serving engines do before FlashInfer's kernels (vLLM and SGLang: one Triton gating kernel,
  then `exp`), not in the nine small torch kernels the formula takes written out.
- state [N, 8, V, K] fp32 (k-last), None = zeros -> `initial_state`: FlashInfer's state layout is
  `[N, H, V, K]` too. new_state -> `output_state` with `output_final_state=True`, output ->
  `output`: FlashInfer writes the destinations itself.
- cu_seqlens int64 [N + 1] as is; `max_seqlen` is left None (FlashInfer then bounds its CP grids
  by T): the exact maximum would need a host read of cu_seqlens, and on the rows where the side runs the
  pipeline the exact maximum was measured within 3 % of None, either way.
- scale: None or 0 means 1/sqrt(128) in both.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

FLASHINFER_DISTRIBUTION = "flashinfer-python"
FLASHINFER_VERSION = "0.7.2.post1"
NUM_Q_HEADS = 4
NUM_V_HEADS = 8
HEAD_SIZE = 128
DEFAULT_SCALE = 1.0 / math.sqrt(HEAD_SIZE)
# The batches the side gives to FlashInfer's auto rule (its context-parallel pipeline, as N <= 8 there): at most
# CP_MAX_SEQS sequences of a mean of CP_MIN_MEAN_TOKENS tokens or more; its fused kernel is faster on all others.
CP_MAX_SEQS = 2
CP_MIN_MEAN_TOKENS = 1000


class LibraryUnavailableError(RuntimeError):
    """The library this adapter calls is missing or is not the version it was written for."""


class AdapterInputError(ValueError):
    """The arguments do not describe a gdn_prefill call."""


@functools.cache
def load_chunk_gated_delta_rule() -> Callable[..., Any]:
    """FlashInfer's `chunk_gated_delta_rule` from the pinned release (checked once per process)."""
    try:
        installed = importlib.metadata.version(FLASHINFER_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise LibraryUnavailableError(
            f"{FLASHINFER_DISTRIBUTION} is not installed (uv sync --extra flashinfer)"
        ) from None
    if installed != FLASHINFER_VERSION:
        raise LibraryUnavailableError(
            f"{FLASHINFER_DISTRIBUTION} {installed} is installed; this adapter needs {FLASHINFER_VERSION}"
        )
    try:
        from flashinfer.gdn_prefill import chunk_gated_delta_rule
    except ImportError as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise LibraryUnavailableError(f"flashinfer {installed} does not import: {first_line}") from None
    return chunk_gated_delta_rule


def check_arguments(
    q: torch.Tensor, v: torch.Tensor, state: torch.Tensor | None, cu_seqlens: torch.Tensor,
    output: torch.Tensor, new_state: torch.Tensor,
) -> None:  # fmt: skip
    """Shapes and dtypes of one definition call (host-side metadata only, no device work)."""
    total, num_seqs = q.shape[0], cu_seqlens.shape[0] - 1
    if tuple(q.shape) != (total, NUM_Q_HEADS, HEAD_SIZE) or tuple(v.shape) != (total, NUM_V_HEADS, HEAD_SIZE):
        raise AdapterInputError(f"q/v must be [T, 4, 128] / [T, 8, 128], got {tuple(q.shape)} / {tuple(v.shape)}")
    state_shape = (num_seqs, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE)
    if state is not None and (tuple(state.shape) != state_shape or state.dtype != torch.float32):
        raise AdapterInputError(f"state must be float32 {state_shape}, got {state.dtype} {tuple(state.shape)}")
    if tuple(new_state.shape) != state_shape or tuple(output.shape) != tuple(v.shape):
        raise AdapterInputError("output / new_state do not match the inputs' shapes")


GATE_BLOCK = 1024  # gate elements (tokens x 8 heads) per program of `_gates`
SOFTPLUS_LINEAR_ABOVE = tl.constexpr(20.0)  # torch's softplus threshold: x itself above it


@triton.jit
def _gates(A_log, a, dt_bias, b, g, beta, numel, HEADS: tl.constexpr, BLOCK: tl.constexpr):
    """g = exp(-exp(A_log) softplus(a + dt_bias)) and beta = sigmoid(b), fp32, over [T, HEADS] row-major."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    head = offsets % HEADS
    x = tl.load(a + offsets, mask=mask, other=0.0).to(tl.float32) + tl.load(dt_bias + head)
    e = tl.exp(tl.minimum(x, SOFTPLUS_LINEAR_ABOVE))
    # log1p(e), accurate where 1 + e rounds: log(u) e / (u - 1) with u = 1 + e (e itself where u == 1).
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * e / (u - 1.0))
    softplus = tl.where(x > SOFTPLUS_LINEAR_ABOVE, x, log1p)
    tl.store(g + offsets, tl.exp(-tl.exp(tl.load(A_log + head)) * softplus), mask=mask)
    tl.store(beta + offsets, tl.sigmoid(tl.load(b + offsets, mask=mask, other=0.0).to(tl.float32)), mask=mask)


def gates(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition's per-token decay and update gates, fp32 [T, 8]: FlashInfer's `g` and `beta`, in one
    launch on the current stream (`_gates`)."""
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty(b.shape, dtype=torch.float32, device=b.device)
    if a.numel():
        grid = (triton.cdiv(a.numel(), GATE_BLOCK),)
        _gates[grid](A_log, a, dt_bias, b, g, beta, a.numel(), HEADS=NUM_V_HEADS, BLOCK=GATE_BLOCK)
    return g, beta


def use_cp_for(num_tokens: int, num_seqs: int) -> bool | str:
    """FlashInfer's `use_cp` for a batch of `num_tokens` in `num_seqs` sequences (shapes only, no device read):
    its auto rule (the context-parallel pipeline) for 1 to CP_MAX_SEQS sequences of a mean of CP_MIN_MEAN_TOKENS
    tokens or more, its fused kernel (False) for every other batch."""
    if not 1 <= num_seqs <= CP_MAX_SEQS:
        return False
    return "auto" if num_tokens >= CP_MIN_MEAN_TOKENS * num_seqs else False


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
    scale: float | None,
    output: torch.Tensor,
    new_state: torch.Tensor,
) -> None:
    """gdn_prefill_qk4_v8_d128_k_last in destination-passing style through FlashInfer's SM90 kernels."""
    check_arguments(q, v, state, cu_seqlens, output, new_state)
    run_path(
        q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state,
        use_cp=use_cp_for(q.shape[0], cu_seqlens.shape[0] - 1),
    )  # fmt: skip


def run_path(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor | None,
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None,
    output: torch.Tensor,
    new_state: torch.Tensor,
    *,
    use_cp: bool | str,
    max_seqlen: int | None = None,
) -> None:
    """`run`'s call on a path chosen by the caller (`use_cp`, and FlashInfer's `max_seqlen` hint, None = none),
    without the argument checks: the gates, then chunk_gated_delta_rule (also tools/flashinfer_gdn_paths.py's)."""
    chunk_gated_delta_rule = load_chunk_gated_delta_rule()
    g, beta = gates(A_log, a, dt_bias, b)
    chunk_gated_delta_rule(
        q,
        k,
        v,
        g=g,
        beta=beta,
        scale=float(scale) if scale else DEFAULT_SCALE,
        initial_state=state,
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        output=output,
        output_state=new_state,
        use_cp=use_cp,
        max_seqlen=max_seqlen,
    )
