"""DSA candidate v1.13 (`candidate_fused_merge.py`): which calls fuse, and on the GPU that the fused path gives
`kernel.py`'s outputs bit for bit and leaves its token counters on multiples of 32. The contest-rule checks of
every case are `test_dsa_attention_kernel.py`'s (the candidate is in its SOLUTIONS)."""

from __future__ import annotations

import pytest
import torch

from hopperbench.devcheck import load_folder_module, load_module_by_path
from hopperbench.paths import REPO_ROOT

cases = load_module_by_path(REPO_ROOT / "kernels/dsa_attention/check_cases.py", "dsa_check_cases")
fused = load_folder_module(REPO_ROOT / "kernels/dsa_attention", "dsa_solution", "candidate_fused_merge")
kernel = fused.kernel

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "num_tokens, num_splits, expected",
    [(1, 32, True), (4, 32, True), (8, 16, True), (66, 2, True), (5, 32, False), (67, 2, False), (4096, 1, False), (1, 1, False)],
)
def test_fuses_only_several_splits_that_fit_one_wave(num_tokens, num_splits, expected):
    assert fused.fuses(num_tokens, num_splits) == expected


def test_the_host_split_count_fuses_every_official_size():
    for num_tokens in range(1, 9):
        assert fused.fuses(num_tokens, kernel.num_splits_for(num_tokens))


def test_a_call_adds_a_whole_step_to_each_counter_whatever_its_split_count():
    # Each CTA adds COUNTER_STEP / splits; a token's splits add COUNTER_STEP together.
    for num_splits in kernel.VALID_SPLITS:
        assert (fused.COUNTER_STEP // num_splits) * num_splits == fused.COUNTER_STEP


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("pattern", ["random", "scattered_padding", "ragged_tail", "all_padding"])
def test_fused_path_equals_kernel_py_bit_for_bit(num_tokens, pattern):
    case = cases.CheckCase("fused", num_tokens, 300, pattern)
    inputs = cases.make_inputs(case, "cuda", seed=num_tokens)
    ours = cases.poisoned_outputs(num_tokens, "cuda")
    theirs = cases.poisoned_outputs(num_tokens, "cuda")
    fused.run(*inputs.values(), *ours)
    kernel.run(*inputs.values(), *theirs)
    assert torch.equal(ours[0], theirs[0])
    assert torch.equal(ours[1], theirs[1])
    counters = fused.token_counters(inputs["q_nope"].device)
    assert bool((counters % fused.COUNTER_STEP == 0).all())
    assert int(counters[:num_tokens].min()) > 0
