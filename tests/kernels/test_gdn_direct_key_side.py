"""kernels/gdn_prefill/direct_key_side.py (candidate `cand_direct_key_side`): the WY path whose key side computes the
Gram tiles by bf16 MMAs from the staged rows and finds each CTA's sequence by a warp search. It compiles for sm_90a
with each chain and leaves the standard launchers' code alone (CPU); on the GPU its outputs and states are the
standard WY path's up to the fp16 rounding of k and q elements below 2^-14 that it no longer makes. Its checks
against the reference are test_gdn_prefill_kernel.py's, which run every module of `KERNEL_CHOICES`."""

from __future__ import annotations

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT
from tests.kernels.compile_checks import assert_compiles_and_caches

cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
device_check = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/probes/device_check_gdn.py", "device_check_gdn")
direct_key_side = device_check.load_kernel_module("direct_key_side")
wy_prepass, wgmma_value_side = direct_key_side.wy_prepass, direct_key_side.wgmma_value_side
kernel = direct_key_side.kernel

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Relative L2 distance allowed between the two key sides' results: the fp16 rounding of a few tiny k and q elements
# moves an fp16 entry of T or P by an ulp here and there (~1e-5 relative each), far below the track's 1e-2 gate.
CLOSE_RELATIVE_L2 = 1e-3


def test_compiles_every_chain_for_sm90a_without_gpu():
    assert_compiles_and_caches(direct_key_side.compile_only, 3)


def test_the_standard_launchers_take_the_standard_key_side():
    launcher = wy_prepass.GdnPrefillWyPrepassSm90(wy_prepass.config_for(1))
    assert not launcher.key_side().direct and not wgmma_value_side.GdnPrefillWyWgmmaSm90().key_side().direct
    assert direct_key_side._DirectWgmma().key_side().direct


def _relative_l2(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    difference = (ours.float() - theirs.float()).norm()
    return (difference / theirs.float().norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("one_long", (1377,), True, 0.0, "mamba2"),
        cases.CheckCase("three_with_empty", (0, 600, 64, 130), False, 0.0, "fast_decay"),
        cases.CheckCase("fifteen", tuple(range(200, 500, 20)), True, 0.1, "mamba2"),
        cases.CheckCase("many_and_slow", cases.random_composition(8192, 40, seed=3), True, 0.0, "slow_decay"),
        # Three rounds of the warp search (more than 1057 sequences).
        cases.CheckCase("eleven_hundred", cases.random_composition(8800, 1100, seed=5), True, 0.0, "mamba2"),
    ],
    ids=lambda case: case.name,
)
def test_outputs_and_states_match_the_standard_key_side(case):
    standard = wgmma_value_side.run if len(case.lengths) >= kernel.WGMMA_CHAIN_MIN_SEQS else wy_prepass.run
    results = cases.outputs_of_runs(case, [standard, direct_key_side.run], "cuda", seed=71)
    for output, new_state in results:
        assert torch.isfinite(output).all() and torch.isfinite(new_state).all()
    (out_standard, state_standard), (out_direct, state_direct) = results
    assert _relative_l2(out_direct, out_standard) <= CLOSE_RELATIVE_L2
    assert _relative_l2(state_direct, state_standard) <= CLOSE_RELATIVE_L2
