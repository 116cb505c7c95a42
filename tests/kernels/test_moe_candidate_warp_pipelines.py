"""MoE candidate v2.19 (kernels/moe/candidate_warp_pipelines.py): below 33 tokens each warp of both `mma.sync` GEMMs
copies the weights, activations and scales of its own K block of every stage, and a stage waits at a warp barrier.

CPU: the dispatch and the compile; transcriptions of the warp-mode copies (`item_bases` and `load_stage` with
`warp_pipelines`) that fill shared memory exactly as kernel.py's copies do (test_moe_streaming.py's transcriptions,
whose MMA pairing is tested there), each warp writing only its own K block's weights, activations and scales. GPU
(marked `gpu`): each GEMM against torch on its packed rows, and the output bit for bit kernel.py's at 1-32 tokens in
every routing pattern. The end-to-end checks against the reference are test_moe_kernel.py's (the module is in
SOLUTIONS).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.compile_checks import assert_compiles_and_caches
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import _activation_smem, _weight_smem, check_each_gemm, outputs_of

candidate = solution_module("candidate_warp_pipelines")
streaming = solution_module("streaming_gemm")

WARP = 32


def test_warp_pipelines_below_33_tokens_only():
    for num_tokens in (1, 7, 16, 32):
        chosen = candidate.variant_for(num_tokens)
        assert chosen is candidate.TINY_T_WARP_PIPELINES
        assert chosen.gemm1().warp_pipelines and chosen.gemm2().warp_pipelines
        assert dataclasses.replace(chosen, warp_pipelines=False) == kernel.variant_for(num_tokens)
    for num_tokens in (33, 192, 901, 14107):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(ValueError, match="mma.sync"):
        dataclasses.replace(kernel.FEW_TOKENS, warp_pipelines=True)


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(candidate.compile_only, len(kernel.VARIANTS) + 1)


def _config(gemm1: bool):
    variant = candidate.TINY_T_WARP_PIPELINES
    return variant.gemm1() if gemm1 else variant.gemm2()


def _warp_weight_smem(config, n_tile: int, k_stage: int) -> list:
    """Transcription of the warp-mode weight copies: `item_bases`' first row and chunk of the thread, plus
    item_weight_row(.., 0, 4 i) rows for copy i; the destination of `load_stage`."""
    smem = [[[None] * streaming.BLOCK for _ in range(streaming.ITEM_ROWS)] for _ in range(streaming.BLOCKS_PER_STAGE)]
    per_block = streaming.FP8_CHUNKS_PER_BLOCK_ROW
    for tidx in range(streaming.NUM_THREADS):
        warp, lane = tidx // WARP, tidx % WARP
        first_row = streaming.item_weight_row(config.gemm1, n_tile, lane // per_block)
        chunk = warp * per_block + lane % per_block  # item_bases' w_chunk
        for i in range(streaming.ITEM_ROWS * streaming.STAGE_K // streaming.CHUNK // streaming.NUM_THREADS):
            row = i * 4 + lane // per_block
            k_block, in_block = warp, tidx % per_block
            assert k_block == warp, "a warp copies only its own K block"
            weight_row = first_row + streaming.item_weight_row(config.gemm1, 0, i * 4)
            slot = streaming.fp8_chunk_slot(in_block, row)
            for b in range(streaming.CHUNK):
                position = slot * streaming.CHUNK + b
                assert smem[k_block][row][position] is None, "two copies write one shared-memory byte"
                smem[k_block][row][position] = ("w", weight_row, k_stage * streaming.STAGE_K + chunk * streaming.CHUNK + b)
    return smem


def _warp_activation_smem(config, k_stage: int) -> list:
    """Transcription of the warp-mode activation copies (all token slots valid)."""
    bt, lpt = config.block_tokens, config.lanes_per_token
    elements = streaming.CHUNK if config.gemm1 else streaming.CHUNK // 2
    per_block = streaming.BLOCK // elements
    smem = [[[None] * streaming.BLOCK for _ in range(bt)] for _ in range(streaming.BLOCKS_PER_STAGE)]
    for tidx in range(streaming.NUM_THREADS):
        warp, lane = tidx // WARP, tidx % WARP
        token_slot = streaming.copy_token_slot(config, tidx)
        assert token_slot == lane // lpt
        sub = tidx % lpt
        for i in range(per_block // lpt):
            x_chunk = warp * per_block + sub + i * lpt
            k_block, in_block = x_chunk // per_block, x_chunk % per_block
            assert k_block == warp
            if config.gemm1:
                slot = streaming.fp8_chunk_slot(in_block, token_slot)
            else:
                slot = streaming.bf16_chunk_slot(in_block, token_slot)
            for e in range(elements):
                position = slot * elements + e
                assert smem[k_block][token_slot][position] is None, "two copies write one element"
                smem[k_block][token_slot][position] = ("x", token_slot, k_stage * streaming.STAGE_K + x_chunk * elements + e)
    return smem


@pytest.mark.parametrize("gemm1", [True, False], ids=["gemm1", "gemm2"])
def test_warp_copies_fill_shared_memory_as_kernel_py_does(gemm1):
    config = _config(gemm1)
    normal = dataclasses.replace(candidate.TINY_T_WARP_PIPELINES, warp_pipelines=False)
    normal_config = normal.gemm1() if gemm1 else normal.gemm2()
    for n_tile in (0, 1, config.items_per_row_tile - 1):
        for k_stage in (0, config.k_stages - 1):
            assert _warp_weight_smem(config, n_tile, k_stage) == _weight_smem(normal_config, n_tile, k_stage)
    for k_stage in (0, config.k_stages - 1):
        assert _warp_activation_smem(config, k_stage) == _activation_smem(normal_config, k_stage)


def test_each_scale_is_copied_once_by_the_warp_of_its_block():
    config = _config(True)
    x_scales, w_scales = {}, {}
    for tidx in range(streaming.NUM_THREADS):
        warp, lane = tidx // WARP, tidx % WARP
        token_slot, sub = streaming.copy_token_slot(config, tidx), tidx % config.lanes_per_token
        if sub == 0:  # load_stage: the token's scale of the warp's block
            assert (token_slot, warp) not in x_scales
            x_scales[token_slot, warp] = tidx
        if lane < streaming.M_TILES:  # the m tile's scale of the warp's block
            assert (warp, lane) not in w_scales
            w_scales[warp, lane] = tidx
    assert set(x_scales) == {(t, b) for t in range(config.block_tokens) for b in range(streaming.BLOCKS_PER_STAGE)}
    assert set(w_scales) == {(b, m) for b in range(streaming.BLOCKS_PER_STAGE) for m in range(streaming.M_TILES)}


WARP_CASES = [
    cases.CheckCase("warps_t1", 1, 0),
    cases.CheckCase("warps_t1_one_expert", 1, 64, "one_expert"),
    cases.CheckCase("warps_t7", 7, 224),
    cases.CheckCase("warps_t13_all_local", 13, 32, "all_local"),
    cases.CheckCase("warps_t16_one_expert", 16, 96, "one_expert"),
    cases.CheckCase("warps_t32", 32, 128),
    cases.CheckCase("warps_t32_all_local", 32, 0, "all_local"),
    cases.CheckCase("warps_t5_no_local", 5, 160, "no_local"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", [c for c in WARP_CASES if c.pattern != "no_local"], ids=lambda c: c.name)
def test_each_gemm_matches_torch_on_its_packed_rows(case):
    check_each_gemm(case, candidate.variant_for)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", WARP_CASES, ids=lambda c: c.name)
def test_output_is_kernel_py_bit_for_bit(case):
    ours, theirs = outputs_of((candidate.run, kernel.run), case, seed=41)
    assert not torch.isnan(ours).any()
    assert torch.equal(ours, theirs)
