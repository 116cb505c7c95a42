"""What the DSA library adapters' tests share (tests/test_adapter_flashmla.py, tests/test_adapter_fa3.py):
the definition's inputs at small page counts, NaN-poisoned destinations, and our reference."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from hopperbench.tracks import DSA_ATTENTION

HEADS, CKV, KPE, PAGE, TOPK = 16, 512, 64, 64, 2048
SM_SCALE = 0.1352337788608801


def dsa_inputs(
    num_tokens: int,
    num_pages: int,
    *,
    empty_tokens: tuple[int, ...] = (),
    scattered: bool = False,
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, Any]:
    """Definition-ordered inputs. Token t keeps 2048 - 300*t of its distinct random rows and -1 in the
    other entries: after them, or (`scattered`) at random places in the row, as the definition allows;
    tokens in `empty_tokens` have no valid row at all."""
    gen = torch.Generator().manual_seed(seed)
    rows = num_pages * PAGE
    indices = torch.stack([torch.randperm(rows, generator=gen)[:TOPK] for _ in range(num_tokens)]).int()
    for t in range(num_tokens):
        padding = torch.arange(max(0, TOPK - 300 * t), TOPK)
        if scattered:
            padding = torch.randperm(TOPK, generator=gen)[: padding.numel()]
        indices[t, padding] = -1
    for t in empty_tokens:
        indices[t] = -1
    inputs = {
        "q_nope": torch.randn(num_tokens, HEADS, CKV, generator=gen).bfloat16(),
        "q_pe": torch.randn(num_tokens, HEADS, KPE, generator=gen).bfloat16(),
        "ckv_cache": torch.randn(num_pages, PAGE, CKV, generator=gen).bfloat16(),
        "kpe_cache": torch.randn(num_pages, PAGE, KPE, generator=gen).bfloat16(),
        "sparse_indices": indices,
        "sm_scale": SM_SCALE,
    }
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def destinations(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """NaN-poisoned output and lse for `inputs`."""
    q_nope = inputs["q_nope"]
    return {
        "output": torch.full_like(q_nope, float("nan")),
        "lse": torch.full(q_nope.shape[:2], float("nan"), dtype=torch.float32, device=q_nope.device),
    }


def load_reference() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Our reference, loaded from its file as the runner does."""
    spec = importlib.util.spec_from_file_location("dsa_attention_reference", DSA_ATTENTION.reference_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run
