"""MoE candidate v2.34 (kernels/moe/candidate_claimed_w2.py): the `mma.sync` GEMM2 of 7-32 tokens claims its items.
CPU: the dispatch, the configuration guards, the compile; a transcription of the claims (every item once in any order
of the CTAs' atomics, the counter back at zero after each launch). GPU (marked `gpu`): the output bit for bit
kernel.py's at 7-32 tokens in every routing pattern, call after call, with the kept claim counter at zero after each
call. The end-to-end checks against the reference (graph capture and replay included) are test_moe_kernel.py's (the
module is in SOLUTIONS).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_claimed_w2")
streaming = solution_module("streaming_gemm")


def test_claims_gemm2_items_from_7_to_32_tokens_only():
    for num_tokens in (7, 8):
        assert candidate.variant_for(num_tokens) is candidate.TINY_T_THREE_CTAS_CLAIMED_W2
    for num_tokens in (9, 16, 32):
        assert candidate.variant_for(num_tokens) is candidate.TINY_T_CLAIMED_W2
    for num_tokens in (1, 6, 33, 901, 14107):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)
    for ours, theirs in ((candidate.TINY_T_THREE_CTAS_CLAIMED_W2, kernel.TINY_T_THREE_CTAS),
                         (candidate.TINY_T_CLAIMED_W2, kernel.TINY_T)):  # fmt: skip
        mine, base = ours.gemm2(), theirs.gemm2()
        assert mine.dynamic_items and not base.dynamic_items
        assert {**vars(mine), "dynamic_items": False, "_smem_bytes": None} == {**vars(base), "_smem_bytes": None}
        assert mine.ctas_per_sm() == base.ctas_per_sm() == 2
        assert vars(ours.gemm1()) == vars(theirs.gemm1())


def test_claims_need_a_routing_gemm1_and_the_mma_sync_gemm2_without_early_weights():
    with pytest.raises(streaming.StreamingConfigError, match="dynamic_items"):
        streaming.StreamingGemmConfig(gemm1=True, block_tokens=8, num_stages=3, dynamic_items=True)
    with pytest.raises(streaming.StreamingConfigError, match="dynamic_items"):
        streaming.StreamingGemmConfig(
            gemm1=False, block_tokens=8, num_stages=4, weights_before_wait=True, dynamic_items=True
        )
    with pytest.raises(ValueError, match="gemm2_dynamic_items"):
        kernel.StreamingVariant(block_tokens=16, gemm2_dynamic_items=True)
    with pytest.raises(ValueError, match="gemm2_dynamic_items"):
        kernel.StreamingVariant(
            block_tokens=32, wgmma_gemm1=True, wgmma_gemm2=True, routing_in_gemm1=True, gemm2_dynamic_items=True
        )


def claims_transcribed(total_items: int, grid: int, order: random.Random, start: int = 0) -> tuple[list[int], int]:
    """The claims of `claim_item` / `release_claims` as the loop makes them: CTA c's first item is c; each CTA claims
    (counter += 1, item grid + claim) until a claim is past the last item; the CTA whose failing claim is the launch's
    final one subtracts final + 1. The CTAs' atomics interleave in `order`. Returns (items computed, counter after)."""
    counter, computed, last_claims = start, [c for c in range(min(grid, total_items))], {}
    claiming = list(range(grid))  # every CTA makes its first claim at its start, item or not
    while claiming:
        cta = order.choice(claiming)
        claim, counter = counter, counter + 1
        if grid + claim < total_items:
            computed.append(grid + claim)
        else:
            claiming.remove(cta)
            last_claims[cta] = claim
    final = max(total_items - grid, 0) + grid - 1
    for claim in last_claims.values():
        if claim == final:
            counter -= final + 1
    return computed, counter


@pytest.mark.parametrize("grid", [1, 2, 264])
def test_every_item_is_computed_once_and_the_counter_ends_at_zero(grid):
    order = random.Random(grid)
    for total_items in (0, 1, grid - 1, grid, grid + 1, 3 * grid + 7, 1120):
        if total_items < 0:
            continue
        for _ in range(5):
            computed, counter = claims_transcribed(total_items, grid, order)
            assert sorted(computed) == list(range(total_items))
            assert counter == 0


def test_compiles_its_two_configurations_beside_kernel_pys():
    compiled = candidate.compile_only("sm_90a")
    assert compiled[: len(kernel.compile_only("sm_90a"))] == kernel.compile_only("sm_90a")
    assert len(set(map(id, compiled))) == len(kernel.compile_only("sm_90a")) + 2


CASES = [
    cases.CheckCase("claimed_w2_t7", 7, 192),
    cases.CheckCase("claimed_w2_t7_all_local", 7, 0, "all_local"),
    cases.CheckCase("claimed_w2_t7_no_local", 7, 96, "no_local"),
    cases.CheckCase("claimed_w2_t8_one_expert", 8, 128, "one_expert"),
    cases.CheckCase("claimed_w2_t14", 14, 32),
    cases.CheckCase("claimed_w2_t16_all_local", 16, 224, "all_local"),
    cases.CheckCase("claimed_w2_t32", 32, 64),
    cases.CheckCase("claimed_w2_t32_one_expert", 32, 160, "one_expert"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_outputs_are_kernel_py_bit_for_bit_and_the_claims_end_at_zero_call_after_call(case):
    routed = solution_module("counters").kept_routed(torch.device("cuda"), kernel.GPU_ARCH)
    theirs, *ours = outputs_of((kernel.run, *[candidate.run] * 3), case, seed=71)
    assert torch.isfinite(theirs).all()
    for output in ours:
        assert torch.equal(output, theirs)
    assert int(routed.abs().sum()) == 0, "the combine zeroes the routed count and GEMM2 its claims"
