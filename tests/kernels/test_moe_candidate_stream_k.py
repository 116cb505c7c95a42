"""MoE candidate v2.17 (kernels/moe/candidate_stream_k.py): below 33 tokens both `mma.sync` GEMMs walk stream-K
ranges of flat (item, K stage) steps, and each cut item is finished by its last piece.

CPU: the dispatch, the configuration guards, the compile; the range / owner / slot arithmetic the kernel runs
(every step once, balanced ranges, the pieces of every item and their distinct workspace slots) for the walks of
the official shapes and for small and odd grids. GPU (marked `gpu`): each GEMM against torch on its packed rows,
the output equal to kernel.py's up to fp32 rounding and deterministic, the arrival counters back at zero after
every call, in every routing pattern, on the persistent grid and on grids of 7, 100 and 263 CTAs (other cuts,
three pieces per item included). The end-to-end checks against the reference are test_moe_kernel.py's (the
module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.compile_checks import assert_compiles_and_caches
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import check_each_gemm

candidate = solution_module("candidate_stream_k")
streaming = solution_module("streaming_gemm")
host = solution_module("host")
counters = solution_module("counters")


# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------


def test_streams_k_below_33_tokens_only():
    for num_tokens in (1, 7, 16, 32):
        chosen = candidate.variant_for(num_tokens)
        assert chosen.stream_k and chosen.gemm1().stream_k and chosen.gemm2().stream_k
        assert dataclasses.replace(chosen, stream_k=False) == kernel.variant_for(num_tokens)
    for num_tokens in (33, 192, 901, 14107):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_stream_k_is_refused_where_it_is_not_built():
    with pytest.raises(ValueError, match="mma.sync"):
        dataclasses.replace(kernel.FEW_TOKENS, stream_k=True)
    with pytest.raises(streaming.StreamingConfigError, match="partials row"):
        streaming.StreamingGemmConfig(True, 32, 4, stream_k=True)
    variant = candidate.TINY_T_STREAM_K
    with pytest.raises(ValueError, match="route in GEMM1"):
        host.MoeHostSm90(variant.make_gemm1(), variant.make_gemm2(), routing_in_gemm1=False, stream_k=True)
    with pytest.raises(ValueError, match="arrival counters"):
        host.Workspaces.allocate(1, "cpu", streaming.MAX_SPLIT_CTAS + 1)


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(candidate.compile_only, len(kernel.VARIANTS) + 2)


def _walks() -> list[tuple[int, int, int]]:
    """(steps, K stages per item, grid): the official shapes' walks (1-8 experts of one row tile, the GEMM1 and the
    GEMM2 item counts, 264 CTAs) and small, odd and large grids."""
    walks = []
    for row_tiles in (1, 2, 3, 5, 7, 8, 12, 48):
        for items, k in ((128 * row_tiles, 14), (224 * row_tiles, 4)):
            for grid in (7, 100, 263, 264, 1024):
                if items * k >= grid:
                    walks.append((items * k, k, grid))
    return walks


@pytest.mark.parametrize(("total_steps", "k", "grid"), _walks())
def test_ranges_cover_every_step_once_and_every_cut_item_has_distinct_slots(total_steps, k, grid):
    starts = [streaming.stream_k_start(cta, grid, total_steps) for cta in range(grid + 1)]
    assert starts[0] == 0 and starts[-1] == total_steps
    lengths = [starts[c + 1] - starts[c] for c in range(grid)]
    assert min(lengths) >= 1 and max(lengths) - min(lengths) <= 1
    # The kernel's int32 products stay in range at the largest walk below 33 tokens.
    assert grid * total_steps < 2**31
    owner_of = [c for c in range(grid) for _ in range(lengths[c])]
    slots_used: dict[int, tuple[int, int]] = {}
    for item in range(total_steps // k):
        first = streaming.stream_k_owner(item * k, grid, total_steps)
        last = streaming.stream_k_owner(item * k + k - 1, grid, total_steps)
        assert (first, last) == (owner_of[item * k], owner_of[item * k + k - 1])
        if first == last:
            continue  # whole: the epilogue, no slot
        # Every CTA from the first owner to the last holds a piece (so `last - first + 1` pieces arrive).
        assert all(starts[c] < item * k + k and starts[c + 1] > item * k for c in range(first, last + 1))
        for cta in range(first, last + 1):
            slot = streaming.partial_slot(cta, first)
            assert slot // 2 == cta and slot not in slots_used, (slot, slots_used.get(slot))
            slots_used[slot] = (item, cta)
            # the first owner's piece starts the item and ends its range; every other piece starts its range
            assert (slot % 2 == 1) == (cta == first)
            if cta == first:
                assert starts[cta] <= item * k and starts[cta + 1] < item * k + k
            else:
                assert item * k < starts[cta]


def test_partials_rows_hold_every_stream_k_piece():
    for gemm1 in (True, False):
        config = candidate.TINY_T_STREAM_K.gemm1() if gemm1 else candidate.TINY_T_STREAM_K.gemm2()
        assert config.accumulators_per_thread() * streaming.NUM_THREADS <= streaming.PARTIAL_ROW


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

STREAM_K_CASES = [
    cases.CheckCase("stream_k_t1", 1, 0),
    cases.CheckCase("stream_k_t1_one_expert", 1, 64, "one_expert"),
    cases.CheckCase("stream_k_t7", 7, 224),
    cases.CheckCase("stream_k_t13_all_local", 13, 32, "all_local"),
    cases.CheckCase("stream_k_t16_one_expert", 16, 96, "one_expert"),
    cases.CheckCase("stream_k_t32", 32, 128),
    cases.CheckCase("stream_k_t32_all_local", 32, 0, "all_local"),
    cases.CheckCase("stream_k_t5_no_local", 5, 160, "no_local"),
]


def _arrivals_are_zero() -> bool:
    return int(counters.kept_arrivals(torch.device("cuda"), kernel.GPU_ARCH).abs().sum()) == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", [c for c in STREAM_K_CASES if c.pattern != "no_local"], ids=lambda c: c.name)
def test_each_gemm_matches_torch_on_its_packed_rows(case):
    check_each_gemm(case, candidate.variant_for)
    assert _arrivals_are_zero()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("grids", [None, (7, 7), (100, 100), (263, 263)], ids=lambda g: f"grid{g[0]}" if g else "persistent")
@pytest.mark.parametrize("case", STREAM_K_CASES, ids=lambda c: c.name)
def test_output_is_kernel_py_up_to_rounding_and_deterministic(case, grids):
    inputs = cases.make_inputs(case, "cuda", seed=31)
    outputs = []
    for choose, call_grids in ((kernel.variant_for, None), (candidate.variant_for, grids), (candidate.variant_for, grids)):
        output = cases.poisoned_output(case.num_tokens, "cuda")
        kernel.run_keeping_workspaces(*inputs.values(), output, choose=choose, grids=call_grids)
        torch.cuda.synchronize()
        assert not torch.isnan(output).any() and not torch.isinf(output).any()
        if choose is candidate.variant_for:
            assert _arrivals_are_zero(), "every cut item's last piece resets its arrival counter"
        outputs.append(output)
    theirs, ours, ours_again = outputs
    assert torch.equal(ours, ours_again), "the pieces are summed in CTA order whoever arrives last"
    difference = (ours.float() - theirs.float()).norm() / theirs.float().norm().clamp_min(1e-30)
    assert difference < 1e-3, f"relative L2 against kernel.py {difference:.2e}"
    if case.pattern == "no_local":
        assert not ours.any()
