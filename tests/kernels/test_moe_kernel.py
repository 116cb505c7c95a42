"""Our CuTe-DSL FP8 block-scale MoE kernel (kernels/moe/kernel.py).

CPU: every configuration compiles for sm_90a without a GPU; the variants' dispatch; the host's chain (the row gather
before the grouped GEMM1 in GROUPED_T's only); the workspaces; input validation; the routing patterns of the check
cases (verified with our reference's routing).
GPU (marked `gpu`, skipped without CUDA), for kernel.py and any candidate of the folder
(SOLUTIONS): `run` against hopperbench/tracks/moe/reference.py on fresh inputs for every case in
kernels/moe/check_cases.py (contest rule and relative L2 <= 1e-2, NaN-
poisoned output), zero rows for tokens without a local expert, bitwise-repeatable calls, and
CUDA-graph capture and replay; GROUPED_T forced on every large case of check_cases.py (1025-16384 tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import zlib

import pytest
import torch

from hopperbench.devcheck import load_module_by_path, replay_on_fresh_inputs
from hopperbench.paths import REPO_ROOT
from tests.kernels.compile_checks import assert_compiles_and_caches

# kernels/ is not a package: load the case helpers and the kernel by path, as the harness does.
cases = load_module_by_path(REPO_ROOT / "kernels/moe/check_cases.py", "moe_check_cases")
kernel = cases.load_kernel()
reference = cases.load_reference()
# kernel.py and any candidate of the folder: every GPU test below runs each of them.
SOLUTIONS = ("kernel",)


@functools.cache
def solution_module(name: str):
    """A module of kernels/moe, imported from the package `cases.load_kernel` made of the folder."""
    return importlib.import_module(f"{kernel.__package__}.{name}")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------


def test_compiles_for_sm90a_without_gpu():
    # Every variant, the zeroing of new counter and walk buffers and the L2 partition probe, so that no call compiles
    # lazily.
    compiled = assert_compiles_and_caches(kernel.compile_only, len(kernel.VARIANTS) + 4)
    counters = solution_module("counters")
    zeroing = tuple(counters.compiled_zero("sm_90a", words) for words in (32, 512))
    assert compiled[len(kernel.VARIANTS) : len(kernel.VARIANTS) + 2] == zeroing
    assert compiled[-2:] == solution_module("l2_partitions").compiled_kernels("sm_90a")


# The two `mma.sync` GEMMs as separate kernels, GEMM1's grid routing: the forced variants' bit-for-bit reference.
CHAINED_MMA_SYNC = dataclasses.replace(kernel.FUSED_T, handover=kernel.Handover.CHAINED)


def test_variants_are_on_wgmma_from_33_tokens():
    streaming, wgmma_gemm1, wgmma_gemm2 = (
        solution_module(name) for name in ("streaming_gemm", "wgmma_gemm1", "wgmma_gemm2")
    )
    grouped = solution_module("grouped_wgmma")
    grouped_gemm2 = solution_module("grouped_gemm2")
    for num_tokens in (1, 7, 8, 9, 32, 33, 64, 65, 192, 193, 1024, 1025, 2048, 4097, 14107, kernel.MAX_TOKENS):
        variant = kernel.variant_for(num_tokens)
        on_wgmma = num_tokens >= kernel.WGMMA_GEMM1_MIN_TOKENS
        on_gathered_rows = num_tokens > kernel.MEDIUM_T_MAX_TOKENS
        assert (variant.engine is kernel.Engine.WGMMA) == on_wgmma
        gemm1_class = wgmma_gemm1.WgmmaGemm1 if on_wgmma else streaming.StreamingGemm
        gemm1_class = grouped.GroupedGemm1 if on_gathered_rows else gemm1_class
        gemm2_class = wgmma_gemm2.WgmmaGemm2 if on_wgmma else streaming.StreamingGemm
        gemm2_class = grouped_gemm2.GroupedGemm2 if on_gathered_rows else gemm2_class
        assert type(variant.make_gemm1()) is gemm1_class and type(variant.make_gemm2()) is gemm2_class
        # Every GEMM of every variant keeps two CTAs per SM, but GEMM1 from 193 to MEDIUM_T_MAX_TOKENS three,
        # fed by its producer warp and walking by partition rank, the grouped GEMMs one, and the streaming f16 GEMM2
        # above FEW_TOKENS_MAX three.
        three_ctas = kernel.FEW_TOKENS_MAX < num_tokens <= kernel.MEDIUM_T_MAX_TOKENS
        f16_gemm2 = num_tokens > kernel.FEW_TOKENS_MAX
        assert variant.gemm1().ctas_per_sm() == (3 if three_ctas else 1 if on_gathered_rows else 2)
        assert (variant.gemm1_feed is kernel.Gemm1Feed.PRODUCER_WARP) == variant.gemm1().partition_walk == three_ctas
        assert variant.gemm2().ctas_per_sm() == (1 if on_gathered_rows else 3 if f16_gemm2 else 2)
        assert (variant.gemm2_form is kernel.Gemm2Form.GROUPED) == on_gathered_rows
        assert variant.f16_c == variant.gemm2().f16_c == f16_gemm2
        # Up to MEDIUM_T_MAX_TOKENS GEMM1 routes the tokens itself; above, the routing is a grid of its own.
        assert (variant.routing is not kernel.Routing.ROUTING_GRID) == (num_tokens <= kernel.MEDIUM_T_MAX_TOKENS)
    assert kernel.WGMMA_GEMM1_MIN_TOKENS == 33
    # Up to FEW_TOKENS_MAX the WGMMA variant differs from the fused GEMMs' only in the engine, GEMM1's row tiles and the
    # hand-over.
    assert kernel.FEW_TOKENS == dataclasses.replace(
        kernel.FUSED_T, engine=kernel.Engine.WGMMA, block_tokens=16, handover=kernel.Handover.CHAINED
    )
    assert kernel.variant_for(kernel.FEW_TOKENS_MAX) is kernel.FEW_TOKENS
    assert kernel.variant_for(kernel.FEW_TOKENS_MAX + 1) is kernel.variant_for(kernel.MEDIUM_T_MAX_TOKENS) is kernel.MEDIUM_T
    # MEDIUM_T's GEMM1: 32-token tiles, 3 stages, the epilogue tile in a stage, fed by its producer warp, its
    # cooperative grid all resident (three CTAs per SM); its GEMM2 32-token tiles in 2 stages.
    medium_gemm1 = kernel.MEDIUM_T.gemm1()
    assert (medium_gemm1.block_tokens, medium_gemm1.num_stages, medium_gemm1.scratch_in_stage) == (32, 3, True)
    assert medium_gemm1.producer_warp
    assert medium_gemm1.grid(132) == 396 and kernel.MEDIUM_T.routing is kernel.Routing.GEMM1_GRID  # all resident
    medium_gemm2 = kernel.MEDIUM_T.gemm2()
    assert (medium_gemm2.block_tokens, medium_gemm2.num_stages) == (32, 2)
    assert len(set(kernel.VARIANTS)) == len(kernel.VARIANTS)  # each compiled configuration once


def test_the_grouped_gemms_on_gathered_rows_above_medium_t_max_tokens_only():
    grouped = solution_module("grouped_wgmma")
    gathered = kernel.Gemm1Feed.GATHERED_ROWS
    assert kernel.variant_for(kernel.MEDIUM_T_MAX_TOKENS + 1) is kernel.GROUPED_T
    assert kernel.variant_for(kernel.MAX_TOKENS) is kernel.GROUPED_T
    assert [v for v in kernel.VARIANTS if v.gemm1_feed is gathered] == [kernel.GROUPED_T]
    # GROUPED_T differs from MEDIUM_T in its routing grid and its GEMMs alone: C -> f16 and the combine are MEDIUM_T's.
    grouped_gemm2 = solution_module("grouped_gemm2")
    assert kernel.GROUPED_T == dataclasses.replace(
        kernel.MEDIUM_T,
        routing=kernel.Routing.ROUTING_GRID,
        block_tokens=grouped.TILE_M,
        num_stages=4,
        gemm2_block_tokens=grouped_gemm2.TILE_T,
        gemm2_num_stages=4,
        gemm1_feed=gathered,
        gemm1_scratch_in_stage=False,
        gemm2_form=kernel.Gemm2Form.GROUPED,
    )
    gemm1 = kernel.GROUPED_T.gemm1()
    assert isinstance(gemm1, grouped.GroupedGemm1Config) and gemm1.num_stages == 4 and gemm1.grid(132) == 132
    gemm2 = kernel.GROUPED_T.gemm2()
    assert isinstance(gemm2, grouped_gemm2.GroupedGemm2Config) and gemm2.num_stages == 4 and gemm2.f16_c
    assert kernel._grids(kernel.GROUPED_T, 132) == (132, 132)
    assert [v for v in kernel.VARIANTS if v.gemm2_form is kernel.Gemm2Form.GROUPED] == [kernel.GROUPED_T]
    with pytest.raises(ValueError, match="f16 C"):
        dataclasses.replace(kernel.GROUPED_T, f16_c=False)
    with pytest.raises(ValueError, match="128-token tiles"):
        dataclasses.replace(kernel.GROUPED_T, gemm2_block_tokens=32)
    # The chain: routing grid, row gather, GEMM1, C -> f16, GEMM2, combine; no kept buffer besides the counters.
    moe_host = kernel.GROUPED_T.make_host()
    chain = [moe_host.routing, moe_host.gather, moe_host.gemm1, moe_host.c_to_f16, moe_host.gemm2, moe_host.combine]
    links = " ".join(("W" if k.link.waits else "") + ("R" if k.link.releases else "") for k in chain)
    assert links == "R WR WR WR WR W"
    assert moe_host.kept_words() == () and not moe_host.routing_in_gemm1
    for variant in kernel.VARIANTS:
        if variant is not kernel.GROUPED_T and variant.handover is not kernel.Handover.FUSED:
            assert variant.make_host().gather is None
    with pytest.raises(ValueError, match="routing grid"):
        dataclasses.replace(kernel.GROUPED_T, routing=kernel.Routing.GEMM1_GRID)
    with pytest.raises(ValueError, match="128-row tiles"):
        dataclasses.replace(kernel.GROUPED_T, block_tokens=64)
    with pytest.raises(ValueError, match="WGMMA"):
        dataclasses.replace(CHAINED_MMA_SYNC, gemm1_feed=gathered)
    with pytest.raises(ValueError, match="GroupedGemm1"):
        solution_module("wgmma_gemm1").WgmmaGemm1Config(32, 3, feed=gathered)
    with pytest.raises(ValueError, match="routing kernel"):
        solution_module("host").MoeHostSm90(grouped.GroupedGemm1(gemm1), kernel.GROUPED_T.make_gemm2(), True)


def test_the_workspaces_hold_grouped_rows_for_the_row_gather_only():
    host = solution_module("host")
    meta = torch.device("meta")
    plain = host.Workspaces.allocate(5, meta)
    assert plain.a_rows is None and plain.a_rows_scale is None
    gathered = host.Workspaces.allocate(5, meta, gathered_rows=True)
    assert gathered.a_rows.shape == (40, 7168) and gathered.a_rows.dtype == torch.float8_e4m3fn
    assert gathered.a_rows_scale.shape == (56, 40) and gathered.a_rows_scale.dtype == torch.float32
    # 8 T rows: always a multiple of 4, as the scales' tensor map needs (its row stride a multiple of 16 bytes)
    assert all(8 * t % 4 == 0 for t in (1, 3, 4097, kernel.MAX_TOKENS))


def test_gemm2_weights_before_its_wait_up_to_the_threshold_only():
    for num_tokens in range(1, kernel.EARLY_W2_MAX_TOKENS + 1):
        chosen = kernel.variant_for(num_tokens)
        assert chosen is kernel.TINY_T_EARLY_W2 and chosen.gemm2().weights_before_wait
        assert not chosen.gemm1().weights_before_wait
    for num_tokens in (kernel.EARLY_W2_MAX_TOKENS + 1, 16, kernel.WGMMA_GEMM1_MIN_TOKENS - 1):
        assert kernel.variant_for(num_tokens) is kernel.FUSED_T
    for variant in kernel.VARIANTS[1:]:
        assert variant.handover is not kernel.Handover.EARLY_WEIGHTS and not variant.gemm2().weights_before_wait


def test_the_fused_gemms_from_5_to_32_tokens_only():
    # The fused GEMMs run from 5 to 32 tokens; the early-W2 variant keeps the tokens that every GEMM1 CTA routes
    # itself.
    for num_tokens in range(1, 34):
        assert (kernel.variant_for(num_tokens) is kernel.FUSED_T) == (5 <= num_tokens <= 32)
        assert (num_tokens <= kernel.EARLY_W2_MAX_TOKENS) == (num_tokens <= 4)
    fused = kernel.FUSED_T
    assert fused.handover is kernel.Handover.FUSED and fused in kernel.VARIANTS
    assert (fused.gemm1().block_tokens, fused.gemm1().num_stages) == (fused.gemm2().block_tokens, 4) == (8, 4)
    assert kernel._grids(fused, 132) == (264, 264)
    with pytest.raises(ValueError, match="WGMMA"):
        dataclasses.replace(kernel.FEW_TOKENS, handover=kernel.Handover.FUSED)
    with pytest.raises(ValueError, match="fused"):
        dataclasses.replace(kernel.FUSED_T, routing=kernel.Routing.EVERY_CTA)  # they meet after the routing


def test_three_gemm1_ctas_per_sm_with_the_producer_warp_only():
    # Only the WGMMA GEMM1 fed by its producer warp runs three CTAs per SM; its other feed keeps two even where three
    # would fit, and the `mma.sync` GEMM1 keeps two.
    wgmma_gemm1 = solution_module("wgmma_gemm1")
    assert wgmma_gemm1.WgmmaGemm1Config(32, 3, scratch_in_stage=True).ctas_per_sm() == 2
    assert kernel.MEDIUM_T.gemm1().ctas_per_sm() == 3
    with pytest.raises(ValueError, match="WGMMA"):
        dataclasses.replace(kernel.FUSED_T, gemm1_feed=kernel.Gemm1Feed.PRODUCER_WARP)


def test_every_gemm1_cta_routes_up_to_four_tokens_itself_in_the_early_w2_variant_only():
    # One token per warp of GEMM1's CTA: the early-W2 variant's whole range.
    routing = solution_module("routing")
    assert routing.ROUTING_WARPS == 4 == kernel.EARLY_W2_MAX_TOKENS
    assert kernel.TINY_T_EARLY_W2.routing is kernel.Routing.EVERY_CTA and kernel.TINY_T_EARLY_W2.gemm1().routing_per_cta
    for variant in kernel.VARIANTS[1:]:
        assert variant.routing is not kernel.Routing.EVERY_CTA and not variant.gemm1().routing_per_cta


def test_the_routing_in_every_cta_needs_the_mma_sync_gemm1():
    streaming = solution_module("streaming_gemm")
    with pytest.raises(ValueError, match="every CTA"):
        dataclasses.replace(kernel.FEW_TOKENS, routing=kernel.Routing.EVERY_CTA)
    with pytest.raises(streaming.StreamingConfigError, match="routing_per_cta"):
        streaming.StreamingGemmConfig(gemm1=False, block_tokens=8, num_stages=4, routing_per_cta=True)


def test_the_combine_loads_first_up_to_few_tokens_max_only():
    # Above FEW_TOKENS_MAX its registers cost occupancy where the combine's grid is large.
    for num_tokens in (1, kernel.EARLY_W2_MAX_TOKENS + 1, 33, kernel.FEW_TOKENS_MAX):
        assert kernel.variant_for(num_tokens).combine_loads_first
    for num_tokens in (kernel.FEW_TOKENS_MAX + 1, kernel.MEDIUM_T_MAX_TOKENS + 1, kernel.MAX_TOKENS):
        assert not kernel.variant_for(num_tokens).combine_loads_first


def test_gemm2_weights_before_its_wait_are_refused_where_nothing_completes_the_routed_count():
    streaming = solution_module("streaming_gemm")
    with pytest.raises(ValueError, match="route"):
        dataclasses.replace(kernel.TINY_T_EARLY_W2, routing=kernel.Routing.ROUTING_GRID)
    with pytest.raises(ValueError, match="chained"):
        dataclasses.replace(kernel.FEW_TOKENS, handover=kernel.Handover.EARLY_WEIGHTS)
    with pytest.raises(streaming.StreamingConfigError, match="GEMM2"):
        streaming.StreamingGemmConfig(True, 16, 4, weights_before_wait=True)


def test_the_wgmma_options_need_the_wgmma_engine():
    producer = kernel.Gemm1Feed.PRODUCER_WARP
    for option in (dict(f16_c=True), dict(gemm1_scratch_in_stage=True), dict(gemm1_feed=producer)):
        with pytest.raises(ValueError, match="WGMMA"):
            dataclasses.replace(CHAINED_MMA_SYNC, **option)
    with pytest.raises(ValueError, match="cooperative"):  # the producer warp's slot draw needs every CTA resident
        dataclasses.replace(kernel.MEDIUM_T, routing=kernel.Routing.ROUTING_GRID)


def test_the_host_routes_first_and_the_combine_releases_the_counters_last_in_one_chain():
    host = solution_module("host")
    gemm = solution_module("streaming_gemm").StreamingGemm(CHAINED_MMA_SYNC.gemm1())
    moe_host = host.MoeHostSm90(gemm, gemm)
    assert not hasattr(moe_host, "zero_counts")  # the counters come zeroed: no zeroing launch first
    assert not hasattr(moe_host, "release_counts")  # the combine zeroes them, no release kernel
    assert (moe_host.routing.link.waits, moe_host.routing.link.releases) == (False, True)  # first: never waits
    for middle in (moe_host.gemm1, moe_host.gemm2):
        assert (middle.link.waits, middle.link.releases) == (True, True)
    assert (moe_host.combine.link.waits, moe_host.combine.link.releases) == (True, False)  # last: releases nothing


def test_a_host_that_routes_in_gemm1_has_no_routing_kernel_and_gemm1_leads_the_chain():
    moe_host = CHAINED_MMA_SYNC.make_host()
    assert isinstance(moe_host, solution_module("host").MoeHostSm90) and moe_host.routing_in_gemm1
    assert not hasattr(moe_host, "routing") and not hasattr(moe_host, "release_counts")
    assert (moe_host.gemm1.link.waits, moe_host.gemm1.link.releases) == (False, True)  # first: never waits
    assert (moe_host.gemm2.link.waits, moe_host.gemm2.link.releases) == (True, True)
    assert (moe_host.combine.link.waits, moe_host.combine.link.releases) == (True, False)


@pytest.mark.parametrize(("num_kernels", "expected"), [(3, "R WR W"), (4, "R WR WR W")])
def test_a_chain_releases_from_every_kernel_but_the_last_and_waits_in_every_one_but_the_first(num_kernels, expected):
    chain = solution_module("chain")
    links = chain.chain_links(num_kernels)
    assert " ".join(("W" if link.waits else "") + ("R" if link.releases else "") for link in links) == expected
    assert chain.NO_CHAIN == chain.ChainLink(waits=False, releases=False)  # a plain launch (counters.py)


class _UnlinkableGemm:
    """An expert GEMM without `with_link`: it cannot join a chain of dependent launches."""

    def launch(self, a, a_scale, w, w_scale, out, counts, expert_tokens, grid, stream, routing=None) -> None:
        raise AssertionError("never launched")


def test_the_host_refuses_gemms_that_cannot_join_the_chain():
    host = solution_module("host")
    with pytest.raises(TypeError, match="with_link"):
        host.MoeHostSm90(_UnlinkableGemm(), _UnlinkableGemm())


def _meta_inputs(num_tokens: int = 3) -> tuple[dict, torch.Tensor]:
    """Inputs with the definition's shapes on the meta device (no memory): validation only."""
    meta = torch.device("meta")
    fp8 = torch.float8_e4m3fn
    inputs = {
        "routing_logits": torch.empty(num_tokens, 256, dtype=torch.float32, device=meta),
        "routing_bias": torch.empty(256, dtype=torch.bfloat16, device=meta),
        "hidden_states": torch.empty(num_tokens, 7168, dtype=fp8, device=meta),
        "hidden_states_scale": torch.empty(56, num_tokens, dtype=torch.float32, device=meta),
        "gemm1_weights": torch.empty(32, 4096, 7168, dtype=fp8, device=meta),
        "gemm1_weights_scale": torch.empty(32, 32, 56, dtype=torch.float32, device=meta),
        "gemm2_weights": torch.empty(32, 7168, 2048, dtype=fp8, device=meta),
        "gemm2_weights_scale": torch.empty(32, 56, 16, dtype=torch.float32, device=meta),
        "local_expert_offset": 32,
        "routed_scaling_factor": 2.5,
    }
    return inputs, torch.empty(num_tokens, 7168, dtype=torch.bfloat16, device=meta)


def test_run_rejects_untransposed_hidden_scales_with_one_line_error():
    inputs, output = _meta_inputs()
    inputs["hidden_states_scale"] = torch.empty(3, 56, dtype=torch.float32, device="meta")
    with pytest.raises(kernel.MoeShapeError, match="hidden_states_scale") as info:
        kernel.run(*inputs.values(), output)
    assert "\n" not in str(info.value)


def test_run_rejects_bf16_hidden_states():
    inputs, output = _meta_inputs()
    inputs["hidden_states"] = torch.empty(3, 7168, dtype=torch.bfloat16, device="meta")
    with pytest.raises(kernel.MoeShapeError, match="hidden_states"):
        kernel.run(*inputs.values(), output)


def test_run_rejects_wrong_output_shape_and_non_contiguous_weights():
    inputs, _ = _meta_inputs()
    with pytest.raises(kernel.MoeShapeError, match="output"):
        kernel.run(*inputs.values(), torch.empty(3, 2048, dtype=torch.bfloat16, device="meta"))
    inputs, output = _meta_inputs()
    inputs["gemm2_weights"] = torch.empty(32, 2048, 7168, dtype=torch.float8_e4m3fn, device="meta").transpose(1, 2)
    with pytest.raises(kernel.MoeShapeError, match="gemm2_weights"):
        kernel.run(*inputs.values(), output)


def test_run_rejects_too_many_tokens():
    inputs, output = _meta_inputs(kernel.MAX_TOKENS + 1)
    with pytest.raises(kernel.MoeShapeError, match="seq_len"):
        kernel.run(*inputs.values(), output)


def _routing_counts(pattern: str, offset: int, num_tokens: int = 512, seed: int = 0) -> torch.Tensor:
    """Local choices per token under the reference's routing, for logits and bias drawn like synth."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, 256, generator=generator)
    bias = (torch.randn(256, generator=generator) * 0.1).to(torch.bfloat16)
    cases.apply_routing_pattern(logits, offset, pattern)
    experts, weights = reference._route(logits, bias, cases.ROUTED_SCALING_FACTOR)
    local = (experts >= offset) & (experts < offset + 32)
    return experts, local


@pytest.mark.parametrize("offset", [0, 96, 224])
def test_routing_patterns_do_what_the_cases_claim(offset):
    experts, local = _routing_counts("one_expert", offset)
    assert bool((experts == offset + cases.SKEWED_LOCAL_EXPERT).any(dim=1).all())
    experts, local = _routing_counts("no_local", offset)
    assert int(local.sum()) == 0
    experts, local = _routing_counts("all_local", offset)
    assert bool(local.all())
    experts, local = _routing_counts("eight_local", offset)
    eight = torch.tensor([offset + e for e in cases.EIGHT_LOCAL_EXPERTS])
    assert torch.equal(experts.sort(dim=1).values, eight.expand_as(experts))
    experts, local = _routing_counts("zipf", offset)
    # A few hot local experts, many cold ones: the busiest holds >= 8x the local mean (10-27x measured).
    per_expert = torch.bincount(experts[local] - offset, minlength=32)
    assert 0 < int(local.sum()) and int(per_expert.max()) >= 8 * float(per_expert.float().mean())
    experts, local = _routing_counts("random", offset)
    # Untouched logits: a mix of tokens with and without local choices (the bias tilts the mean).
    per_token = local.sum(dim=1)
    assert bool((per_token == 0).any()) and bool((per_token > 0).any())


def test_grouped_counts_for_the_standalone_gemm_timings():
    generator = torch.Generator().manual_seed(0)
    assert cases.grouped_counts("skewed", 2048, generator) == [2048] * 8 + [0] * 24
    uniform = cases.grouped_counts("uniform", 2048, generator)
    mean = 2048 * 8 / 256
    assert len(uniform) == 32 and all(0.75 * mean - 1 <= count <= 1.25 * mean for count in uniform)


def test_compare_accepts_the_reference_and_rejects_a_small_systematic_error():
    generator = torch.Generator().manual_seed(1)
    ref = (torch.randn(4, 7168, generator=generator) * 10).to(torch.bfloat16)
    assert cases.compare(ref.clone(), ref).passed
    # 3 % too large everywhere passes the contest rule but not relative L2 <= 1e-2.
    scaled = (ref.float() * 1.03).to(torch.bfloat16)
    stats = cases.compare(scaled, ref)
    assert stats.matched_ratio == 1.0 and not stats.passed
    poisoned = ref.clone()
    poisoned[2, 5] = math.nan
    assert not cases.compare(poisoned, ref).passed
    # An all-zero reference (no local expert) demands an exactly zero output.
    zeros = torch.zeros(2, 7168, dtype=torch.bfloat16)
    assert cases.compare(zeros.clone(), zeros).passed
    almost = zeros.clone()
    almost[1, 1] = 1e-3
    assert not cases.compare(almost, zeros).passed


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


@pytest.fixture(params=SOLUTIONS)
def solution(request):
    return solution_module(request.param)


def _run_case(solution, case, seed: int):
    inputs = cases.make_inputs(case, "cuda", seed=seed)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    solution.run(*inputs.values(), output)
    torch.cuda.synchronize()
    return inputs, output


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", cases.CASES, ids=lambda c: c.name)
def test_matches_reference(solution, case):
    inputs, output = _run_case(solution, case, seed=zlib.crc32(case.name.encode()) % 1000)
    ref_output = reference.run(*inputs.values())
    stats = cases.compare(output, ref_output)
    assert stats.nan_count == 0, stats
    assert stats.passed, stats
    if case.pattern == "no_local":
        assert int(torch.count_nonzero(output)) == 0


@pytest.mark.gpu
@needs_cuda
def test_tokens_without_a_local_expert_get_exact_zero_rows(solution):
    case = cases.CheckCase("zero_rows", 80, 96)
    inputs, output = _run_case(solution, case, seed=5)
    experts, _ = reference._route(inputs["routing_logits"], inputs["routing_bias"], 2.5)
    has_local = ((experts >= 96) & (experts < 128)).any(dim=1)
    assert bool((~has_local).any()), "the draw should leave some tokens without a local expert"
    assert int(torch.count_nonzero(output[~has_local])) == 0
    assert bool((output[has_local].float().abs().sum(dim=1) > 0).all())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("repeat_t7", 7, 96),
        cases.CheckCase("repeat_t901", 901, 96, "all_local"),
        cases.CheckCase("repeat_t5000", 5000, 32),  # GROUPED_T
    ],
    ids=lambda c: c.name,
)
def test_repeated_calls_are_bitwise_identical(solution, case):
    # Ranks within an expert come from atomics, but no output depends on their order (and a
    # streaming path's split-K partial sums are added in a fixed order).
    inputs, first = _run_case(solution, case, seed=3)
    second = cases.poisoned_output(case.num_tokens, "cuda")
    solution.run(*inputs.values(), second)
    torch.cuda.synchronize()
    assert torch.equal(first, second)


@pytest.mark.gpu
@needs_cuda
# 512 tokens: MEDIUM_T, whose walk buffer made inside the capture has no L2-partition ranks and walks by SM id; 4097:
# GROUPED_T, whose grouped rows are allocated inside the capture
@pytest.mark.parametrize("num_tokens", [80, 512, 4097])
def test_cuda_graph_replay_follows_new_inputs(solution, num_tokens):
    case = cases.CheckCase("graph", num_tokens, 96)
    static = cases.make_inputs(case, "cuda", seed=1)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    fresh = cases.make_inputs(case, "cuda", seed=2)
    replay_on_fresh_inputs(lambda: solution.run(*static.values(), output), static, fresh, (output,))
    stats = cases.compare(output, reference.run(*fresh.values()))
    assert stats.passed, stats


@pytest.mark.gpu
@needs_cuda
# routed in GEMM1 (with GEMM2's early weights, without them, on warpgroup MMA, with the producer warp), by the routing
# grid (the grouped GEMM1 copies the counts out)
@pytest.mark.parametrize("num_tokens", [1, 7, 58, kernel.MEDIUM_T_MAX_TOKENS, kernel.MEDIUM_T_MAX_TOKENS + 1])
def test_clean_counters_leave_the_kept_buffer_at_zero_and_copy_each_calls_counts_out(num_tokens):
    counters = solution_module("counters")
    case = cases.CheckCase("kept_counts", num_tokens, 96)
    for seed in (1, 2):  # the second call must start from the zeros the first one left
        inputs = cases.make_inputs(case, "cuda", seed=seed)
        output = cases.poisoned_output(case.num_tokens, "cuda")
        workspaces = kernel.run_keeping_workspaces(*inputs.values(), output)
        torch.cuda.synchronize()
        kept = counters.kept_counts(torch.device("cuda"), kernel.GPU_ARCH)
        assert int(kept.abs().sum()) == 0
        routed = counters.kept_routed(torch.device("cuda"), kernel.GPU_ARCH)  # GEMM1's meeting count
        assert int(routed.abs().sum()) == 0
        experts, _ = reference._route(
            inputs["routing_logits"], inputs["routing_bias"], float(inputs["routed_scaling_factor"])
        )
        local = experts - int(inputs["local_expert_offset"])
        assert workspaces.counts.tolist() == [int((local == e).any(dim=1).sum()) for e in range(32)]
        assert cases.compare(output, reference.run(*inputs.values())).passed


def _tied(inputs: dict, case, seed: int) -> dict:
    """Logits in {-2, ..., 2} and a bias in {0, 0.25, 0.5} (then the case's routing pattern): most biased scores
    equal several others, so the group ranking and the picks are decided by the tie rules."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    logits = inputs["routing_logits"]
    logits.copy_(torch.randint(-2, 3, logits.shape, generator=generator, device="cuda").to(logits.dtype))
    bias = inputs["routing_bias"]
    bias.copy_((torch.randint(0, 3, bias.shape, generator=generator, device="cuda") * 0.25).to(bias.dtype))
    cases.apply_routing_pattern(logits, case.local_expert_offset, case.pattern)
    return inputs


def routing_grid_counterpart(num_tokens: int):
    """`kernel.py`'s variant for T with the routing as a grid of its own: GEMM2 chained (its early weights wait on the
    routed count that only a GEMM1 that routes completes, and the fused GEMMs meet after the routing) and the WGMMA
    GEMM1 fed by its warpgroup (the producer warp's walk needs GEMM1's cooperative grid)."""
    return dataclasses.replace(
        kernel.variant_for(num_tokens),
        routing=kernel.Routing.ROUTING_GRID,
        handover=kernel.Handover.CHAINED,
        gemm1_feed=kernel.Gemm1Feed.WARPGROUP,
    )


def test_every_routing_grid_counterpart_is_a_valid_variant():
    # On the CPU what the GPU test below builds for each T (a variant that raises there would fail a full run).
    for num_tokens in range(1, kernel.MEDIUM_T_MAX_TOKENS + 1):
        counterpart = routing_grid_counterpart(num_tokens)
        assert not counterpart.make_host().routing_in_gemm1 and counterpart.handover is kernel.Handover.CHAINED


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tied", [False, True], ids=["random", "tied"])
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("in_gemm1_t1", 1, 0),  # routed in every CTA
        cases.CheckCase("in_gemm1_t4_all_local", 4, 224, "all_local"),  # likewise, one token per warp
        cases.CheckCase("in_gemm1_t16_one_expert", 16, 96, "one_expert"),
        cases.CheckCase("in_gemm1_t61_no_local", 61, 32, "no_local"),
        cases.CheckCase("in_gemm1_t193", 193, 160),
        cases.CheckCase("in_gemm1_t1024_all_local", 1024, 64, "all_local"),
    ],
    ids=lambda c: c.name,
)
def test_routing_in_gemm1_equals_the_routing_grid_bit_for_bit(case, tied):
    # The same `route_token` in GEMM1's cooperative grid (then the CTAs meet) and in a grid of its own (then the
    # launch boundary): the same workspaces and output; a CTA that read the counts or lists before every token
    # was routed would break them. Three calls, so that the kept meeting count must come back to zero.
    routing = solution_module("routing")
    inputs = cases.make_inputs(case, "cuda", seed=29)
    if tied:
        inputs = _tied(inputs, case, seed=case.num_tokens)

    results = []
    for choose in (routing_grid_counterpart, kernel.variant_for, kernel.variant_for):
        output = cases.poisoned_output(case.num_tokens, "cuda")
        workspaces = kernel.run_keeping_workspaces(*inputs.values(), output, choose=choose)
        torch.cuda.synchronize()
        results.append((workspaces, output))
    (grid, grid_output), *in_gemm1 = results
    for ours, output in in_gemm1:
        assert torch.equal(ours.counts, grid.counts)
        assert torch.equal(ours.slot_expert, grid.slot_expert)
        assert torch.equal(ours.slot_weight, grid.slot_weight)
        for expert, count in enumerate(ours.counts.tolist()):  # ranks come from atomics: compare the sets
            listed = ours.expert_tokens[expert, :count]
            assert torch.equal(listed.sort().values, grid.expert_tokens[expert, :count].sort().values)
            if case.num_tokens <= routing.ROUTING_WARPS:  # routed in every CTA: ranked in token order
                assert listed.tolist() == sorted(listed.tolist())
        tokens = torch.arange(case.num_tokens, device="cuda")[:, None].expand_as(ours.slot_expert)
        local = ours.slot_expert >= 0
        assert torch.equal(ours.expert_tokens[ours.slot_expert[local], ours.slot_rank[local]], tokens[local].int())
        assert not torch.isnan(output).any() and torch.equal(output, grid_output)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", cases.LARGE_CASES, ids=lambda c: c.name)
def test_grouped_gemm1_variant_matches_reference(case):
    # GROUPED_T (forced) on every large case; its workspaces' routing lists and counts are the routing grid's, and
    # `counts` is the copy the grouped GEMM1's CTA 0 makes.
    inputs = cases.make_inputs(case, "cuda", seed=zlib.crc32(case.name.encode()) % 1000)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    workspaces = kernel.run_keeping_workspaces(*inputs.values(), output, choose=lambda _: kernel.GROUPED_T)
    torch.cuda.synchronize()
    experts, _ = reference._route(
        inputs["routing_logits"], inputs["routing_bias"], float(inputs["routed_scaling_factor"])
    )
    local = experts - int(inputs["local_expert_offset"])
    assert workspaces.counts.tolist() == [int((local == e).any(dim=1).sum()) for e in range(32)]
    stats = cases.compare(output, reference.run(*inputs.values()))
    assert stats.nan_count == 0 and stats.passed, stats
    if case.pattern == "no_local":
        assert int(torch.count_nonzero(output)) == 0
