"""MoE candidate v2.29 (kernels/moe/candidate_three_ctas.py): GEMM1 at three CTAs per SM in paired rounds at 7-8
tokens. CPU: the dispatch, the configuration (three GEMM1 CTAs fit an SM; kernel.py's keep two), the paired-round walk,
the compile. GPU (marked `gpu`): the output bit for bit kernel.py's at 7-8 tokens in every routing pattern, call after
call (the kept counters back at zero each time). The end-to-end checks against the reference are test_moe_kernel.py's
(the module is in SOLUTIONS).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_three_ctas")
streaming = solution_module("streaming_gemm")


def test_only_7_and_8_tokens_change():
    for num_tokens in (*range(1, 7), 9, 16, 32, 33, 901, 14107, kernel.MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (7, 8):
        assert kernel.variant_for(num_tokens) is kernel.TINY_T
        assert candidate.variant_for(num_tokens) is candidate.TINY_T_THREE_CTAS
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_gemm1_fits_three_ctas_per_sm_and_only_gemm1_changes():
    ours, theirs = candidate.TINY_T_THREE_CTAS, kernel.TINY_T
    gemm1 = ours.gemm1()
    assert (gemm1.block_tokens, gemm1.num_stages, gemm1.ctas_per_sm(), gemm1.paired_rounds) == (8, 3, 3, True)
    assert 3 * (gemm1.smem_bytes() + streaming.SMEM_RESERVED_PER_CTA) <= streaming.SMEM_PER_SM
    assert kernel.persistent_ctas(gemm1, 132) == 396
    assert vars(ours.gemm2()) == vars(theirs.gemm2())
    # kernel.py's own GEMM1 keeps two CTAs per SM (its 16-token tiles of 4 stages do not fit three) and its walk.
    assert theirs.gemm1().ctas_per_sm() == 2 and not theirs.gemm1().paired_rounds


def test_three_ctas_are_the_mma_sync_gemm1s_only_and_must_fit():
    with pytest.raises(ValueError, match="gemm1_ctas_per_sm"):
        kernel.StreamingVariant(block_tokens=32, wgmma_gemm1=True, gemm1_ctas_per_sm=3)
    with pytest.raises(streaming.StreamingConfigError, match="max_ctas_per_sm"):
        streaming.StreamingGemmConfig(gemm1=True, block_tokens=8, num_stages=3, max_ctas_per_sm=4)
    # The paired walk needs all three resident: 16-token tiles of 4 stages fit two.
    with pytest.raises(streaming.StreamingConfigError, match="three CTAs"):
        streaming.StreamingGemmConfig(gemm1=True, block_tokens=16, num_stages=4, max_ctas_per_sm=3)


def walks(total_items: int, sms: int) -> list[list[int]]:
    """Every CTA's items under `paired_round_walk` (CTA c on SM c mod sms)."""
    items = []
    for cta in range(3 * sms):
        base, stride, count = streaming.paired_round_walk(total_items, cta, 3 * sms)
        assert count >= 0
        items.append([base + j * stride for j in range(count)])
    return items


# Every item count up to 4 items per SM on small grids; on the H200's, each side of every multiple of its SMs.
WALK_GRIDS = [(sms, range(4 * sms + 2)) for sms in (1, 2, 7)] + [
    (132, sorted({0, *(132 * k + d for k in range(1, 8) for d in (-1, 0, 1)), 640, 896, 1024, 1280}))
]


@pytest.mark.parametrize(("sms", "totals"), WALK_GRIDS, ids=lambda v: str(v) if isinstance(v, int) else "")
def test_paired_round_walk_covers_every_item_once_and_pairs_each_sms_last_round(sms, totals):
    for total_items in totals:
        items = walks(total_items, sms)
        assert sorted(i for walk in items for i in walk) == list(range(total_items))
        for sm in range(sms):
            per_slot = [len(items[sm + slot * sms]) for slot in range(3)]
            n = sum(per_slot)
            # Items round robin over the SMs; the SM's two busiest CTAs hold the same count unless it has one item.
            assert n == len(range(sm, total_items, sms))
            assert all(i % sms == sm for slot in range(3) for i in items[sm + slot * sms])
            assert per_slot[0] == max(per_slot) and per_slot[2] == min(per_slot)
            assert per_slot[1] == per_slot[0] or n == 1


def test_paired_rounds_at_the_7_token_rows_expert_counts():
    # 132 SMs: 5 experts (640 items) -> SMs of 5 as (2, 2, 1); 7 experts (896) -> SMs of 7 as (3, 3, 1).
    for total_items, busiest in ((640, (2, 2, 1)), (896, (3, 3, 1)), (1024, (3, 3, 2))):
        items = walks(total_items, 132)
        assert tuple(len(items[slot * 132]) for slot in range(3)) == busiest


def test_compiles_its_configuration_beside_kernel_pys():
    compiled = candidate.compile_only("sm_90a")
    assert compiled[: len(kernel.VARIANTS) + 1] == kernel.compile_only("sm_90a")
    assert len(set(map(id, compiled))) == len(kernel.VARIANTS) + 2


CASES = [
    cases.CheckCase("three_ctas_t7", 7, 192),
    cases.CheckCase("three_ctas_t7_all_local", 7, 0, "all_local"),
    cases.CheckCase("three_ctas_t7_no_local", 7, 96, "no_local"),
    cases.CheckCase("three_ctas_t8", 8, 224),
    cases.CheckCase("three_ctas_t8_one_expert", 8, 128, "one_expert"),
    cases.CheckCase("three_ctas_t8_all_local", 8, 32, "all_local"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_outputs_are_kernel_py_bit_for_bit_call_after_call(case):
    # An 8-token tile regroups no token's products, the walk only moves items between CTAs, and three calls in a row
    # find the kept counters zeroed.
    theirs, *ours = outputs_of((kernel.run, *[candidate.run] * 3), case, seed=41)
    assert torch.isfinite(theirs).all()
    for output in ours:
        assert torch.equal(output, theirs)
