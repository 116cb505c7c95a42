"""MoE candidate v2.35 (kernels/moe/candidate_w2_prefetch.py): the `mma.sync` GEMM1 of 7-32 tokens prefetches GEMM2's
first items into L2.
CPU: the dispatch, the configuration guards, the compile (GEMM1 still three CTAs per SM at 7-8 tokens), and the compile
of a probe of `streaming_gemm.gemm2_item_weights`. GPU (marked `gpu`): the probe's offsets equal GEMM2's item rows
(expert, 32 output columns) for random and skewed counts, and the output is kernel.py's bit for bit at 7-32 tokens in
every routing pattern, call after call (a prefetch changes no value; its effect is only on time). The end-to-end checks
against the reference (graph capture and replay included) are test_moe_kernel.py's (the module is in SOLUTIONS).
"""

from __future__ import annotations

import random

import pytest
import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import outputs_of

candidate = solution_module("candidate_w2_prefetch")
streaming = solution_module("streaming_gemm")


def test_prefetches_from_7_to_32_tokens_only():
    for num_tokens in (7, 8):
        assert candidate.variant_for(num_tokens) is candidate.TINY_T_THREE_CTAS_W2_PREFETCH
    for num_tokens in (9, 16, 32):
        assert candidate.variant_for(num_tokens) is candidate.TINY_T_W2_PREFETCH
    for num_tokens in (1, 6, 33, 901, 14107):
        assert candidate.variant_for(num_tokens) is kernel.variant_for(num_tokens)
    with pytest.raises(kernel.MoeShapeError):
        candidate.variant_for(0)
    for ours, theirs in ((candidate.TINY_T_THREE_CTAS_W2_PREFETCH, kernel.TINY_T_THREE_CTAS),
                         (candidate.TINY_T_W2_PREFETCH, kernel.TINY_T)):  # fmt: skip
        mine, base = ours.gemm1(), theirs.gemm1()
        assert mine.gemm2_prefetch_tokens == ours.gemm2().block_tokens == 8 and base.gemm2_prefetch_tokens == 0
        assert {**vars(mine), "gemm2_prefetch_tokens": 0} == vars(base)
        assert mine.ctas_per_sm() == base.ctas_per_sm()
        assert vars(ours.gemm2()) == vars(theirs.gemm2())


def test_only_the_mma_sync_gemm1_prefetches_and_only_gemm2_row_tiles():
    with pytest.raises(streaming.StreamingConfigError, match="gemm2_prefetch_tokens"):
        streaming.StreamingGemmConfig(gemm1=False, block_tokens=8, num_stages=4, gemm2_prefetch_tokens=8)
    with pytest.raises(streaming.StreamingConfigError, match="gemm2_prefetch_tokens"):
        streaming.StreamingGemmConfig(gemm1=True, block_tokens=16, num_stages=4, gemm2_prefetch_tokens=12)
    with pytest.raises(ValueError, match="gemm1_prefetches_w2"):
        kernel.StreamingVariant(
            block_tokens=32, wgmma_gemm1=True, wgmma_gemm2=True, routing_in_gemm1=True, gemm1_prefetches_w2=True
        )


def test_compiles_its_two_configurations_beside_kernel_pys():
    compiled = candidate.compile_only("sm_90a")
    assert compiled[: len(kernel.compile_only("sm_90a"))] == kernel.compile_only("sm_90a")
    assert len(set(map(id, compiled))) == len(kernel.compile_only("sm_90a")) + 2


class _ItemWeightsProbe:
    """Warp 0 of CTA c runs `gemm2_item_weights` for item c on the counts; lane 0 writes the offset to out[c]."""

    @cute.jit
    def __call__(self, counts: cute.Tensor, out: cute.Tensor, stream):
        self.kernel(counts, out).launch(grid=[out.shape[0], 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, counts: cute.Tensor, out: cute.Tensor):
        lane, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        offset = streaming.gemm2_item_weights(counts, 8, cta, lane)
        if lane == 0:
            out[cta] = offset


def item_weights_probe():
    counts = make_fake_compact_tensor(cutlass.Int32, (streaming.NUM_LOCAL_EXPERTS,), assumed_align=16)
    out = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(_ItemWeightsProbe(), counts, out, stream, options="--enable-tvm-ffi --gpu-arch sm_90a")


def test_the_item_weights_probe_compiles_without_a_gpu():
    assert callable(item_weights_probe())


def expected_item_weights(counts: list[int], items: int) -> list[int]:
    """GEMM2's item i (8-token row tiles, 224 items of 32 output columns each): the element offset of its 32 weight
    rows in W2 [32, 7168, 2048], or -1 past the last row tile."""
    experts_of_tiles = [e for e, count in enumerate(counts) for _ in range(-(-count // 8))]
    offsets = []
    for item in range(items):
        tile, column_block = divmod(item, streaming.GEMM2_ITEMS_PER_ROW_TILE)
        if tile >= len(experts_of_tiles):
            offsets.append(-1)
        else:
            offsets.append((experts_of_tiles[tile] * streaming.HIDDEN + column_block * 32) * streaming.INTERMEDIATE)
    return offsets


@pytest.mark.gpu
@needs_cuda
def test_the_item_weights_are_gemm2_items_rows():
    probe = item_weights_probe()
    draw = random.Random(5)
    shapes = [
        [0] * 32,
        [7 if e == 3 else 0 for e in range(32)],
        [1] * 32,
        [draw.randrange(0, 20) for _ in range(32)],
        [draw.choice((0, 0, 3, 9, 17)) for _ in range(32)],
        [64 if e == 31 else 0 for e in range(32)],
    ]
    for counts in shapes:
        out = torch.full((400,), -7, dtype=torch.int32, device="cuda")
        probe(torch.tensor(counts, dtype=torch.int32, device="cuda"), out)
        torch.cuda.synchronize()
        assert out.tolist() == expected_item_weights(counts, 400), counts


CASES = [
    cases.CheckCase("w2_prefetch_t7", 7, 192),
    cases.CheckCase("w2_prefetch_t7_no_local", 7, 96, "no_local"),
    cases.CheckCase("w2_prefetch_t8_one_expert", 8, 128, "one_expert"),
    cases.CheckCase("w2_prefetch_t14", 14, 32),
    cases.CheckCase("w2_prefetch_t32_all_local", 32, 224, "all_local"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_outputs_are_kernel_py_bit_for_bit_call_after_call(case):
    theirs, *ours = outputs_of((kernel.run, *[candidate.run] * 3), case, seed=73)
    assert torch.isfinite(theirs).all()
    for output in ours:
        assert torch.equal(output, theirs)
