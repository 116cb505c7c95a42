"""MoE candidate v2.53 (kernels/moe/candidate_l1_token_rows.py): MEDIUM_T's GEMM1 with an SM's three CTAs on
consecutive items in the walk's full rounds and the producer's token rows through L1. CPU: the dispatch, the
configuration and its guards, the grouped walk taking every item once with each CTA's count unchanged, the compile.
GPU (marked `gpu`): the output bit for bit kernel.py's at 193-1024 tokens for every routing pattern, call after call.
The end-to-end checks against the reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import assert_bit_for_bit

candidate = solution_module("candidate_l1_token_rows")
wgmma_gemm1 = solution_module("wgmma_gemm1")

SMS = 132
GRID = 3 * SMS  # smid_walk's grid: three CTAs on every SM

BITWISE_CASES = (
    cases.CheckCase("t193", 193, 224),
    cases.CheckCase("t512", 512, 0),
    cases.CheckCase("t901", 901, 96),
    cases.CheckCase("t901_one_expert", 901, 224, "one_expert"),
    cases.CheckCase("t1000_no_local", 1000, 64, "no_local"),
    cases.CheckCase("t1024_all_local", 1024, 160, "all_local"),
)


def test_only_medium_t_changes():
    for num_tokens in (1, 7, 8, 32, 33, 192, kernel.MEDIUM_T_MAX_TOKENS + 1, 11948):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (193, 901, kernel.MEDIUM_T_MAX_TOKENS):
        chosen = candidate.variant_for(num_tokens)
        assert chosen is candidate.L1_TOKEN_ROWS
        switches = dict(gemm1_sm_grouped_items=False, gemm1_token_rows_through_l1=False)
        assert dataclasses.replace(chosen, **switches) == kernel.MEDIUM_T
        assert candidate.medium_t_as(candidate.L1_ONLY)(num_tokens) is candidate.L1_ONLY
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_configuration_and_its_guards():
    gemm1 = candidate.L1_TOKEN_ROWS.gemm1()
    assert gemm1.sm_grouped_items and gemm1.token_rows_through_l1
    assert candidate.GROUPED_ONLY.gemm1().sm_grouped_items and not candidate.GROUPED_ONLY.gemm1().token_rows_through_l1
    assert not kernel.MEDIUM_T.gemm1().sm_grouped_items and not kernel.MEDIUM_T.gemm1().token_rows_through_l1
    plain = kernel.MEDIUM_T.gemm1()
    assert set(gemm1.fields()) == set(plain.fields()) and gemm1.smem_bytes() == plain.smem_bytes()
    assert gemm1.ctas_per_sm() == 3
    with pytest.raises(wgmma_gemm1.StreamingConfigError, match="sm_grouped_items"):
        wgmma_gemm1.WgmmaGemm1Config(32, 3, scratch_in_stage=True, producer_warp=True, sm_grouped_items=True)
    with pytest.raises(wgmma_gemm1.StreamingConfigError, match="token_rows_through_l1"):
        wgmma_gemm1.WgmmaGemm1Config(32, 3, scratch_in_stage=True, token_rows_through_l1=True)
    with pytest.raises(ValueError, match="gemm1_sm_grouped_items"):
        dataclasses.replace(kernel.LARGE_T, gemm1_sm_grouped_items=True)


def cta_items(total_items: int, slot: int, sm: int) -> list[int]:
    """The items of the CTA in `slot` of SM `sm`, as the kernel walks them: its count from the plain walk
    (`cta_stage_count`'s formula), each round's item from `grouped_round_item`."""
    walk, sm_walk = slot * SMS + sm, sm * 3 + slot
    count = (total_items - walk + GRID - 1) // GRID if walk < total_items else 0
    full_rounds = total_items // GRID
    return [wgmma_gemm1.grouped_round_item(r, walk, sm_walk, full_rounds, GRID) for r in range(count)]


@pytest.mark.parametrize("row_tiles", [1, 6, 7, 19, 29, 30, 64])
def test_the_grouped_walk_takes_every_item_once(row_tiles):
    total_items = row_tiles * wgmma_gemm1.ITEMS_PER_ROW_TILE
    taken = [item for slot in range(3) for sm in range(SMS) for item in cta_items(total_items, slot, sm)]
    assert sorted(taken) == list(range(total_items))
    # In a full round an SM's three CTAs hold consecutive items; the partial round is the plain walk's.
    full_rounds = total_items // GRID
    for sm in (0, 5, SMS - 1):
        firsts = [cta_items(total_items, slot, sm)[:full_rounds] for slot in range(3)]
        for r in range(full_rounds):
            assert [items[r] for items in firsts] == [r * GRID + 3 * sm + slot for slot in range(3)]
    for slot, sm in ((0, 0), (2, SMS - 1)):
        items = cta_items(total_items, slot, sm)
        if len(items) > full_rounds:
            assert items[full_rounds] == full_rounds * GRID + slot * SMS + sm


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    runs = (kernel.run, candidate.run, candidate.run, candidate.run_grouped_only, candidate.run_l1_only)
    assert_bit_for_bit(runs, case, seed=113)
