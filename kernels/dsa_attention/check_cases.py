"""Correctness cases for the DSA sparse-attention kernel, shared by the GPU tests and the device check.

Each case names a batch size, a cache size and an index pattern; `make_inputs` builds fresh random
inputs for it, `load_reference_run` loads our PyTorch reference (hopperbench/tracks/dsa_attention/reference.py)
and `compare` applies the track's acceptance rule through hopperbench.acceptance (atol = rtol = 1e-2
on every element; an element fails only when both its absolute and its relative error exceed the
tolerance; NaN anywhere fails; an inf matches only the same inf, as the empty rows' lse = -inf).
Only torch and the standard library are imported at import time (hopperbench lazily, inside the
functions that need it), so the module loads by path anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:  # only for annotations: importing this module needs nothing but torch
    from hopperbench.acceptance import Verdict

NUM_HEADS = 16
CKV_DIM = 512
KPE_DIM = 64
PAGE_SIZE = 64
TOPK = 2048
SM_SCALE = 0.1352337788608801  # the contest workloads' value
CONTEST_NUM_PAGES = 8462

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE_PATH = REPO_ROOT / "hopperbench" / "tracks" / "dsa_attention" / "reference.py"
KERNEL_PATH = REPO_ROOT / "kernels" / "dsa_attention" / "kernel.py"

# Index patterns (see `_make_indices`).
PATTERNS = ("random", "all_padding", "scattered_padding", "one_valid", "shared_pages", "ragged_tail")


@dataclass(frozen=True)
class CheckCase:
    name: str
    num_tokens: int
    num_pages: int
    pattern: str

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ValueError(f"unknown index pattern {self.pattern!r}; choose from {', '.join(PATTERNS)}")


CASES: tuple[CheckCase, ...] = (
    CheckCase("t1_random", 1, 300, "random"),
    CheckCase("t2_random", 2, 300, "random"),
    CheckCase("t8_random_contest_pages", 8, CONTEST_NUM_PAGES, "random"),
    CheckCase("t37_random", 37, 300, "random"),
    CheckCase("t4096_random", 4096, 300, "random"),
    CheckCase("t8_all_padding", 8, 300, "all_padding"),
    CheckCase("t37_scattered_padding", 37, 300, "scattered_padding"),
    CheckCase("t8_one_valid", 8, 300, "one_valid"),
    CheckCase("t37_shared_pages", 37, 300, "shared_pages"),
    CheckCase("t37_ragged_tail", 37, 300, "ragged_tail"),
    CheckCase("t4096_ragged_tail", 4096, 300, "ragged_tail"),
)


def load_kernel() -> ModuleType:
    from hopperbench.devcheck import load_module_by_path  # lazily: this folder is packed without hopperbench

    return load_module_by_path(KERNEL_PATH, "dsa_attention_kernel")


def load_reference_run() -> Callable:
    from hopperbench.devcheck import load_module_by_path

    return load_module_by_path(REFERENCE_PATH, "dsa_attention_reference").run


def _make_indices(case: CheckCase, generator: torch.Generator) -> torch.Tensor:
    """[T, 2048] int32 flat row ids (page * 64 + offset), -1 for padding, on the CPU."""
    t, rows = case.num_tokens, case.num_pages * PAGE_SIZE
    if case.pattern == "random":
        return torch.randint(0, rows, (t, TOPK), generator=generator, dtype=torch.int32)
    if case.pattern == "all_padding":
        return torch.full((t, TOPK), -1, dtype=torch.int32)
    if case.pattern == "scattered_padding":
        indices = torch.randint(0, rows, (t, TOPK), generator=generator, dtype=torch.int32)
        indices[torch.rand((t, TOPK), generator=generator) < 0.4] = -1
        return indices
    if case.pattern == "one_valid":
        indices = torch.full((t, TOPK), -1, dtype=torch.int32)
        position = torch.randint(0, TOPK, (t,), generator=generator)
        indices[torch.arange(t), position] = torch.randint(0, rows, (t,), generator=generator, dtype=torch.int32)
        return indices
    if case.pattern == "shared_pages":
        # Every token draws from the same 3 pages, so rows repeat within and across tokens.
        pages = torch.tensor([0, case.num_pages // 2, case.num_pages - 1], dtype=torch.int32)
        choice = pages[torch.randint(0, len(pages), (t, TOPK), generator=generator)]
        return choice * PAGE_SIZE + torch.randint(0, PAGE_SIZE, (t, TOPK), generator=generator, dtype=torch.int32)
    # ragged_tail: token i keeps a valid prefix of its own length, padding after it. Lengths cover
    # 0 (no valid row at all), 1, less than one chunk, a chunk boundary, and full rows, so whole
    # splits are empty for some tokens.
    lengths = torch.tensor([0, 1, 63, 64, 65, 100, 1000, 2047, TOPK])
    lengths = lengths[torch.arange(t) % len(lengths)]
    indices = torch.randint(0, rows, (t, TOPK), generator=generator, dtype=torch.int32)
    indices[torch.arange(TOPK)[None, :] >= lengths[:, None]] = -1
    return indices


def make_inputs(case: CheckCase, device: torch.device | str, seed: int = 0) -> dict[str, torch.Tensor | float]:
    """Fresh random inputs in definition order (q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(torch.bfloat16).to(device)

    return {
        "q_nope": randn(case.num_tokens, NUM_HEADS, CKV_DIM),
        "q_pe": randn(case.num_tokens, NUM_HEADS, KPE_DIM),
        "ckv_cache": randn(case.num_pages, PAGE_SIZE, CKV_DIM),
        "kpe_cache": randn(case.num_pages, PAGE_SIZE, KPE_DIM),
        "sparse_indices": _make_indices(case, generator).to(device),
        "sm_scale": SM_SCALE,
    }


def poisoned_outputs(num_tokens: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Destination tensors filled with NaN, so any element the kernel leaves unwritten shows up."""
    output = torch.full((num_tokens, NUM_HEADS, CKV_DIM), math.nan, dtype=torch.bfloat16, device=device)
    lse = torch.full((num_tokens, NUM_HEADS), math.nan, dtype=torch.float32, device=device)
    return output, lse


def compare(
    output: torch.Tensor, lse: torch.Tensor, ref_output: torch.Tensor, ref_lse: torch.Tensor
) -> Verdict:
    """The DSA track's acceptance rule on both outputs (a hopperbench.acceptance.Verdict): the
    benchmark's own gate, so a case passes here exactly when it would pass in the runner."""
    from hopperbench.acceptance import check_outputs
    from hopperbench.tracks import get_track

    return check_outputs(
        get_track("dsa_attention").acceptance,
        {"output": output, "lse": lse},
        {"output": ref_output, "lse": ref_lse},
    )
