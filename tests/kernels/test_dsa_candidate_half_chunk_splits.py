"""DSA candidate v1.14 (kernels/dsa_attention/candidate_half_chunk_splits.py): splits of 32-row units, any count up
to 64. test_dsa_attention_kernel.py runs it through every check case (SOLUTIONS); this file covers what is its own:
the split policy and its forms on the CPU; on the GPU every kind of split count against the reference, and the
outputs bit for bit `kernel.py`'s where both take the same rows per split.
"""

from __future__ import annotations

import pytest
import torch

from hopperbench.devcheck import load_folder_module, load_module_by_path, total_nan
from hopperbench.paths import REPO_ROOT

cases = load_module_by_path(REPO_ROOT / "kernels/dsa_attention/check_cases.py", "dsa_check_cases")
candidate = load_folder_module(REPO_ROOT / "kernels/dsa_attention", "dsa_solution", "candidate_half_chunk_splits")
kernel = load_folder_module(REPO_ROOT / "kernels/dsa_attention", "dsa_solution", "kernel")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "num_tokens, splits, largest_rows",
    [(1, 64, 32), (2, 64, 32), (3, 32, 64), (4, 32, 64), (5, 22, 96), (6, 22, 96), (7, 16, 128), (8, 16, 128),
     (9, 13, 160), (16, 8, 256), (33, 4, 512), (66, 2, 1024), (100, 1, 2048), (4096, 1, 2048)],
)  # fmt: skip
def test_split_policy(num_tokens, splits, largest_rows):
    assert candidate.num_splits_for(num_tokens) == splits
    assert candidate.largest_split_rows(splits) == largest_rows


@pytest.mark.parametrize("num_tokens", range(1, 300))
def test_splits_fill_one_wave_with_the_smallest_largest_split(num_tokens):
    splits = candidate.num_splits_for(num_tokens)
    assert num_tokens * splits <= kernel.MAX_CTAS_PER_WAVE or splits == 1
    allowed = [s for s in candidate.VALID_SPLITS if num_tokens * s <= kernel.MAX_CTAS_PER_WAVE] or [1]
    best = min(candidate.largest_split_rows(s) for s in allowed)
    assert candidate.largest_split_rows(splits) == best
    # The fewest splits that reach it: fewer partials to write and merge.
    assert splits == min(s for s in allowed if candidate.largest_split_rows(s) == best)


def test_forms_stage_row_ids_only_for_two_chunks_and_widen_the_combine_only_past_32_splits():
    for splits in candidate.VALID_SPLITS:
        staged, combine = candidate.form(splits)
        assert staged == (candidate.largest_split_rows(splits) > kernel.BLOCK_N)
        assert combine.MAX_SPLITS >= splits
        assert combine.MAX_SPLITS == (64 if splits > 32 else 32)
    assert len(candidate.FORMS) == 3


def test_run_with_splits_rejects_a_count_past_the_units():
    inputs = cases.make_inputs(cases.CheckCase("cpu", 2, 3, "random"), "cpu")
    output = torch.empty(2, 16, 512, dtype=torch.bfloat16)
    lse = torch.empty(2, 16, dtype=torch.float32)
    with pytest.raises(candidate.DsaShapeError, match="num_splits"):
        candidate.run_with_splits(*inputs.values(), output, lse, 65)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [3, 5, 7, 13, 22, 31, 33, 44, 63, 64])
def test_ragged_split_counts_match_reference(num_splits):
    # ragged_tail: every prefix length once over the tokens, so splits of 32 rows with no valid row, splits whose
    # valid rows end inside their last half chunk, and tokens without any valid row all occur.
    case = cases.CheckCase("ragged_splits", 9, 300, "ragged_tail")
    inputs = cases.make_inputs(case, "cuda", seed=100 + num_splits)
    output, lse = cases.poisoned_outputs(case.num_tokens, "cuda")
    candidate.run_with_splits(*inputs.values(), output, lse, num_splits)
    result = cases.compare(output, lse, *cases.load_reference_run()(*inputs.values()))
    assert total_nan(result) == 0, result
    assert result.passed, result


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens, num_splits", [(8, 16), (4, 32), (40, 2), (200, 1)])
def test_same_rows_per_split_as_kernel_py_give_its_outputs_bit_for_bit(num_tokens, num_splits):
    case = cases.CheckCase("same_splits", num_tokens, 300, "scattered_padding")
    inputs = cases.make_inputs(case, "cuda", seed=num_tokens)
    ours = cases.poisoned_outputs(num_tokens, "cuda")
    theirs = cases.poisoned_outputs(num_tokens, "cuda")
    candidate.run_with_splits(*inputs.values(), *ours, num_splits)
    kernel.run_with_splits(*inputs.values(), *theirs, num_splits)
    assert torch.equal(ours[0], theirs[0])
    assert torch.equal(ours[1], theirs[1])
