"""MoE candidate v2.25 (kernels/moe/candidate_combine_loads_first.py): up to FEW_TOKENS_MAX tokens the combine issues all
of a thread's loads before it uses one.

CPU: the dispatch and the compile. GPU (marked `gpu`): the output bit for bit kernel.py's at 1-2049 tokens in every
routing pattern (every variant, both routings), two calls in a row. The end-to-end checks against the reference and
graph replay are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.compile_checks import assert_compiles_and_caches
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module

candidate = solution_module("candidate_combine_loads_first")


def test_the_loads_first_up_to_few_tokens_max_only():
    for num_tokens in (1, 6, 7, 32, 33, kernel.FEW_TOKENS_MAX):
        chosen = candidate.variant_for(num_tokens)
        assert chosen.combine_loads_first
        assert dataclasses.replace(chosen, combine_loads_first=False) == kernel.variant_for(num_tokens)
    for num_tokens in (kernel.FEW_TOKENS_MAX + 1, 901, 1025, 14107):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    assert not any(variant.combine_loads_first for variant in kernel.VARIANTS)


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(candidate.compile_only, len(kernel.VARIANTS) + 1)


LOADS_FIRST_CASES = [
    cases.CheckCase("loads_first_t1", 1, 0),
    cases.CheckCase("loads_first_t3_all_local", 3, 32, "all_local"),
    cases.CheckCase("loads_first_t7", 7, 224),
    cases.CheckCase("loads_first_t16_one_expert", 16, 96, "one_expert"),
    cases.CheckCase("loads_first_t5_no_local", 5, 160, "no_local"),
    cases.CheckCase("loads_first_t61", 61, 64),
    cases.CheckCase("loads_first_t192_all_local", 192, 96, "all_local"),
    cases.CheckCase("loads_first_t901", 901, 128),
    cases.CheckCase("loads_first_t1025_all_local", 1025, 0, "all_local"),
    cases.CheckCase("loads_first_t2049_one_expert", 2049, 192, "one_expert"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", LOADS_FIRST_CASES, ids=lambda c: c.name)
def test_output_is_kernel_py_bit_for_bit(case):
    inputs = cases.make_inputs(case, "cuda", seed=46)
    outputs = []
    for run in (kernel.run, candidate.run, candidate.run):
        output = cases.poisoned_output(case.num_tokens, "cuda")
        run(*inputs.values(), output)
        torch.cuda.synchronize()
        outputs.append(output)
    theirs, *ours = outputs
    for output in ours:
        assert not torch.isnan(output).any()
        # bit for bit, signed zeros included (the same FMAs in the same slot order)
        assert torch.equal(output.view(torch.int16), theirs.view(torch.int16))
