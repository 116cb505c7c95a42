"""MoE candidate v2.42 (kernels/moe/candidate_gemm1_smid_walk.py): v2.41's GEMM1 for MEDIUM_T (3 stages at three CTAs
per SM, its epilogue tile in a stage) walking by SM id. CPU: the dispatch, the configuration (three CTAs' shared memory
with the slot word, the cooperative grid, the guard) and the compile. GPU (marked `gpu`): the output bit for bit
kernel.py's at 193-1024 tokens for every routing pattern, from kept slot words of every residue. The end-to-end checks
against the reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import assert_bit_for_bit, outputs_of

candidate = solution_module("candidate_gemm1_smid_walk")
WgmmaGemm1Config = solution_module("wgmma_gemm1").WgmmaGemm1Config
StreamingConfigError = solution_module("streaming_gemm").StreamingConfigError

BITWISE_CASES = (
    cases.CheckCase("t193", 193, 224),
    cases.CheckCase("t500_one_expert", 500, 32, "one_expert"),
    cases.CheckCase("t901", 901, 96),
    cases.CheckCase("t1000_no_local", 1000, 64, "no_local"),
    cases.CheckCase("t1024_all_local", 1024, 160, "all_local"),
)


def test_only_medium_t_changes():
    for num_tokens in (193, 901, kernel.MEDIUM_T_MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is candidate.MEDIUM_T_GEMM1_SMID_WALK
    for num_tokens in (1, 7, 32, 33, 192, kernel.MEDIUM_T_MAX_TOKENS + 1, kernel.MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_gemm1_walks_by_sm_id_at_three_ctas_per_sm_and_gemm2_is_kernel_pys():
    variant = candidate.MEDIUM_T_GEMM1_SMID_WALK
    gemm1 = variant.gemm1()
    assert isinstance(gemm1, WgmmaGemm1Config) and gemm1.smid_walk
    assert (gemm1.block_tokens, gemm1.num_stages, gemm1.scratch_in_stage, gemm1.ctas_per_sm()) == (32, 3, True, 3)
    assert kernel.persistent_ctas(gemm1, 132) == 396 and variant.routing_in_gemm1  # cooperative: all resident
    assert vars(variant.gemm2()) == vars(kernel.MEDIUM_T.gemm2())
    assert not kernel.MEDIUM_T.gemm1().smid_walk


def test_the_walk_by_sm_id_needs_three_ctas_per_sm():
    # Its draw gives an SM's CTAs the slots 0-2 (`streaming_gemm.take_walk_slot`): with two CTAs per SM (or three that
    # do not fit) a slot would be missing and its items lost.
    with pytest.raises(StreamingConfigError):
        WgmmaGemm1Config(block_tokens=32, num_stages=4, smid_walk=True)
    with pytest.raises(StreamingConfigError):
        WgmmaGemm1Config(block_tokens=32, num_stages=4, max_ctas_per_sm=3, smid_walk=True)  # ~104 KB a CTA


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    assert_bit_for_bit((kernel.run, candidate.run, candidate.run), case, seed=67)


@pytest.mark.gpu
@needs_cuda
def test_the_walk_by_sm_id_is_kernel_py_bit_for_bit_from_any_slot_words():
    # The slot words are kept and shared with the three-CTA `mma.sync` GEMM1 (7-8 tokens), and no call zeroes them:
    # from words of every residue (the int32 wrap included) each call gives every SM's CTAs every slot once, so the
    # outputs stay kernel.py's bit for bit and each word advances by 3 from 0 mod 4 and by 4 otherwise.
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    words = solution_module("counters").kept_walk_slots(device, kernel.GPU_ARCH)
    start = torch.tensor([-2**31, 2**31 - 1, -1, 0, 1, 2, 3, 5] * 32, dtype=torch.int32, device=device)[: words.numel()]
    words.copy_(start)
    case = cases.CheckCase("t901", 901, 96)
    theirs, *ours = outputs_of((kernel.run, candidate.run, candidate.run), case, seed=73)
    assert torch.isfinite(theirs).all() and bool((theirs != 0).any())
    for output in ours:
        assert torch.equal(output, theirs)
    advanced = (words.long() - start.long()) % 2**32
    first = torch.where(start.long() % 4 == 0, 3, 4)
    assert torch.equal(advanced[:sms], first[:sms] + 4)
    assert torch.equal(advanced[sms:], torch.zeros_like(advanced[sms:]))
