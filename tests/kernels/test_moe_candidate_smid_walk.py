"""MoE candidate v2.32 (kernels/moe/candidate_smid_walk.py): the three-CTA GEMM1's paired walk grouped by SM id.
CPU: the dispatch, the configuration guards, the walk a bijection for any slots drawn per SM, the compile. GPU (marked
`gpu`): the output bit for bit kernel.py's at 7-8 tokens in every routing pattern, call after call, with each SM's slot
counter advancing by exactly WALK_SLOT_ROUND per call. The end-to-end checks against the reference (graph capture and
replay included) are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_smid_walk")
streaming = solution_module("streaming_gemm")
counters = solution_module("counters")


def test_only_the_three_cta_variant_changes_its_walk():
    for num_tokens in (1, 6, 9, 32, 33, 901, 14107):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (7, 8):
        assert candidate.variant_for(num_tokens) is candidate.TINY_T_SMID_WALK
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)
    ours, theirs = candidate.TINY_T_SMID_WALK.gemm1(), kernel.TINY_T_THREE_CTAS.gemm1()
    assert ours.smid_walk and not theirs.smid_walk
    assert {**vars(ours), "smid_walk": False, "_smem_bytes": None} == {**vars(theirs), "_smem_bytes": None}
    assert "walk_slot" in ours.fields() and ours.ctas_per_sm() == 3


def test_the_walk_by_sm_id_needs_a_cooperative_three_cta_gemm1():
    with pytest.raises(streaming.StreamingConfigError, match="smid_walk"):
        streaming.StreamingGemmConfig(gemm1=True, block_tokens=8, num_stages=3, smid_walk=True)
    with pytest.raises(streaming.StreamingConfigError, match="smid_walk"):
        streaming.StreamingGemmConfig(gemm1=False, block_tokens=8, num_stages=3, max_ctas_per_sm=3, smid_walk=True)
    with pytest.raises(ValueError, match="routing_in_gemm1"):
        kernel.StreamingVariant(block_tokens=8, num_stages=3, gemm1_ctas_per_sm=3, gemm1_smid_walk=True)
    # Each launch advances an SM's word by a divisor of 2**32, so wrapping never breaks the slots.
    assert 2**32 % streaming.WALK_SLOT_ROUND == 0 and streaming.WALK_SLOT_ROUND > streaming.PAIRED_SLOTS


@pytest.mark.parametrize("sms", [1, 7, 132])
def test_the_walk_is_a_bijection_whatever_slots_the_sms_draw(sms):
    # Any CTA may land on any SM and draw any free slot there: the walk covers every item once for every such draw.
    draw = random.Random(sms)
    for total_items in (0, 1, sms + 1, 5 * sms - 1, 640):
        owners = [(sm, slot) for sm in range(sms) for slot in range(3)]
        draw.shuffle(owners)
        items = []
        for sm, slot in owners:  # one CTA per (SM, slot), in whatever order the CTAs were numbered
            base, stride, count = streaming.paired_round_walk(total_items, sm, slot, sms)
            items += [base + j * stride for j in range(count)]
        assert sorted(items) == list(range(total_items))


def test_compiles_its_configuration_and_the_slot_zeroing_beside_kernel_pys():
    compiled = candidate.compile_only("sm_90a")
    assert compiled[: len(kernel.VARIANTS) + 1] == kernel.compile_only("sm_90a")
    assert len(set(map(id, compiled))) == len(kernel.VARIANTS) + 3


CASES = [
    cases.CheckCase("smid_walk_t7", 7, 192),
    cases.CheckCase("smid_walk_t7_all_local", 7, 0, "all_local"),
    cases.CheckCase("smid_walk_t7_no_local", 7, 96, "no_local"),
    cases.CheckCase("smid_walk_t8_one_expert", 8, 128, "one_expert"),
    cases.CheckCase("smid_walk_t8_all_local", 8, 32, "all_local"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_outputs_are_kernel_py_bit_for_bit_and_each_call_advances_every_sms_slots_by_a_round(case):
    device = torch.device("cuda")
    slots = counters.kept_walk_slots(device, kernel.GPU_ARCH)
    before = slots.clone()
    calls = 3
    theirs, *ours = outputs_of((kernel.run, *[candidate.run] * calls), case, seed=59)
    assert torch.isfinite(theirs).all()
    for output in ours:
        assert torch.equal(output, theirs)
    # The H200's SM ids are dense (`tools/cta_placement.py`), so every SM draws its slots (no fallback walk).
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    advanced = (slots - before)[:sms]
    assert torch.equal(advanced, torch.full_like(advanced, calls * streaming.WALK_SLOT_ROUND))
    assert int(slots[sms:].abs().sum()) == 0
