"""MoE candidate v2.37 (kernels/moe/candidate_meeting_prefetch.py): the `mma.sync` GEMM1 of 5-32 tokens prefetches some
of its chosen experts' weights into L2 while its grid meets.
CPU: the dispatch, the guards, the items each choice prefetches (disjoint per expert, inside its row tile) and the W13
rows they name, the compile. GPU (marked `gpu`): the output bit for bit kernel.py's at 5-32 tokens in every routing
pattern, call after call, with the kept routed count at zero after each call. The end-to-end checks against the reference
(graph capture and replay included) are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_meeting_prefetch")
streaming = solution_module("streaming_gemm")
shapes = solution_module("shapes")


def test_prefetches_wherever_the_mma_sync_gemm1_routes():
    for num_tokens in (1, 5, 6, 7, 8, 9, 16, 32):
        ours, theirs = candidate.variant_for(num_tokens), kernel.variant_for(num_tokens)
        assert ours.gemm1().meeting_prefetch and not theirs.gemm1().meeting_prefetch
        assert {**vars(ours.gemm1()), "meeting_prefetch": False} == vars(theirs.gemm1())
        assert vars(ours.gemm2()) == vars(theirs.gemm2())
    for num_tokens in (33, 901, 14107):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_only_a_routing_mma_sync_gemm1_prefetches_in_the_meeting():
    with pytest.raises(streaming.StreamingConfigError, match="meeting_prefetch"):
        streaming.StreamingGemmConfig(gemm1=False, block_tokens=8, num_stages=4, meeting_prefetch=True)
    with pytest.raises(ValueError, match="gemm1_meeting_prefetch"):
        kernel.StreamingVariant(block_tokens=16, gemm1_meeting_prefetch=True)
    with pytest.raises(ValueError, match="gemm1_meeting_prefetch"):
        kernel.StreamingVariant(
            block_tokens=32, wgmma_gemm1=True, wgmma_gemm2=True, routing_in_gemm1=True, gemm1_meeting_prefetch=True
        )


@pytest.mark.parametrize("num_tokens", [5, 6, 7, 8, 9, 14, 16, 28, 29, 32, 1024])
def test_the_choices_of_one_expert_prefetch_disjoint_items_inside_its_row_tile(num_tokens):
    per_choice = max(1, streaming.MEETING_PREFETCH_ITEMS // num_tokens)
    seen: set[int] = set()
    for rank in range(num_tokens):  # an expert has at most T tokens, ranks 0 .. T - 1
        first, items = streaming.meeting_prefetch_items(rank, num_tokens)
        assert 0 <= first <= streaming.GEMM1_ITEMS_PER_ROW_TILE and 0 <= items <= per_choice
        named = set(range(first, first + items))
        assert named <= set(range(streaming.GEMM1_ITEMS_PER_ROW_TILE)) and not named & seen
        seen |= named
    # Every rank up to the row tile's end takes its full share: the experts' first items, in rank order.
    assert seen == set(range(min(num_tokens * per_choice, streaming.GEMM1_ITEMS_PER_ROW_TILE)))
    assert streaming.meeting_prefetch_items(0, 7) == (0, 4)  # ~6.3 MB at 7 tokens with one local expert each


@pytest.mark.parametrize("first, items", [(0, 4), (4, 4), (124, 4), (127, 1), (0, 28)])
def test_the_two_prefetched_ranges_are_exactly_the_items_weight_rows(first, items):
    # `prefetch_chosen_items`: from item_weight_row(True, first, 16 h), items x 16 rows, for h = 0 (up) and 1 (gate).
    columns = streaming.GEMM1_ITEM_COLUMNS
    ranges = {
        row
        for half in (0, 1)
        for row in range(
            streaming.item_weight_row(True, first, half * columns),
            streaming.item_weight_row(True, first, half * columns) + items * columns,
        )
    }
    rows = {
        streaming.item_weight_row(True, n, r) for n in range(first, first + items) for r in range(streaming.ITEM_ROWS)
    }
    assert ranges == rows and max(rows) < shapes.GEMM1_OUT


def test_compiles_its_three_configurations_beside_kernel_pys():
    compiled = candidate.compile_only("sm_90a")
    assert compiled[: len(kernel.compile_only("sm_90a"))] == kernel.compile_only("sm_90a")
    assert len(set(map(id, compiled))) == len(kernel.compile_only("sm_90a")) + 3


CASES = [
    cases.CheckCase("meeting_prefetch_t5", 5, 32),
    cases.CheckCase("meeting_prefetch_t6_no_local", 6, 160, "no_local"),
    cases.CheckCase("meeting_prefetch_t7", 7, 192),
    cases.CheckCase("meeting_prefetch_t8_one_expert", 8, 128, "one_expert"),
    cases.CheckCase("meeting_prefetch_t16_all_local", 16, 224, "all_local"),
    cases.CheckCase("meeting_prefetch_t32", 32, 64),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_outputs_are_kernel_py_bit_for_bit_and_the_count_ends_at_zero_call_after_call(case):
    routed = solution_module("counters").kept_routed(torch.device("cuda"), kernel.GPU_ARCH)
    theirs, *ours = outputs_of((kernel.run, *[candidate.run] * 3), case, seed=83)
    assert torch.isfinite(theirs).all()
    for output in ours:
        assert torch.equal(output, theirs)
    assert int(routed.abs().sum()) == 0
