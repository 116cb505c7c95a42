"""MoE candidate v2.14 (kernels/moe/candidate_lean_wgmma.py): from 33 tokens the warpgroup-MMA GEMMs issue each K
stage from per-item bases. CPU: the dispatch, the configurations, the copy-row decomposition and the compile. GPU
(marked `gpu`): the output bit for bit kernel.py's in every WGMMA variant and routing pattern. The end-to-end checks
against the reference are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_lean_wgmma")
wgmma_gemm1 = solution_module("wgmma_gemm1")

CASES = (
    cases.CheckCase("t33", 33, 0),
    cases.CheckCase("t58", 58, 96),
    cases.CheckCase("t80_one_expert", 80, 224, "one_expert"),
    cases.CheckCase("t192_all_local", 192, 32, "all_local"),
    cases.CheckCase("t193", 193, 32),
    cases.CheckCase("t901", 901, 224),
    cases.CheckCase("t1025_one_expert", 1025, 96, "one_expert"),
    cases.CheckCase("t2049_no_local", 2049, 96, "no_local"),
    cases.CheckCase("t2049", 2049, 0),
)


def test_only_the_wgmma_variants_change():
    for num_tokens in (1, 32):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    for num_tokens in (33, 192, 193, 1024, 1025, kernel.MAX_TOKENS):
        chosen = candidate.variant_for(num_tokens)
        assert chosen.lean_issue and chosen.gemm1().lean_issue and chosen.gemm2().lean_issue
        assert chosen == dataclasses.replace(kernel.variant_for(num_tokens), lean_issue=True)


def test_item_bases_and_copy_offsets_address_the_item_rows():
    # WgmmaGemm1.item_bases takes the thread's first row; copy i adds item_weight_row(0, 8 i) rows.
    for n_tile in range(wgmma_gemm1.ITEMS_PER_ROW_TILE):
        for tidx in range(wgmma_gemm1.NUM_THREADS):
            first = wgmma_gemm1.item_weight_row(n_tile, tidx // wgmma_gemm1.CHUNKS_PER_ROW)
            for i in range(wgmma_gemm1.ITEM_ROWS * wgmma_gemm1.CHUNKS_PER_ROW // wgmma_gemm1.NUM_THREADS):
                row = (i * wgmma_gemm1.NUM_THREADS + tidx) // wgmma_gemm1.CHUNKS_PER_ROW
                delta = wgmma_gemm1.item_weight_row(0, i * wgmma_gemm1.ROWS_PER_PASS)
                assert first + delta == wgmma_gemm1.item_weight_row(n_tile, row)


def test_compiles_without_gpu():
    assert len(candidate.compile_only("sm_90a")) == len(kernel.compile_only("sm_90a")) + 3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_outputs_are_kernel_py_s_bit_for_bit(case):
    outputs = outputs_of((kernel.run, candidate.run), case, seed=67)
    assert torch.isfinite(outputs[1]).all()
    assert torch.equal(outputs[0], outputs[1])
