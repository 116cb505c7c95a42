"""Our CuTe-DSL DSA sparse-attention kernel (kernels/dsa_attention/kernel.py).

CPU: the kernels compile for sm_90a without a GPU; the split heuristic; input validation; the
comparison helper the GPU tests rely on. GPU (marked `gpu`, skipped without CUDA), for kernel.py and
each candidate of the folder (SOLUTIONS): `run` against our reference on fresh random inputs for
every case in kernels/dsa_attention/check_cases.py, with NaN-poisoned outputs; every split count;
bitwise-repeatable calls; CUDA-graph capture and replay.
"""

from __future__ import annotations

import functools
import math
import zlib

import pytest
import torch

from hopperbench.devcheck import load_folder_module, load_module_by_path, replay_on_fresh_inputs, total_nan
from hopperbench.paths import REPO_ROOT
from tests.kernels.compile_checks import assert_compiles_and_caches

# kernels/ is not a package: load the case helpers and the kernel by path, as the harness does.
cases = load_module_by_path(REPO_ROOT / "kernels/dsa_attention/check_cases.py", "dsa_check_cases")
kernel = cases.load_kernel()
# kernel.py and the candidates of its folder: every GPU test below runs each of them.
SOLUTIONS = ("kernel",)


@functools.cache
def solution_module(name: str):
    """kernel.py, or the candidate kernels/dsa_attention/<name>.py (loaded once, as a module of a
    package made of the folder, as the harness packs it: a candidate imports kernel.py)."""
    if name == "kernel":
        return kernel
    return load_folder_module(REPO_ROOT / "kernels/dsa_attention", "dsa_solution", name)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SOLUTIONS)
def test_compiles_both_forms_for_sm90a_without_gpu(name):
    assert_compiles_and_caches(solution_module(name).compile_only, 2)  # row ids staged or not


@pytest.mark.parametrize("num_tokens, staged", [(1, False), (2, False), (4, False), (5, True), (8, True), (4096, True)])
def test_row_ids_are_staged_only_where_a_split_has_two_or_more_chunks(num_tokens, staged):
    # Staging them at one chunk per split too delays the gather and costs 4 % at 1 token (NOTES.md).
    splits = kernel.num_splits_for(num_tokens)
    assert kernel.stages_indices(splits) == staged
    assert staged == (kernel.NUM_CHUNKS // splits >= 2)


@pytest.mark.parametrize("name", SOLUTIONS)
def test_every_solution_offers_the_split_count_entry_the_gpu_tests_call(name):
    # A candidate without it would fail every split-count GPU test before its kernel ran.
    assert callable(getattr(solution_module(name), "run_with_splits", None))


def test_combine_covers_the_columns_and_the_splits():
    assert kernel.COMBINE_COLUMN_GROUPS * kernel.NUM_THREADS == kernel.CKV_DIM  # one column per thread
    assert max(kernel.VALID_SPLITS) == kernel.MAX_SPLITS <= 32  # the split statistics fit one warp


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 7, 8, 9, 37, 100, 128, 129, 4096, 100_000])
def test_num_splits_divides_the_chunks_and_fills_the_gpu(num_tokens):
    splits = kernel.num_splits_for(num_tokens)
    assert splits in kernel.VALID_SPLITS
    assert kernel.NUM_CHUNKS % splits == 0
    # One wave of CTAs (or a single split once T alone exceeds a wave) ...
    assert num_tokens * splits <= kernel.MAX_CTAS_PER_WAVE or splits == 1
    # ... with as many splits as fit in it.
    assert splits == kernel.NUM_CHUNKS or num_tokens * splits * 2 > kernel.MAX_CTAS_PER_WAVE


def test_valid_splits_are_the_divisors_of_the_chunk_count():
    powers_of_two = (s for s in range(1, kernel.NUM_CHUNKS + 1) if s & (s - 1) == 0)
    assert kernel.VALID_SPLITS == tuple(s for s in powers_of_two if kernel.NUM_CHUNKS % s == 0)


def _cpu_inputs(num_tokens=2, num_pages=3):
    inputs = cases.make_inputs(cases.CheckCase("cpu", num_tokens, num_pages, "random"), "cpu")
    output = torch.empty(num_tokens, 16, 512, dtype=torch.bfloat16)
    lse = torch.empty(num_tokens, 16, dtype=torch.float32)
    return inputs, output, lse


def test_run_rejects_wrong_dtype_with_one_line_error():
    inputs, output, lse = _cpu_inputs()
    inputs["sparse_indices"] = inputs["sparse_indices"].long()
    with pytest.raises(kernel.DsaShapeError, match="sparse_indices") as info:
        kernel.run(*inputs.values(), output, lse)
    assert "\n" not in str(info.value)


def test_run_rejects_wrong_output_shape():
    inputs, _, lse = _cpu_inputs()
    with pytest.raises(kernel.DsaShapeError, match="output"):
        kernel.run(*inputs.values(), torch.empty(2, 16, 256, dtype=torch.bfloat16), lse)


def test_run_rejects_non_contiguous_cache():
    inputs, output, lse = _cpu_inputs()
    inputs["ckv_cache"] = torch.empty(3, 512, 64, dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(kernel.DsaShapeError, match="ckv_cache"):
        kernel.run(*inputs.values(), output, lse)


def test_run_with_splits_rejects_a_split_count_that_does_not_divide_the_chunks():
    inputs, output, lse = _cpu_inputs()
    with pytest.raises(kernel.DsaShapeError, match="num_splits"):
        kernel.run_with_splits(*inputs.values(), output, lse, 3)


def test_compare_accepts_the_reference_and_flags_errors():
    reference = cases.load_reference_run()
    inputs = cases.make_inputs(cases.CheckCase("cpu", 4, 3, "ragged_tail"), "cpu")
    ref_out, ref_lse = reference(*inputs.values())
    assert torch.isneginf(ref_lse[0]).all()  # token 0 has no valid row
    assert cases.compare(ref_out, ref_lse, ref_out, ref_lse).passed

    shifted = ref_out.clone()
    shifted[1, 3, 7] += 0.5
    result = cases.compare(shifted, ref_lse, ref_out, ref_lse)
    assert not result.passed and result.outputs["output"].bad_count == 1

    finite_lse = ref_lse.clone()
    finite_lse[0, 0] = 0.0  # a finite lse where the reference says -inf
    assert cases.compare(ref_out, finite_lse, ref_out, ref_lse).outputs["lse"].bad_count == 1

    nan_out = ref_out.clone()
    nan_out[2, 0, 0] = math.nan
    assert total_nan(cases.compare(nan_out, ref_lse, ref_out, ref_lse)) == 1


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


@pytest.fixture(params=SOLUTIONS)
def solution(request):
    return solution_module(request.param)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", cases.CASES, ids=lambda c: c.name)
def test_matches_reference(solution, case):
    inputs = cases.make_inputs(case, "cuda", seed=zlib.crc32(case.name.encode()) % 1000)
    output, lse = cases.poisoned_outputs(case.num_tokens, "cuda")
    solution.run(*inputs.values(), output, lse)
    ref_out, ref_lse = cases.load_reference_run()(*inputs.values())
    result = cases.compare(output, lse, ref_out, ref_lse)
    assert total_nan(result) == 0, result
    assert result.passed, result


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 2, 4, 8, 16, 32])
def test_every_split_count_matches_reference(solution, num_splits):
    # 1 split = 32 double-buffered chunks per CTA; 32 splits = one chunk per CTA. 9 tokens of
    # ragged_tail: every prefix length once, so some splits of some tokens have no valid row.
    case = cases.CheckCase("splits", 9, 300, "ragged_tail")
    inputs = cases.make_inputs(case, "cuda", seed=num_splits)
    output, lse = cases.poisoned_outputs(case.num_tokens, "cuda")
    solution.run_with_splits(*inputs.values(), output, lse, num_splits)
    result = cases.compare(output, lse, *cases.load_reference_run()(*inputs.values()))
    assert total_nan(result) == 0, result
    assert result.passed, result


@pytest.mark.gpu
@needs_cuda
def test_repeated_calls_are_bitwise_identical(solution):
    # For a last-CTA merge, which CTA arrives last varies from call to call; the result must not.
    case = cases.CheckCase("repeat", 8, 300, "scattered_padding")
    inputs = cases.make_inputs(case, "cuda", seed=3)
    first = cases.poisoned_outputs(case.num_tokens, "cuda")
    second = cases.poisoned_outputs(case.num_tokens, "cuda")
    solution.run(*inputs.values(), *first)
    solution.run(*inputs.values(), *second)
    assert torch.equal(first[0], second[0])
    assert torch.equal(first[1], second[1])


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_follows_new_inputs(solution):
    case = cases.CheckCase("graph", 8, 300, "scattered_padding")
    static = cases.make_inputs(case, "cuda", seed=1)
    output, lse = cases.poisoned_outputs(case.num_tokens, "cuda")
    fresh = cases.make_inputs(case, "cuda", seed=2)
    replay_on_fresh_inputs(lambda: solution.run(*static.values(), output, lse), static, fresh, (output, lse))
    ref_out, ref_lse = cases.load_reference_run()(*fresh.values())
    result = cases.compare(output, lse, ref_out, ref_lse)
    assert result.passed, result
