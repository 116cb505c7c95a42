"""kernels/gdn_prefill/persistent_chain.py (candidate `cand_persistent_chain`): the WGMMA chain as a persistent
kernel whose CTAs claim their next (sequence, head) and prefetch it. The same operations on the same values, so
every output is `wgmma_value_side.py`'s bit for bit, and every launch leaves the claim counter at zero (GPU); it
compiles for sm_90a (CPU). Its checks against the reference are
test_gdn_prefill_kernel.py's, which run every module of `KERNEL_CHOICES`."""

from __future__ import annotations

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT
from tests.kernels.compile_checks import assert_compiles_and_caches

cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
device_check = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/probes/device_check_gdn.py", "device_check_gdn")
persistent_chain = device_check.load_kernel_module("persistent_chain")
wgmma_value_side, kernel = persistent_chain.wgmma_value_side, persistent_chain.kernel

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_compiles_for_sm90a_without_gpu():
    # the launcher and the claim counter's zeroing
    assert_compiles_and_caches(persistent_chain.compile_only, 2)


@pytest.mark.parametrize(("num_tokens", "num_seqs", "path"), [(4124, 15, True), (8192, 57, True), (5709, 2, False)])
def test_the_candidate_side_takes_only_the_wgmma_chains_rows(num_tokens, num_seqs, path):
    assert (kernel.path_for(num_tokens, num_seqs) is wgmma_value_side) == path


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("fifteen_one_round", tuple(range(200, 500, 20)), True, 0.1, "mamba2"),
        cases.CheckCase("twenty_two_rounds", cases.random_composition(8192, 20, seed=20), True, 0.0, "mamba2"),
        cases.CheckCase("fifty_seven_slow", cases.random_composition(8192, 57, seed=57), True, 0.0, "slow_decay"),
        cases.CheckCase("forty_no_state", cases.random_composition(3000, 40, seed=40), False, 0.0, "fast_decay"),
        cases.CheckCase("unranked_130_with_empty", (0, *cases.MANY_130[1:], 0), True, 0.05, "mamba2"),
    ],
    ids=lambda case: case.name,
)
def test_outputs_and_states_are_the_wgmma_chains_bit_for_bit(case):
    # Twice: the second call claims from the counter the first left at zero.
    runs = [wgmma_value_side.run, persistent_chain.run, persistent_chain.run]
    assert cases.bitwise_mismatch(case, runs, "cuda", seed=73) is None
    assert persistent_chain._claims(torch.device("cuda")).item() == 0
