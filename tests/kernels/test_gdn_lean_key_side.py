"""kernels/gdn_prefill/lean_key_side.py (candidate `cand_lean_key_side`): the WY path with T and the inverse's
scratch in the key side's k/q storage. The same operations on the same values, so the workspace and every output
are the standard WY path's bit for bit (GPU); it compiles for sm_90a with each chain, and the standard key side's
code is unchanged by the option (CPU). Its checks against the reference are test_gdn_prefill_kernel.py's, which
run every module of `KERNEL_CHOICES`. kernel.wy_chain_config, which it shares with other candidates, is tested
here too."""

from __future__ import annotations

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT
from tests.kernels.compile_checks import assert_compiles_and_caches

cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
device_check = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/probes/device_check_gdn.py", "device_check_gdn")
lean_key_side = device_check.load_kernel_module("lean_key_side")
wy_prepass, wgmma_value_side, kernel = lean_key_side.wy_prepass, lean_key_side.wgmma_value_side, lean_key_side.kernel

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_compiles_every_chain_for_sm90a_without_gpu():
    assert_compiles_and_caches(lean_key_side.compile_only, 3)


@pytest.mark.parametrize(("num_seqs", "wgmma"), [(1, False), (4, False), (14, False), (15, True), (57, True)])
def test_the_chain_is_kernel_pys(num_seqs, wgmma):
    output = torch.empty(16, dtype=torch.bfloat16)
    config = kernel.wy_chain_config(num_seqs, output)
    assert config == (None if wgmma else wy_prepass.config_for(num_seqs))
    assert (num_seqs >= kernel.WGMMA_CHAIN_MIN_SEQS) == wgmma
    # An output off a 16-B boundary takes wy_prepass.py's chain, as wgmma_value_side.run does.
    assert kernel.wy_chain_config(num_seqs, output[1:]) == wy_prepass.config_for(num_seqs)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("one_long", (1377,), True, 0.0, "mamba2"),
        cases.CheckCase("three_with_empty", (0, 600, 64, 130), False, 0.0, "fast_decay"),
        cases.CheckCase("fifteen", tuple(range(200, 500, 20)), True, 0.1, "mamba2"),
        cases.CheckCase("many_and_slow", cases.random_composition(8192, 40, seed=3), True, 0.0, "slow_decay"),
    ],
    ids=lambda case: case.name,
)
def test_outputs_and_states_are_the_wy_paths_bit_for_bit(case):
    standard = wgmma_value_side.run if len(case.lengths) >= kernel.WGMMA_CHAIN_MIN_SEQS else wy_prepass.run
    assert cases.bitwise_mismatch(case, [standard, lean_key_side.run], "cuda", seed=71) is None
