"""MoE candidate v2.10 (kernels/moe/candidate_row_tile_handoff.py): GEMM2 takes each row tile as soon as GEMM1 has
finished it, in TINY_T only (v2.9 had it in every variant; its checks below still cover all four). CPU: the dispatch, the chain's links, the configurations (a GEMM2 row tile lies in one GEMM1 row
tile; still two CTAs per SM), the counters' capacity, and that the four variants compile. GPU (marked `gpu`): the
output equal to kernel.py's bit for bit in every variant for random, skewed, all-local and no-local routing,
repeated calls on one stream (the routing re-zeroes the counters). The end-to-end checks against the reference
and the graph replay are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_row_tile_handoff")
host = solution_module("host")

BITWISE_CASES = (
    cases.CheckCase("t1", 1, 0),
    cases.CheckCase("t14", 14, 224),
    cases.CheckCase("t16_all_local", 16, 32, "all_local"),
    cases.CheckCase("t32_one_expert", 32, 96, "one_expert"),
    cases.CheckCase("t58", 58, 0),
    cases.CheckCase("t192_all_local", 192, 160, "all_local"),
    cases.CheckCase("t901", 901, 96),
    cases.CheckCase("t901_one_expert", 901, 224, "one_expert"),
    cases.CheckCase("t1025_all_local", 1025, 96, "all_local"),
    cases.CheckCase("t80_no_local", 80, 96, "no_local"),
)


def test_dispatch_is_kernel_py_with_the_handoff_below_33_tokens():
    for num_tokens in (1, 14, 32):
        assert candidate.variant_for(num_tokens) == dataclasses.replace(kernel.TINY_T, row_tile_handoff=True)
    for num_tokens in (33, 192, 193, 1024, 1025, kernel.MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


@pytest.mark.parametrize("variant", kernel.VARIANTS, ids=lambda v: f"bt{v.block_tokens}_wgmma{int(v.wgmma_gemm1)}")
def test_gemm1_signals_and_gemm2_polls_its_row_tiles(variant):
    handoff = dataclasses.replace(variant, row_tile_handoff=True)
    gemm1, gemm2 = handoff.gemm1(), handoff.gemm2()
    assert gemm1.signals and gemm2.handoff is not None
    assert gemm2.handoff.gemm1_block_tokens == variant.block_tokens
    assert gemm2.handoff.gemm1_items_per_row_tile == gemm1.items_per_row_tile
    assert gemm1.block_tokens % gemm2.block_tokens == 0  # a GEMM2 row tile lies in one GEMM1 row tile
    assert gemm2.ctas_per_sm() == variant.gemm2().ctas_per_sm() == 2
    assert not variant.gemm1().signals and variant.gemm2().handoff is None  # kernel.py's own


def test_the_chain_lets_gemm2_launch_after_gemm1_waited_and_poll_instead_of_waiting():
    variant = dataclasses.replace(kernel.MEDIUM_T, row_tile_handoff=True)
    moe_host = host.MoeHostSm90(variant.make_gemm1(), variant.make_gemm2())
    assert moe_host.routing.clears_row_tiles
    assert moe_host.gemm1.link.waits and moe_host.gemm1.link.releases_after_wait
    assert moe_host.gemm2.link.waits and moe_host.gemm2.link.polls  # a dependent launch that polls
    assert not moe_host.combine.link.polls  # the combine still waits for GEMM2's grid
    plain = host.MoeHostSm90(kernel.MEDIUM_T.make_gemm1(), kernel.MEDIUM_T.make_gemm2())
    assert not plain.routing.clears_row_tiles and not plain.gemm2.link.polls


def test_the_host_refuses_a_polling_gemm2_without_a_signalling_gemm1():
    variant = dataclasses.replace(kernel.MEDIUM_T, row_tile_handoff=True)
    with pytest.raises(ValueError, match="signals"):
        host.MoeHostSm90(kernel.MEDIUM_T.make_gemm1(), variant.make_gemm2())


@pytest.mark.parametrize("num_tokens", [1, 2, 15, 16, 901, kernel.MAX_TOKENS])
def test_the_counters_cover_every_row_tile_and_the_routing_grid_covers_the_counters(num_tokens):
    capacity = host.row_tile_capacity(num_tokens)
    # worst case: every expert's count one past a multiple of the smallest GEMM1 tile
    assert capacity >= (8 * num_tokens) // host.MIN_GEMM1_BLOCK_TOKENS + 32
    assert min(v.block_tokens for v in kernel.VARIANTS) >= host.MIN_GEMM1_BLOCK_TOKENS
    routing_threads = -(-num_tokens // 4) * 128  # routing.ROUTING_WARPS tokens per CTA of 128 threads
    assert routing_threads >= capacity


@pytest.mark.parametrize(("gemm1_tokens", "gemm2_tokens"), [(16, 8), (32, 32), (64, 32)])
def test_each_gemm2_row_tile_maps_to_the_gemm1_row_tile_that_holds_its_rows(gemm1_tokens, gemm2_tokens):
    streaming = solution_module("streaming_gemm")
    generator = torch.Generator().manual_seed(gemm1_tokens)
    counts = torch.randint(0, 200, (32,), generator=generator)
    counts[3] = 0  # an expert without tokens has no row tiles
    # GEMM1's row tiles in its walk's order: expert by expert, `gemm1_tokens` packed rows each
    gemm1_tiles = [(e, first) for e in range(32) for first in range(0, int(counts[e]), gemm1_tokens)]
    tile_end = torch.cumsum((counts + gemm1_tokens - 1) // gemm1_tokens, 0)
    for e in range(32):
        for first_row in range(0, int(counts[e]), gemm2_tokens):
            row_tile = streaming.gemm1_row_tile(int(tile_end[e]), int(counts[e]), first_row, gemm1_tokens)
            expert, gemm1_first = gemm1_tiles[row_tile]
            assert expert == e and gemm1_first <= first_row
            assert first_row + min(gemm2_tokens, int(counts[e]) - first_row) <= gemm1_first + gemm1_tokens


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    # Twice in a row on one stream: the second call's counters most likely reuse the first call's memory
    # (the caching allocator), which holds that call's final counts, so the routing's zeroing is tested too.
    outputs = outputs_of((kernel.run, candidate.run, candidate.run), case, seed=47)
    assert torch.isfinite(outputs[0]).all()
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
