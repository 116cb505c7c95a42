"""DSA candidate v1.7 (kernels/dsa_attention/candidate_staged_indices.py): the split's row ids staged in shared
memory. CPU: it compiles for sm_90a and leaves `kernel.py`'s compiled function alone. GPU (marked `gpu`): its
output and lse equal `kernel.py`'s bit for bit (the same arithmetic in the same order) at 1-8 tokens for every
padding pattern and at every split count; the reference checks are test_dsa_attention_kernel.py's (SOLUTIONS).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.kernels.test_dsa_attention_kernel import cases, kernel, needs_cuda, solution_module

candidate = solution_module("candidate_staged_indices")


def test_compiles_apart_from_kernel_py_and_is_cached():
    compiled = candidate.compile_only("sm_90a")
    assert compiled is candidate.compile_only("sm_90a")
    assert compiled is not kernel.compile_only("sm_90a")


def test_only_the_candidate_stages_the_row_ids():
    assert not kernel._SplitKernel.STAGED_INDICES
    assert candidate._StagedIndicesSplitKernel.STAGED_INDICES


def _both(case: cases.CheckCase, num_splits: int | None):
    inputs = cases.make_inputs(case, "cuda", seed=zlib.crc32(case.name.encode()) % 1000)
    results = []
    for run_with_splits in (kernel.run_with_splits, candidate.run_with_splits):
        output, lse = cases.poisoned_outputs(case.num_tokens, "cuda")
        run_with_splits(*inputs.values(), output, lse, num_splits)
        results.append((output, lse))
    return results


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("staged_t1", 1, 300, "random"),
        cases.CheckCase("staged_t2_ragged_tail", 2, 300, "ragged_tail"),
        cases.CheckCase("staged_t6_shared_pages", 6, 300, "shared_pages"),
        cases.CheckCase("staged_t7_one_valid", 7, 300, "one_valid"),
        cases.CheckCase("staged_t8_contest_pages", 8, cases.CONTEST_NUM_PAGES, "random"),
        cases.CheckCase("staged_t8_scattered_padding", 8, 300, "scattered_padding"),
        cases.CheckCase("staged_t8_all_padding", 8, 300, "all_padding"),
    ],
    ids=lambda c: c.name,
)
def test_bit_for_bit_kernel_py(case):
    (out_k, lse_k), (out_c, lse_c) = _both(case, None)
    assert not torch.isnan(out_c.float()).any() and not torch.isnan(lse_c).any()
    assert torch.equal(out_c, out_k)
    assert torch.equal(lse_c, lse_k)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", kernel.VALID_SPLITS)
def test_bit_for_bit_kernel_py_at_every_split_count(num_splits):
    # 1 split stages all 2048 row ids of a token; 32 splits 64 each.
    (out_k, lse_k), (out_c, lse_c) = _both(cases.CheckCase(f"staged_splits_{num_splits}", 9, 300, "ragged_tail"), num_splits)
    assert not torch.isnan(out_c.float()).any()
    assert torch.equal(out_c, out_k)
    assert torch.equal(lse_c, lse_k)
