"""kernel.py's fused GEMMs (kernels/moe/fused_gemms.py): both expert GEMMs in one cooperative kernel from 5 to
32 tokens. CPU: the kernel's guards, its shared memory (two CTAs per SM, every CTA resident), the compile. GPU (marked
`gpu`): the output bit for bit the two chained streaming GEMMs' (forced) at 5-32 tokens in every routing
pattern, call after call (so the kept counters and the claim word come back to zero), beyond 8 tokens per expert
(several row tiles per expert), and a CUDA-graph replay against the reference. The end-to-end checks are
test_moe_kernel.py's (kernel.py's `run` takes this kernel from 5 to 32 tokens).
"""

from __future__ import annotations

import dataclasses

import pytest

from hopperbench.devcheck import replay_on_fresh_inputs
from tests.kernels.test_moe_kernel import CHAINED_MMA_SYNC, cases, kernel, needs_cuda, reference, solution_module
from tests.kernels.test_moe_streaming import assert_bit_for_bit

fused_gemms = solution_module("fused_gemms")
streaming = solution_module("streaming_gemm")
chain = solution_module("chain")


def test_every_cta_is_resident_at_two_per_sm():
    gemms = kernel.FUSED_T.make_host().gemms
    assert gemms.cfg.ctas_per_sm() == 2 and gemms.cfg.grid(132) == 264
    assert kernel._grids(kernel.FUSED_T, 132) == (264, 264)
    # GEMM2's rings hold GEMM1's: the same stage layouts, its bf16 activation ring twice GEMM1's fp8 one.
    fields1, fields2 = kernel.FUSED_T.gemm1().fields(), gemms.cfg.fields()
    assert set(fields1) < set(fields2) and gemms.cfg.smem_bytes() >= kernel.FUSED_T.gemm1().smem_bytes()
    assert (gemms.link.waits, gemms.link.releases) == (False, True)  # the call's first kernel


def test_the_fused_kernel_takes_a_gemm1_that_meets_and_a_gemm2_of_one_tile():
    link = chain.chain_links(2)[0]
    gemm1, gemm2 = kernel.FUSED_T.make_gemm1(), kernel.FUSED_T.make_gemm2()
    early = dataclasses.replace(kernel.TINY_T_EARLY_W2, block_tokens=8)
    with pytest.raises(streaming.StreamingConfigError, match="meets"):
        fused_gemms.FusedExpertGemms(gemm1, early.make_gemm2(), link)  # its weights before a wait
    with pytest.raises(streaming.StreamingConfigError, match="meets"):
        fused_gemms.FusedExpertGemms(early.make_gemm1(), gemm2, link)  # routing in every CTA, no meeting
    with pytest.raises(streaming.StreamingConfigError, match="row tiles"):
        sixteen = streaming.StreamingGemmConfig(gemm1=True, block_tokens=16, num_stages=4)
        fused_gemms.FusedExpertGemms(streaming.StreamingGemm(sixteen), gemm2, link)
    with pytest.raises(streaming.StreamingConfigError, match="row tiles"):
        three_stages = streaming.StreamingGemmConfig(gemm1=True, block_tokens=8, num_stages=3)
        fused_gemms.FusedExpertGemms(streaming.StreamingGemm(three_stages), gemm2, link)


def test_compiles_without_gpu():
    assert kernel.compiled_for(kernel.FUSED_T, "sm_90a") is kernel.compiled_for(kernel.FUSED_T, "sm_90a")


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
def test_outputs_are_the_chained_gemms_bit_for_bit(case):
    assert kernel.variant_for(case.num_tokens) is kernel.FUSED_T
    chained = kernel.make_run(lambda _: CHAINED_MMA_SYNC)
    assert_bit_for_bit((chained, kernel.run, kernel.run, kernel.run), case, seed=157)


@pytest.mark.gpu
@needs_cuda
def test_fused_beyond_its_range_is_the_chained_gemms_bit_for_bit():
    # 33 and 64 tokens: more row tiles per expert than the dispatch gives it.
    fused = kernel.make_run(lambda _: kernel.FUSED_T)
    chained = kernel.make_run(lambda _: CHAINED_MMA_SYNC)
    for case in (cases.CheckCase("t33", 33, 96), cases.CheckCase("t64_one_expert", 64, 0, "one_expert")):
        assert_bit_for_bit((chained, fused, fused), case, seed=158)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_follows_new_inputs():
    case = cases.CheckCase("graph", 7, 192)
    static = cases.make_inputs(case, "cuda", seed=1)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    fresh = cases.make_inputs(case, "cuda", seed=2)
    replay_on_fresh_inputs(lambda: kernel.run(*static.values(), output), static, fresh, (output,))
    stats = cases.compare(output, reference.run(*fresh.values()))
    assert stats.passed, stats
