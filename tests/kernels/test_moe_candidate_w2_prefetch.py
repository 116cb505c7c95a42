"""MoE candidate v2.5 (kernels/moe/candidate_w2_prefetch.py): the `mma.sync` GEMM1 prefetches W2 into L2
(and, in one entry, the routing issues its loads first).
CPU: the dispatch (only TINY_T changes), the prefetch settings' checks, and that kernel.py's variants
compile as before (no W2 argument unless a GEMM1 prefetches). GPU (marked `gpu`): all three entries' outputs
equal kernel.py's bit for bit wherever TINY_T runs (a prefetch moves no data into the computation), on
fresh inputs, for random, one-expert, all-local and no-local routing. The end-to-end checks against the
reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hopperbench.devcheck import replay_on_fresh_inputs
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, reference, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_w2_prefetch")
streaming = solution_module("streaming_gemm")


def test_only_tiny_batches_change():
    for num_tokens in (33, 80, 192, 193, 901, 14107, kernel.MAX_TOKENS):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
        assert candidate.variant_for(num_tokens, candidate.LATE) is kernel.variant_for(num_tokens)
    for num_tokens in (1, 7, 16, 32):
        assert kernel.variant_for(num_tokens) is kernel.TINY_T
        early, late = candidate.variant_for(num_tokens), candidate.variant_for(num_tokens, candidate.LATE)
        loads_first = candidate.variant_for(num_tokens, candidate.LOADS_FIRST)
        assert (early.w2_prefetch.early, late.w2_prefetch.early) == (True, False)
        # Only the prefetch (and the routing's load order) differ from TINY_T.
        assert dataclasses.replace(early, w2_prefetch=None) == kernel.TINY_T
        assert dataclasses.replace(late, w2_prefetch=None) == kernel.TINY_T
        assert dataclasses.replace(loads_first, routing_loads_first=False) == early
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)


def test_prefetch_settings_are_checked():
    with pytest.raises(streaming.StreamingConfigError):
        streaming.W2Prefetch(streaming.W2_CHUNK_BYTES + 16, early=True)
    with pytest.raises(streaming.StreamingConfigError):
        streaming.W2Prefetch(0, early=True)
    prefetch = streaming.W2Prefetch(4 * streaming.W2_CHUNK_BYTES, early=False)
    assert prefetch.budget_chunks == 4
    # 896 chunks of 8 rows cover an expert's 7168 W2 rows once.
    assert streaming.W2_CHUNKS_PER_EXPERT * streaming.W2_CHUNK_ROWS == 7168
    with pytest.raises(streaming.StreamingConfigError):
        streaming.StreamingGemmConfig(gemm1=False, block_tokens=8, num_stages=4, w2_prefetch=prefetch)
    with pytest.raises(ValueError):
        dataclasses.replace(kernel.FEW_TOKENS, w2_prefetch=prefetch)  # the WGMMA GEMM1 has no prefetch


def test_compiles_without_gpu():
    compiled = candidate.compile_only("sm_90a")
    assert len(compiled) == len(kernel.VARIANTS) + 1 + len(candidate.VARIANTS)
    assert all(callable(fn) for fn in compiled)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("t1_off0", 1, 0),
        cases.CheckCase("t7_off224", 7, 224),
        cases.CheckCase("t16_off32", 16, 32),
        cases.CheckCase("t32_off0_one_expert", 32, 0, "one_expert"),
        cases.CheckCase("t5_off96_all_local", 5, 96, "all_local"),
        cases.CheckCase("t3_off0_no_local", 3, 0, "no_local"),
    ],
    ids=lambda case: case.name,
)
def test_outputs_are_kernel_py_bit_for_bit(case):
    runs = (kernel.run, candidate.run, candidate.run_late, candidate.run_loads_first)
    outputs = outputs_of(runs, case, seed=41)
    assert torch.isfinite(outputs[0]).all()
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_follows_new_inputs_below_33_tokens():
    # test_moe_kernel.py's graph test runs 80 tokens, where this module is kernel.py.
    case = cases.CheckCase("graph_tiny", 7, 96)
    static = cases.make_inputs(case, "cuda", seed=1)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    fresh = cases.make_inputs(case, "cuda", seed=2)
    replay_on_fresh_inputs(lambda: candidate.run_loads_first(*static.values(), output), static, fresh, (output,))
    stats = cases.compare(output, reference.run(*fresh.values()))
    assert stats.passed, stats
