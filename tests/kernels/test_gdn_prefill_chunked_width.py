"""GDN's chunked kernel on 16-row V slices (kernels/gdn_prefill/chunked.py, `_NarrowChunked`): the same kernel
with eight slice CTAs per (sequence, head) instead of four, for one or two sequences (the device check's
`chunked.run`; the WY path's value side makes the same choice of width).

CPU: the width rule (which sequence counts get the narrow kernel); the narrow class is the kernel on 16 rows; both
widths compile for sm_90a. GPU (marked `gpu`): the narrow kernel's output and new state equal the 32-row kernel's
bit for bit (each value sees the same operations in the same order; the slice only selects which V rows a CTA
computes) on fresh inputs with and without a state, lengths off the chunk size, and beyond the rule's range (four
and many sequences, long ones); the contest-rule checks of every check case are test_gdn_prefill_kernel.py's
(`chunked` and `kernel` are in its SOLUTIONS), the CUDA-graph replay with new bounds included.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hopperbench.devcheck import load_folder_module, load_module_by_path
from hopperbench.paths import REPO_ROOT
from tests.kernels.compile_checks import assert_compiles_and_caches

chunked = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "chunked")
cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(("num_seqs", "narrow"), [(1, True), (2, True), (3, False), (4, False), (57, False)])
def test_narrow_kernel_for_one_or_two_sequences(num_seqs, narrow, monkeypatch):
    # 64 CTAs per sequence leave each CTA an SM of its own up to two sequences (132 SMs).
    assert chunked.NARROW_MAX_SEQS == 2
    calls = []
    monkeypatch.setattr(chunked, "run_kernel", lambda kernel, *args: calls.append(kernel))
    chunked.run(*([None] * 11), torch.empty(num_seqs, 8, 128, 128))
    assert calls == [chunked._NarrowChunked if narrow else chunked._Chunked]


def test_narrow_kernel_is_the_chunked_kernel_on_16_rows():
    assert chunked._NarrowChunked.slice_rows == 16 and chunked._NarrowChunked().num_slices == 8
    assert chunked._Chunked.slice_rows == 32 and chunked._Chunked().num_slices == 4


def test_compiles_both_widths_for_sm90a_without_gpu():
    assert_compiles_and_caches(chunked.compile_only, 2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("one_sequence_off_chunk", (397,), True, 0.0, "mamba2"),
        cases.CheckCase("four_with_empty", (0, 141, 64, 130), False, 0.0, "mamba2"),
        cases.CheckCase("state_and_scale", (200, 77, 3), True, 0.1, "fast_decay"),
        cases.CheckCase("many_and_long", (0, 41, 64, 0, 129, 3, 300, 65, 1377), True, 0.0, "mamba2"),
    ],
    ids=lambda case: case.name,
)
def test_outputs_and_states_are_the_32_row_kernels_bit_for_bit(case):
    wide, narrow = (functools.partial(chunked.run_kernel, kernel) for kernel in (chunked._Chunked, chunked._NarrowChunked))
    assert cases.bitwise_mismatch(case, [wide, narrow], "cuda", seed=53) is None
