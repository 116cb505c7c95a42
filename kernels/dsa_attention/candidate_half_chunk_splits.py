"""DSA candidate v1.14 ("half-chunk splits", session 19): `kernel.py` v1.11 with splits of 32-row units, any count
up to 64.

Why (NOTES.md, v1.14's contract): at 1 token `kernel.py` runs 32 split CTAs on 132 SMs and at 2 tokens 64, each
gathering and computing one 64-row chunk; at 6 tokens 16 splits of 128 rows leave 36 SMs idle, because a split takes
whole chunks and its count is a power of two. Here split s of S takes units [64 s / S, 64 (s + 1) / S) of 32 rows,
and the count is the fewest that reaches the smallest largest split in one wave: 64 splits of 32 rows at 1-2
tokens, 22 of at most 96 at 5-6, the same splits as `kernel.py` at 3-4 and 7-8 tokens.

Prediction: ~1.04-1.07x at 1-2 tokens, ~1.05-1.10x at 6, 1.00x at 7-8 (their outputs bit for bit `kernel.py`'s).
"""

from __future__ import annotations

from typing import Callable

from . import kernel
from .kernel import DsaShapeError

__all__ = ["DsaShapeError", "FORMS", "compile_only", "num_splits_for", "run", "run_with_splits"]

ROW_UNIT = kernel.BLOCK_N // 2
NUM_UNITS = kernel.TOPK // ROW_UNIT  # 64: the most splits
VALID_SPLITS = range(1, NUM_UNITS + 1)
WIDE_COMBINE_SPLITS = 2 * kernel.MAX_SPLITS  # two splits per lane

assert kernel.BLOCK_N % ROW_UNIT == 0 and NUM_UNITS <= WIDE_COMBINE_SPLITS


class _HalfChunkSplitKernel(kernel._SplitKernel):
    ROW_UNIT = ROW_UNIT


class _WideCombineKernel(kernel._CombineKernel):
    MAX_SPLITS = WIDE_COMBINE_SPLITS


def largest_split_rows(num_splits: int) -> int:
    return -(-NUM_UNITS // num_splits) * ROW_UNIT


def num_splits_for(num_tokens: int) -> int:
    """The fewest splits whose largest is as small as one wave of T * splits <= 132 CTAs allows (1 once T fills it)."""
    most = min(NUM_UNITS, max(1, kernel.MAX_CTAS_PER_WAVE // num_tokens))
    largest_units = -(-NUM_UNITS // most)
    return -(-NUM_UNITS // largest_units)


def form(num_splits: int) -> tuple[bool, type]:
    """(row ids staged, combine class) of a call with `num_splits` splits: staged where a split has two or more
    chunks (as `kernel.py`), the two-splits-per-lane combine only past 32 splits."""
    staged = largest_split_rows(num_splits) > kernel.BLOCK_N
    return staged, (_WideCombineKernel if num_splits > kernel.MAX_SPLITS else kernel._CombineKernel)


FORMS = tuple(sorted({form(s) for s in VALID_SPLITS}, key=lambda f: (f[0], f[1].MAX_SPLITS)))


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """Compile every form of the candidate's launcher for `arch` without a GPU."""
    return tuple(kernel.compiled_for(arch, staged, combine, _HalfChunkSplitKernel) for staged, combine in FORMS)


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """`kernel.py`'s contract."""
    run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None)


def run_with_splits(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits) -> None:
    """`run` with an explicit split count (1..64); None picks `num_splits_for(T)`."""
    kernel._check_inputs(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, output, lse)
    num_tokens = q_nope.shape[0]
    if num_tokens == 0:
        return
    if num_splits is None:
        num_splits = num_splits_for(num_tokens)
    elif num_splits not in VALID_SPLITS:
        raise DsaShapeError(f"num_splits must be in 1..{NUM_UNITS}, got {num_splits}")
    staged, combine = form(num_splits)
    kernel.launch_splits(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, num_splits, staged,
        _HalfChunkSplitKernel, combine,
    )  # fmt: skip
