"""MoE GEMM2 on bf16 warpgroup MMA with the e4m3 weights converted in registers (
kernels/moe/wgmma_gemm2.py and kernels/moe/intermediate_order.py; kernel.py's variants from 33 tokens
but 65-192).

CPU:
- one stage of the data path composed on integers (C stored permuted, both copies, the threads' weight
  loads, CuTe's B layout under its swizzle) equals W C^T;
- the column order of C is a permutation that puts under every A-fragment value the column its weight
  byte multiplies (the fragment's coordinates traced from CuTe's partition of the RS tiled MMA), and the
  fragment's Int32 word view has the layout the kernel writes through;
- the byte offsets of C's copies equal CuTe's B layout under its swizzle (8-32 tokens); the weight tile's
  swizzle keeps every chunk aligned and spreads a load phase's 8 rows over distinct banks;
- the configurations' shared memory;
each layout check for both 16-bit types of C, bf16 (`kernel.py`) and f16 (`f16_c`).
GPU (marked `gpu`): kernel.py's distance from the reference with the WGMMA GEMM2 against the same
variant with the `mma.sync` GEMM2. The per-GEMM checks (C un-permuted) are test_moe_streaming.py's,
the end-to-end checks test_moe_kernel.py's.
"""

from __future__ import annotations


import pytest
import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor

from tests.kernels.test_moe_kernel import cases, kernel, needs_cuda, solution_module
from tests.kernels.test_moe_streaming import on_mma_sync

gemm2 = solution_module("wgmma_gemm2")
gemm1 = solution_module("wgmma_gemm1")
order = solution_module("intermediate_order")
STAGES = 3
C_TYPES = pytest.mark.parametrize("dtype", [cutlass.BFloat16, cutlass.Float16], ids=["bf16", "f16"])


def test_the_column_order_is_a_permutation_of_each_group():
    assert sorted(order.natural_column(slot) for slot in range(order.GROUP)) == list(range(order.GROUP))
    assert all(order.natural_column(order.stored_position(c)) == c for c in range(order.GROUP))


def _traced_a_coordinates(dtype) -> list[tuple[int, int, int, int]]:
    """(thread, value, row, k) of the A fragment of one 32-wide K group (two k16 steps) for every
    thread of the warpgroup, as CuTe partitions the RS tiled MMA."""
    seen: list[tuple[int, int, int, int]] = []

    @cute.jit
    def probe(unused: cute.Tensor):
        tiled_mma, _ = gemm2.wgmma_operands(32, STAGES, dtype)
        for tid in cutlass.range_constexpr(gemm2.NUM_THREADS):
            coords = tiled_mma.get_slice(tid).partition_A(cute.make_identity_tensor((gemm2.ITEM_ROWS, order.GROUP)))
            for i in cutlass.range_constexpr(cute.size(coords)):
                row, k = coords[i]
                seen.append((tid, i, row, k))

    cute.compile(probe, make_fake_compact_tensor(cutlass.Float32, (4,), assumed_align=16), options="--gpu-arch sm_90a")
    return seen


@C_TYPES
def test_every_a_fragment_value_meets_the_column_its_weight_byte_multiplies(dtype):
    seen = _traced_a_coordinates(dtype)
    assert len(seen) == gemm2.NUM_THREADS * 16
    for tid, i, row, slot in seen:
        warp, group, quad = tid // 32, (tid % 32) // 4, tid % 4
        # fragment layout ((v0, v1, v2), M, step), element v0 + 2 v1 + 4 v2 + 8 step; word v1 + 2 v2
        v0, v1, v2, step = i % 2, (i // 2) % 2, (i // 4) % 2, i // 8
        assert row == 16 * warp + group + 8 * v1, (tid, i)
        assert slot == 16 * step + 2 * quad + 8 * v2 + v0, (tid, i)
        # the kernel feeds it byte 4 step + 2 v2 + v0 of the thread's 8 bytes at natural K 8 quad
        assert order.natural_column(slot) == 8 * quad + 4 * step + 2 * v2 + v0, (tid, i)


@C_TYPES
def test_the_a_fragment_words_are_the_value_pairs_the_kernel_writes(dtype):
    # The kernel writes word (0, v1, v2) of step k of a 16-bit fragment through its Int32 view; that word
    # must hold values (v0 = 0, 1) of (v1, v2) of step k: compact, v0 fastest.
    layouts: list[str] = []

    @cute.jit
    def probe(unused: cute.Tensor):
        tiled_mma, _ = gemm2.wgmma_operands(32, STAGES, dtype)
        block = cute.make_rmem_tensor(tiled_mma.get_slice(0).partition_shape_A((gemm2.ITEM_ROWS, gemm2.BLOCK)), dtype)
        layouts.append(str(block.layout))
        layouts.append(str(cute.recast_tensor(block, cutlass.Int32).layout))

    cute.compile(probe, make_fake_compact_tensor(cutlass.Float32, (4,), assumed_align=16), options="--gpu-arch sm_90a")
    assert layouts == ["((2,2,2),1,8):((1,2,4),0,8)", "((1,2,2),1,8):((1,1,2),0,4)"]


def _traced_c_layout(block_tokens: int, dtype) -> tuple[str, list[tuple[int, int, int, int]]]:
    """The staged C (B) layout as CuTe builds it: its swizzle, which the shared-memory tensor applies to
    byte addresses, and (row, k, stage, unswizzled byte offset) at every 16-B chunk start."""
    seen: list[tuple[int, int, int, int]] = []
    swizzle: list[str] = []

    @cute.jit
    def probe(unused: cute.Tensor):
        _, b_layout = gemm2.wgmma_operands(block_tokens, STAGES, dtype)
        swizzle.append(str(b_layout.inner))
        for row in cutlass.range_constexpr(block_tokens):
            for k in cutlass.range_constexpr(0, gemm2.STAGE_K, 8):
                for stage in cutlass.range_constexpr(STAGES):
                    seen.append((row, k, stage, b_layout.outer((row, k, stage)) * 2))  # 16-bit elements -> bytes

    cute.compile(probe, make_fake_compact_tensor(cutlass.Float32, (4,), assumed_align=16), options="--gpu-arch sm_90a")
    return swizzle[0], seen


@C_TYPES
@pytest.mark.parametrize("block_tokens", [8, 16, 32, 64])
def test_c_copy_offsets_are_the_mma_layout_byte_for_byte(block_tokens, dtype):
    swizzle, seen = _traced_c_layout(block_tokens, dtype)
    # Swizzle<3,4,3> on byte addresses: the 16-B chunk index (bits 4-6) XOR bits 7-9, the hardware's
    # 128-B pattern, which `swizzled_offset` applies.
    assert swizzle == "S<3,4,3>"
    assert len(seen) == block_tokens * gemm2.C_CHUNKS_PER_ROW * STAGES
    wrong = [
        (row, k, stage, linear)
        for row, k, stage, linear in seen
        if linear ^ (((linear >> 7) & 7) << 4)
        != gemm1.swizzled_offset(row, 2 * k, stage, block_tokens, gemm2.C_ROW_BYTES)
    ]
    assert not wrong, wrong[:5]


def test_weight_tile_is_a_swizzled_permutation_with_conflict_free_load_phases():
    offsets = {gemm2.weight_offset(row, k, 1) for row in range(gemm2.ITEM_ROWS) for k in range(gemm2.STAGE_K)}
    base = gemm2.ITEM_ROWS * gemm2.STAGE_K
    assert offsets == set(range(base, 2 * base))
    for row in range(gemm2.ITEM_ROWS):
        for k in range(0, gemm2.STAGE_K, gemm2.CHUNK):  # a cp.async chunk stays contiguous and aligned
            first = gemm2.weight_offset(row, k, 0)
            assert first % gemm2.CHUNK == 0
            assert [gemm2.weight_offset(row, k + b, 0) for b in range(gemm2.CHUNK)] == list(range(first, first + 16))
    for k in range(0, gemm2.STAGE_K, gemm2.THREAD_BYTES):  # rows g = 0..7 of one phase: 8 bank groups
        banks = {(gemm2.weight_offset(16 + g, k, 0) % 128) // 16 for g in range(8)}
        assert len(banks) == 8


def test_configurations_fit_two_ctas_per_sm_and_reject_bad_shapes():
    for block_tokens in (8, 16, 32):
        assert gemm2.WgmmaGemm2Config(block_tokens, 3).ctas_per_sm() == 2
        f16_c = gemm2.WgmmaGemm2Config(block_tokens, 3, f16_c=True)
        assert f16_c.smem_bytes() == gemm2.WgmmaGemm2Config(block_tokens, 3).smem_bytes()
    assert gemm2.WgmmaGemm2Config(64, 3).ctas_per_sm() == 1  # 144 KB
    with pytest.raises(gemm2.StreamingConfigError):
        gemm2.WgmmaGemm2Config(24, 3)
    with pytest.raises(gemm2.StreamingConfigError):
        gemm2.WgmmaGemm2Config(32, 1)
    # two stages of 32 tokens fit three CTAs per SM, which the f16 GEMM2 runs (its registers allow them)
    assert gemm2.WgmmaGemm2Config(32, 2).ctas_per_sm() == 2
    assert gemm2.WgmmaGemm2Config(32, 2, f16_c=True).ctas_per_sm() == 3
    assert gemm2.WgmmaGemm2Config(32, 3, f16_c=True).ctas_per_sm() == 2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [58, 901])
def test_the_wgmma_gemm2_is_as_accurate_as_the_mma_sync_one(num_tokens):
    # The same products and promotion; the tensor core sums a block's 128 products in its own order.
    case = cases.CheckCase("wgmma2_vs_mma_sync", num_tokens, 96)
    inputs = cases.make_inputs(case, "cuda", seed=19)
    expected = cases.reference_run(cases.load_reference())(*inputs.values()).float()
    variant = kernel.variant_for(num_tokens)
    assert variant.engine is kernel.Engine.WGMMA
    errors = {}
    for name, chosen in (("wgmma", variant), ("mma.sync", on_mma_sync(variant))):
        output = cases.poisoned_output(case.num_tokens, "cuda")
        kernel.run_keeping_workspaces(*inputs.values(), output, choose=lambda _: chosen)
        torch.cuda.synchronize()
        assert torch.isfinite(output).all(), name
        errors[name] = float((output.float() - expected).norm() / expected.norm())
    assert errors["wgmma"] < 1.1 * errors["mma.sync"] and errors["wgmma"] < 1e-2, errors


def _traced_block_operands(block_tokens: int, dtype):
    """CuTe's view of one 128-K block: the A fragment coordinates (thread, value, row, k) of the RS tiled
    MMA, and the unswizzled byte offsets of the B (C) layout at every (token, k) of a stage."""
    a_coords: list[tuple[int, int, int, int]] = []
    b_offsets: dict[tuple[int, int], int] = {}

    @cute.jit
    def probe(unused: cute.Tensor):
        tiled_mma, b_layout = gemm2.wgmma_operands(block_tokens, STAGES, dtype)
        for tid in cutlass.range_constexpr(gemm2.NUM_THREADS):
            coords = tiled_mma.get_slice(tid).partition_A(cute.make_identity_tensor((gemm2.ITEM_ROWS, gemm2.BLOCK)))
            for i in cutlass.range_constexpr(cute.size(coords)):
                row, k = coords[i]
                a_coords.append((tid, i, row, k))
        for n in cutlass.range_constexpr(block_tokens):
            for k in cutlass.range_constexpr(gemm2.STAGE_K):
                b_offsets[(n, k)] = b_layout.outer((n, k, 1)) * 2

    cute.compile(probe, make_fake_compact_tensor(cutlass.Float32, (4,), assumed_align=16), options="--gpu-arch sm_90a")
    return a_coords, b_offsets


@C_TYPES
def test_one_stage_of_the_data_path_computes_w_times_c_on_the_cpu(dtype):
    """The kernel's index maps composed, on integers: GEMM1 stores C permuted, the copies place W and C in
    shared memory (`weight_offset`, `swizzled_offset`), each thread loads and splits its weight bytes as
    `convert_block` does, the tensor core reads C through CuTe's swizzled layout; the products summed
    over the stage equal W C^T in natural order."""
    block_tokens, slot = 16, 1
    rng = torch.Generator().manual_seed(3)
    w = torch.randint(-8, 8, (gemm2.ITEM_ROWS, gemm2.STAGE_K), generator=rng)
    c = torch.randint(-8, 8, (block_tokens, gemm2.STAGE_K), generator=rng)
    a_coords, b_offsets = _traced_block_operands(block_tokens, dtype)

    # GEMM1's permuted store, then the copies into shared memory (bytes as Python dict cells).
    c_stored = torch.empty_like(c)
    for column in range(gemm2.STAGE_K):
        group = column - column % order.GROUP
        c_stored[:, group + order.stored_position(column % order.GROUP)] = c[:, column]
    smem_w = {gemm2.weight_offset(r, k, slot): int(w[r, k]) for r in range(gemm2.ITEM_ROWS) for k in range(gemm2.STAGE_K)}
    smem_c = {}
    for n in range(block_tokens):
        for chunk in range(gemm2.C_CHUNKS_PER_ROW):
            base = gemm1.swizzled_offset(n, chunk * gemm2.CHUNK, slot, block_tokens, gemm2.C_ROW_BYTES)
            for e in range(gemm2.CHUNK // 2):
                smem_c[base + 2 * e] = int(c_stored[n, chunk * gemm2.CHUNK // 2 + e])

    # A as the warpgroup holds it: value (v0, v1, v2) of k16 step 2 j + s of block b is byte 4 s + 2 v2 + v0
    # of the thread's 8-byte load of row g + 8 v1 at K b * 128 + 32 j + 8 t.
    a_logical = torch.zeros(gemm2.ITEM_ROWS, gemm2.STAGE_K, dtype=torch.long)
    seen = set()
    for b in range(gemm2.BLOCKS_PER_STAGE):
        for tid, i, row, k in a_coords:
            warp, group, quad = tid // 32, (tid % 32) // 4, tid % 4
            v0, v1, v2, step16 = i % 2, (i // 2) % 2, (i // 4) % 2, i // 8
            j, s = step16 // 2, step16 % 2
            load = gemm2.weight_offset(16 * warp + group + 8 * v1, b * gemm2.BLOCK + j * order.GROUP + quad * 8, slot)
            a_logical[row, b * gemm2.BLOCK + k] = smem_w[load + 4 * s + 2 * v2 + v0]
            seen.add((row, b * gemm2.BLOCK + k))
    assert len(seen) == gemm2.ITEM_ROWS * gemm2.STAGE_K

    # B as the tensor core reads it: CuTe's layout, then the 128-B swizzle on byte addresses.
    b_logical = torch.zeros(block_tokens, gemm2.STAGE_K, dtype=torch.long)
    for (n, k), linear in b_offsets.items():
        b_logical[n, k] = smem_c[linear ^ (((linear >> 7) & 7) << 4)]

    assert torch.equal(a_logical @ b_logical.T, w @ c.T)
