"""DSA candidates of session 17 that must equal `kernel.py` bit for bit (NOTES.md): v1.7b
(kernels/dsa_attention/candidate_staged_indices.py: the split's row ids staged in shared memory where a split has two
or more chunks) and v1.8 (candidate_combine_loads_first.py: v1.7b plus a combine that loads its partials first).
CPU: they compile for sm_90a apart from `kernel.py`, and the dispatch keeps `kernel.py`'s split kernel at one chunk
per split. GPU (marked `gpu`): output and lse equal `kernel.py`'s bit for bit (the same arithmetic in the same
order) at 1-9 tokens for every padding pattern and at every split count; the reference checks are
test_dsa_attention_kernel.py's (SOLUTIONS).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.kernels.test_dsa_attention_kernel import cases, kernel, needs_cuda, solution_module

CANDIDATES = ("candidate_staged_indices", "candidate_combine_loads_first")
staged = solution_module("candidate_staged_indices")
loads_first = solution_module("candidate_combine_loads_first")


def test_candidates_compile_apart_from_kernel_py_and_are_cached():
    kernel_fn = kernel.compile_only("sm_90a")
    assert staged.compile_only("sm_90a") is staged.compile_only("sm_90a") is not kernel_fn
    two = loads_first.compile_only("sm_90a")
    assert len({id(fn) for fn in two}) == 2 and kernel_fn not in two
    assert loads_first.compile_only("sm_90a") == two


def test_only_the_candidates_flip_the_switches():
    assert not kernel._SplitKernel.STAGED_INDICES and not kernel._CombineKernel.LOADS_FIRST
    assert staged._StagedIndicesSplitKernel.STAGED_INDICES
    assert loads_first._LoadsFirstCombineKernel.LOADS_FIRST


@pytest.mark.parametrize("num_splits", kernel.VALID_SPLITS)
def test_staging_only_where_a_split_has_two_or_more_chunks(num_splits):
    split = staged.split_kernel_for(num_splits)
    assert split.STAGED_INDICES == (kernel.NUM_CHUNKS // num_splits >= 2)


def _outputs(module, case: cases.CheckCase, num_splits: int | None):
    inputs = cases.make_inputs(case, "cuda", seed=zlib.crc32(case.name.encode()) % 1000)
    output, lse = cases.poisoned_outputs(case.num_tokens, "cuda")
    module.run_with_splits(*inputs.values(), output, lse, num_splits)
    return output, lse


def _assert_bitwise(name: str, case: cases.CheckCase, num_splits: int | None) -> None:
    out_k, lse_k = _outputs(kernel, case, num_splits)
    out_c, lse_c = _outputs(solution_module(name), case, num_splits)
    assert not torch.isnan(out_c.float()).any() and not torch.isnan(lse_c).any()
    assert torch.equal(out_c, out_k)
    assert torch.equal(lse_c, lse_k)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", CANDIDATES)
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("bitwise_t1", 1, 300, "random"),
        cases.CheckCase("bitwise_t2_ragged_tail", 2, 300, "ragged_tail"),
        cases.CheckCase("bitwise_t6_shared_pages", 6, 300, "shared_pages"),
        cases.CheckCase("bitwise_t7_one_valid", 7, 300, "one_valid"),
        cases.CheckCase("bitwise_t8_contest_pages", 8, cases.CONTEST_NUM_PAGES, "random"),
        cases.CheckCase("bitwise_t8_scattered_padding", 8, 300, "scattered_padding"),
        cases.CheckCase("bitwise_t8_all_padding", 8, 300, "all_padding"),
    ],
    ids=lambda c: getattr(c, "name", c),
)
def test_bit_for_bit_kernel_py(name, case):
    _assert_bitwise(name, case, None)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", CANDIDATES)
@pytest.mark.parametrize("num_splits", kernel.VALID_SPLITS)
def test_bit_for_bit_kernel_py_at_every_split_count(name, num_splits):
    # 1 split stages all 2048 row ids of a token; 16 splits 128 each; 32 splits run kernel.py's split kernel.
    _assert_bitwise(name, cases.CheckCase(f"bitwise_splits_{num_splits}", 9, 300, "ragged_tail"), num_splits)
