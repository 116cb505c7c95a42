"""kernels/gdn_prefill/short_tail.py, kernel.py's chunked path: a sequence's last <= 16 tokens as one 16-token chunk.

CPU: it compiles for sm_90a without a GPU, and kernel.py sends it exactly its chunked rows. GPU: on tails of 1-17
tokens, lone short chunks and ranked grids its outputs and states equal the plain chunked kernel's bit for bit (the
tail holds the 64-token chunk's operands with zero rows and inert gates past its end). Checks against the reference
and graph replay: test_gdn_prefill_kernel.py (`short_tail` is one of `KERNEL_CHOICES`)."""

from __future__ import annotations

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT
from tests.kernels.compile_checks import assert_compiles_and_caches

cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
device_check = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/probes/device_check_gdn.py", "device_check_gdn")
short_tail = device_check.load_kernel_module("short_tail")
kernel = device_check.load_kernel_module("kernel")
chunked = device_check.load_kernel_module("chunked")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(short_tail.compile_only, 2)


def test_kernel_py_takes_it_for_its_chunked_rows_alone():
    shapes = ((29, 1), (41, 1), (64, 1), (65, 1), (300, 4), (983, 2), (8192, 32), (1377, 1), (8192, 1))
    paths = [kernel.path_for(t, n).__name__.rsplit(".", 1)[-1] for t, n in shapes]
    assert paths == [
        "token_serial", "short_tail", "short_tail", "warp_chain", "warp_chain", "wy_prepass", "warp_chain",
        "wy_prepass", "context_parallel",
    ]  # fmt: skip
    assert short_tail.kernel_for(2).slice_rows == 16 and short_tail.kernel_for(3).slice_rows == 32
    assert all(cls.short_tail for cls in (short_tail.kernel_for(1), short_tail.kernel_for(5)))


TAIL_CASES = [
    cases.CheckCase("one_token", (1,), True, 0.0, "mamba2"),
    cases.CheckCase("one_short_chunk", (16,), True, 0.0, "slow_decay"),
    cases.CheckCase("tail_of_1", (65,), True, 0.0, "mamba2"),
    cases.CheckCase("tail_of_3", (67,), True, 0.0, "mamba2"),
    cases.CheckCase("tail_of_15", (79,), True, 0.05, "mamba2"),
    cases.CheckCase("tail_of_16_and_17", (80, 81), True, 0.0, "slow_decay"),
    cases.CheckCase("two_full_and_6", (134,), True, 0.0, "mamba2"),
    cases.CheckCase("short_only_and_empty", (10, 0, 76, 3), False, 0.0, "fast_decay"),
    cases.CheckCase("three_with_tails", (200, 130, 61), True, 0.0, "slow_decay"),
    # more CTAs than SMs: grid rows ranked by length
    cases.CheckCase("six_ranked_with_tails", (70, 65, 80, 129, 200, 66), True, 0.0, "mamba2"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", TAIL_CASES, ids=lambda case: case.name)
def test_short_tails_equal_the_chunked_path_bit_for_bit(case):
    # A tail chunk holds the 64-token chunk's operands with zero rows and gates past the end, which add exact zeros.
    assert cases.bitwise_mismatch(case, [chunked.run, short_tail.run], "cuda", seed=79) is None
