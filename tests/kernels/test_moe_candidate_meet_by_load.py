"""MoE candidate v2.36 (kernels/moe/candidate_meet_by_load.py): the `mma.sync` GEMM1's meeting polls by load.
CPU: the dispatch, the guards, the compile. GPU (marked `gpu`): the output bit for bit kernel.py's at 5-32 tokens in
every routing pattern, call after call, with the kept buffer (the routed count the meeting polls) at zero after each
call. The end-to-end checks against the reference (graph capture and replay included) are test_moe_kernel.py's (the
module is in SOLUTIONS).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_meet_by_load")
streaming = solution_module("streaming_gemm")


def test_meets_by_load_wherever_the_mma_sync_gemm1_routes():
    for num_tokens in (1, 5, 6, 7, 8, 9, 16, 32):
        ours, theirs = candidate.variant_for(num_tokens), kernel.variant_for(num_tokens)
        assert ours.gemm1().meet_by_load and not theirs.gemm1().meet_by_load
        assert {**vars(ours.gemm1()), "meet_by_load": False} == vars(theirs.gemm1())
        assert vars(ours.gemm2()) == vars(theirs.gemm2())
    for num_tokens in (33, 901, 14107):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_only_a_routing_mma_sync_gemm1_meets_by_load():
    with pytest.raises(streaming.StreamingConfigError, match="meet_by_load"):
        streaming.StreamingGemmConfig(gemm1=False, block_tokens=8, num_stages=4, meet_by_load=True)
    with pytest.raises(ValueError, match="gemm1_meets_by_load"):
        kernel.StreamingVariant(block_tokens=16, gemm1_meets_by_load=True)
    with pytest.raises(ValueError, match="gemm1_meets_by_load"):
        kernel.StreamingVariant(
            block_tokens=32, wgmma_gemm1=True, wgmma_gemm2=True, routing_in_gemm1=True, gemm1_meets_by_load=True
        )


def test_compiles_its_three_configurations_beside_kernel_pys():
    compiled = candidate.compile_only("sm_90a")
    assert compiled[: len(kernel.compile_only("sm_90a"))] == kernel.compile_only("sm_90a")
    assert len(set(map(id, compiled))) == len(kernel.compile_only("sm_90a")) + 3


CASES = [
    cases.CheckCase("meet_by_load_t5", 5, 32),
    cases.CheckCase("meet_by_load_t6_no_local", 6, 160, "no_local"),
    cases.CheckCase("meet_by_load_t7", 7, 192),
    cases.CheckCase("meet_by_load_t8_one_expert", 8, 128, "one_expert"),
    cases.CheckCase("meet_by_load_t16_all_local", 16, 224, "all_local"),
    cases.CheckCase("meet_by_load_t32", 32, 64),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_outputs_are_kernel_py_bit_for_bit_and_the_count_ends_at_zero_call_after_call(case):
    routed = solution_module("counters").kept_routed(torch.device("cuda"), kernel.GPU_ARCH)
    theirs, *ours = outputs_of((kernel.run, *[candidate.run] * 3), case, seed=79)
    assert torch.isfinite(theirs).all()
    for output in ours:
        assert torch.equal(output, theirs)
    assert int(routed.abs().sum()) == 0
