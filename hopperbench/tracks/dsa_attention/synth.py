"""Inputs of the DSA sparse attention track (`dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64`),
on the machinery of `hopperbench.synth`:
- `q_nope`, `q_pe` randn bf16; `ckv_cache`, `kpe_cache` N(0, c^2) bf16 with
  c = LOGIT_STD / (sm_scale * sqrt(512 + 64)), so scaled logits have std ~2: softmax is
  neither uniform nor one-hot.
- `sparse_indices`: like real decode. Each token has its own context of L tokens held in
  ceil(L/64) distinct random pages (the last one partial). Full rows (L in [2048, 64 * num_pages])
  select 2048 distinct context slots; short rows (L in [1, 2047]) hold their whole context in
  the first L entries and -1 after. ceil(T/4) rows are short when T >= 2 (none when T = 1),
  so every multi-token workload exercises both kinds of row.
- `sm_scale`: from the workload.
"""

from __future__ import annotations

import math

import torch

from hopperbench.synth import Recipe, SynthContext, SynthesisError, randn
from hopperbench.workloads import WorkloadSpec

LOGIT_STD = 2.0


def absent_optional_inputs(workload: WorkloadSpec) -> set[str]:
    """No optional inputs."""
    return set()


def _cache(ctx: SynthContext, name: str) -> torch.Tensor:
    const = ctx.definition.const_axes
    head_dim = const["head_dim_ckv"] + const["head_dim_kpe"]
    std = LOGIT_STD / (float(ctx.scalar("sm_scale")) * math.sqrt(head_dim))
    return randn(ctx, name, std)


def _sparse_indices(ctx: SynthContext, name: str) -> torch.Tensor:
    const = ctx.definition.const_axes
    page_size, topk = const["page_size"], const["topk"]
    num_tokens, num_pages = ctx.workload.axes["num_tokens"], ctx.workload.axes["num_pages"]
    capacity = num_pages * page_size
    if capacity < topk:
        raise SynthesisError(
            f"workload {ctx.workload.uuid}: {num_pages} pages hold {capacity} slots, fewer than topk={topk}"
        )
    gen = ctx.generator(name, torch.device("cpu"))
    num_short = 0 if num_tokens < 2 else math.ceil(num_tokens / 4)
    short_rows = set(torch.randperm(num_tokens, generator=gen)[:num_short].tolist())
    indices = torch.full((num_tokens, topk), -1, dtype=torch.int64)
    for row in range(num_tokens):
        if row in short_rows:
            context = int(torch.randint(1, topk, (1,), generator=gen))
        else:
            context = int(torch.randint(topk, capacity + 1, (1,), generator=gen))
        slots = _context_slots(context, num_pages, page_size, gen)
        chosen = slots[torch.randperm(context, generator=gen)[: min(context, topk)]]
        indices[row, : chosen.numel()] = chosen
    return indices.to(dtype=ctx.dtypes[name], device=ctx.device)


def _context_slots(context: int, num_pages: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """Cache slots (page * page_size + offset) of a `context`-token sequence in random distinct pages."""
    pages_needed = math.ceil(context / page_size)
    pages = torch.randperm(num_pages, generator=gen)[:pages_needed]
    slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()
    return slots[:context]  # the last page is filled only up to the context length


RECIPE: Recipe = {
    "q_nope": randn,
    "q_pe": randn,
    "ckv_cache": _cache,
    "kpe_cache": _cache,
    "sparse_indices": _sparse_indices,
}
