"""MoE candidate v2.57 (kernels/moe/candidate_fused_gemms.py): both expert GEMMs in one cooperative kernel from 5 to 32
tokens. CPU: the dispatch, the shared memory (two CTAs per SM, every CTA resident), the compile. GPU (marked `gpu`):
the output bit for bit kernel.py's at 5-32 tokens in every routing pattern, call after call (so the kept counters and
the claim word come back to zero), beyond 8 tokens per expert (several row tiles per expert), and a CUDA-graph replay
against the reference. The end-to-end checks are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import pytest

from hopperbench.devcheck import replay_on_fresh_inputs
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, reference, solution_module
from tests.kernels.test_moe_streaming import assert_bit_for_bit

candidate = solution_module("candidate_fused_gemms")


def test_fused_from_5_to_32_tokens():
    for num_tokens in (1, 4, 33, 192, 901, 11948):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (5, 7, 8, 14, 32):
        assert candidate.variant_for(num_tokens) is candidate.FUSED
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_every_cta_is_resident_at_two_per_sm():
    cfg = candidate.FusedExpertGemms(candidate.chain_links(2)[0]).cfg
    assert cfg.ctas_per_sm() == 2 and candidate.grid_ctas(132) == 264
    assert cfg.dynamic_items and cfg.block_tokens == candidate.ROW_TILE_TOKENS


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 1


FUSED_BITWISE_CASES = (
    cases.CheckCase("t5", 5, 32),
    cases.CheckCase("t7", 7, 192),
    cases.CheckCase("t7_off0", 7, 0),
    cases.CheckCase("t8_all_local", 8, 64, "all_local"),
    cases.CheckCase("t14", 14, 0),
    cases.CheckCase("t16_one_expert", 16, 224, "one_expert"),  # two row tiles of one expert
    cases.CheckCase("t24_no_local", 24, 96, "no_local"),
    cases.CheckCase("t32_one_expert", 32, 32, "one_expert"),  # four row tiles of one expert
    cases.CheckCase("t32_all_local", 32, 160, "all_local"),
)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", FUSED_BITWISE_CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_bit_for_bit(case):
    assert_bit_for_bit((kernel.run, candidate.run, candidate.run, candidate.run), case, seed=157)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_follows_new_inputs():
    case = cases.CheckCase("graph", 7, 192)
    static = cases.make_inputs(case, "cuda", seed=1)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    fresh = cases.make_inputs(case, "cuda", seed=2)
    replay_on_fresh_inputs(lambda: candidate.run(*static.values(), output), static, fresh, (output,))
    stats = cases.compare(output, reference.run(*fresh.values()))
    assert stats.passed, stats
