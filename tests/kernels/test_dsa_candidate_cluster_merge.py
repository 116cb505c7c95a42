"""DSA candidate v1.6 (kernels/dsa_attention/candidate_cluster_merge.py): the splits of a token as one cluster,
merged over distributed shared memory. CPU: both cluster sizes compile for sm_90a, and their merge covers
every column of every head once. GPU (marked `gpu`): clusters of 8 against the reference at 1-8 tokens and
the padding patterns (clusters of 16 are the module's `run`, in test_dsa_attention_kernel.py's SOLUTIONS),
and the sizes agree with each other within the contest rule.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from hopperbench.devcheck import total_nan
from tests.kernels.test_dsa_attention_kernel import cases, kernel, needs_cuda, solution_module

candidate = solution_module("candidate_cluster_merge")


def test_both_cluster_sizes_compile_and_are_cached():
    compiled = candidate.compile_only("sm_90a")
    assert len({id(fn) for fn in compiled}) == len(compiled) == 3
    assert candidate.compile_only("sm_90a") == compiled


@pytest.mark.parametrize("split", [candidate._ClusterSplitKernel, candidate._EightSplits])
def test_the_merge_covers_every_column_of_every_head_once(split):
    """The merge's map from (rank, thread) to (head, columns), in Python, as the kernel computes it."""
    splits = split.cluster_splits
    assert kernel.NUM_CHUNKS % splits == 0
    columns_per_thread = kernel.CKV_DIM // splits // candidate.THREADS_PER_HEAD
    assert columns_per_thread % candidate.COLUMNS_PER_LOAD == 0
    covered = []
    for rank in range(splits):
        for tidx in range(kernel.NUM_THREADS):
            head = tidx // candidate.THREADS_PER_HEAD
            col0 = rank * (kernel.CKV_DIM // splits) + (tidx % candidate.THREADS_PER_HEAD) * columns_per_thread
            assert (head * kernel.WS_COLS + col0) % candidate.COLUMNS_PER_LOAD == 0  # 16-B aligned v4 loads
            covered += [(head, col0 + j) for j in range(columns_per_thread)]
    assert sorted(covered) == [(h, c) for h in range(kernel.NUM_HEADS) for c in range(kernel.CKV_DIM)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("cluster8_t1", 1, 300, "random"),
        cases.CheckCase("cluster8_t2_ragged_tail", 2, 300, "ragged_tail"),
        cases.CheckCase("cluster8_t8_contest_pages", 8, cases.CONTEST_NUM_PAGES, "random"),
        cases.CheckCase("cluster8_t8_all_padding", 8, 300, "all_padding"),
        cases.CheckCase("cluster8_t7_one_valid", 7, 300, "one_valid"),
        cases.CheckCase("cluster8_t6_shared_pages", 6, 300, "shared_pages"),
    ],
    ids=lambda c: c.name,
)
def test_clusters_of_eight_match_reference(case):
    inputs = cases.make_inputs(case, "cuda", seed=zlib.crc32(case.name.encode()) % 1000)
    output, lse = cases.poisoned_outputs(case.num_tokens, "cuda")
    candidate.run_eight(*inputs.values(), output, lse)
    result = cases.compare(output, lse, *cases.load_reference_run()(*inputs.values()))
    assert total_nan(result) == 0, result
    assert result.passed, result


@pytest.mark.gpu
@needs_cuda
def test_both_sizes_agree_with_kernel_py():
    case = cases.CheckCase("cluster_vs_kernel", 8, 300, "scattered_padding")
    inputs = cases.make_inputs(case, "cuda", seed=5)
    results = []
    for run in (kernel.run, candidate.run_sixteen, candidate.run_eight):
        output, lse = cases.poisoned_outputs(case.num_tokens, "cuda")
        run(*inputs.values(), output, lse)
        results.append((output, lse))
    for output, lse in results[1:]:
        assert torch.isfinite(output.float()).all()
        assert torch.allclose(output.float(), results[0][0].float(), atol=1e-2, rtol=1e-2)
        assert torch.allclose(lse, results[0][1], atol=1e-3, rtol=1e-3, equal_nan=False)
