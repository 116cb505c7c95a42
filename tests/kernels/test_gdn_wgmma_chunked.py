"""GDN design v3 (kernels/gdn_prefill/wgmma_chunked.py, candidate v3.2 `candidate_wgmma_v3.py`): the chunks
of a sequence on warpgroup MMA with the state as an fp32 accumulator of two warpgroups.

CPU: the layout facts the kernel relies on, traced from CuTe's own layouts for every thread (each
accumulator it hands to the next product's register A holds the same coordinates in the same order;
one swizzled copy of the keys is the Gram products' A and B and both B operands of the value side), and
the candidate compiles for sm_90a. GPU (marked `gpu`): output and new state against `chunked_model.run`
at KERNEL precision (the same rounding points, so much tighter than the contest rule) on one and several
chunks, with and without a state; the contest-rule checks of every check case are
test_gdn_prefill_kernel.py's (the candidate is in its SOLUTIONS).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass.cute.runtime import make_fake_compact_tensor

from hopperbench.devcheck import load_folder_module, load_module_by_path
from hopperbench.paths import REPO_ROOT

state_products = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "wgmma_chunked")
candidate = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "candidate_wgmma_v3")
token_serial = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "token_serial")


class OneOutputPerThread(state_products.WgmmaChunked):
    """v3.1's inverse: one doubling output per thread and step (the tiles must not change a bit)."""

    doubling_tiles = ((1, 1), (1, 1))
cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
model = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/chunked_model.py", "gdn_chunked_model")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _probe(body) -> None:
    """Trace `body` (a @cute.jit function of one unused tensor) at compile time."""
    cute.compile(body, make_fake_compact_tensor(cutlass.Float32, (4,), assumed_align=16), options="--gpu-arch sm_90a")


def _trace_pairs(pairs) -> dict[int, list[tuple[list, list]]]:
    """For every thread: the coordinates of each (accumulator, A operand) pair `pairs(ops)` names, where
    ops = `operands()` and each pair is (tiled MMA of the C, its tile, tiled MMA of the A, its tile)."""
    traced: dict[int, list[tuple[list, list]]] = {}

    @cute.jit
    def body(unused: cute.Tensor):
        ops = state_products.operands()
        for tid in cutlass.range_constexpr(state_products.NUM_THREADS):
            traced[tid] = []
            for c_mma, c_tile, a_mma, a_tile in pairs(ops):
                c = c_mma.get_slice(tid).partition_C(cute.make_identity_tensor(c_tile))
                a = a_mma.get_slice(tid).partition_A(cute.make_identity_tensor(a_tile))
                traced[tid].append(([tuple(c[i]) for i in range(cute.size(c))], [tuple(a[i]) for i in range(cute.size(a))]))

    _probe(body)
    return traced


def test_every_accumulator_hand_over_is_element_wise_in_order():
    """The kernel converts an accumulator into the next product's register A by index: the state [v, k]
    into the A of Yk^T, Yq^T (K = 128); Yk^T-shaped [v, token] accumulators into the A of V'^T, O^T and
    of the state update (K = 64 tokens). Each needs the same coordinates in the same order, in every
    thread."""
    size, chunk = state_products.HEAD_SIZE, state_products.CHUNK

    def pairs(ops):
        update, products = ops[0], ops[1]
        return (
            (update, (size, size), products, (size, size)),
            (products, (size, chunk), products, (size, chunk)),
            (products, (size, chunk), update, (size, chunk)),
        )

    traced = _trace_pairs(pairs)
    assert len(traced) == state_products.NUM_THREADS
    for tid, hand_overs in traced.items():
        for number, (c_coords, a_coords) in enumerate(hand_overs):
            assert c_coords == a_coords and len(c_coords) > 0, (tid, number)
    # and the threads together hold the whole state once
    held = sorted(c for hand_overs in traced.values() for c in hand_overs[0][0])
    assert held == [(v, k) for v in range(size) for k in range(size)]


def test_one_swizzled_copy_of_the_keys_is_every_operand_view_of_them():
    offsets: list[tuple[int, int, int]] = []
    swizzles: list[str] = []

    @cute.jit
    def body(unused: cute.Tensor):
        *_, keys_k_major, keys_mn_major, gram_a, square = state_products.operands()
        swizzles.extend(str(layout.inner) for layout in (keys_k_major, keys_mn_major, gram_a, square))
        for token in cutlass.range_constexpr(state_products.CHUNK):
            for col in cutlass.range_constexpr(state_products.HEAD_SIZE):
                offsets.append(
                    (
                        keys_k_major.outer((token, col, 0)),  # B of K S0^T and of the Gram products
                        keys_mn_major.outer((col, token, 0)),  # B of the state update
                        gram_a.outer((token, col, 0)),  # A of K K^T and Q K^T
                    )
                )

    _probe(body)
    assert len(set(swizzles)) == 1 and swizzles[0] == "S<3,4,3>"
    assert all(a == b == c for a, b, c in offsets)
    assert sorted(a for a, _, _ in offsets) == list(range(state_products.CHUNK * state_products.HEAD_SIZE))


def test_compiles_for_sm90a_without_gpu():
    fn = candidate.compile_only("sm_90a")
    assert callable(fn) and candidate.compile_only("sm_90a") is fn


def test_every_doubling_tile_map_covers_each_output_once():
    """The inverse's doubling steps give each thread a rows x cols tile per step (`doubling_tile`, plain
    arithmetic the kernel traces): over all threads and steps the tiles must cover every output of every
    pair exactly once."""
    size_of = {0: state_products.BLOCK, 1: 2 * state_products.BLOCK}
    chunk, threads = state_products.CHUNK, state_products.NUM_THREADS
    for kernel_class in (state_products.WgmmaChunked, OneOutputPerThread):
        for level, (rows, cols) in enumerate(kernel_class.doubling_tiles):
            size = size_of[level]
            tiles = (chunk // (2 * size)) * (size // rows) * (size // cols)
            assert tiles % threads == 0
            covered = []
            for linear in range(tiles):
                hi, lo, r0, c0 = kernel_class().doubling_tile(linear, size, rows, cols)
                assert hi == lo + 1
                covered += [(hi * size + r0 + e // cols, lo * size + c0 + e % cols) for e in range(rows * cols)]
            expected = [(top + size + r, top + c) for top in range(0, chunk, 2 * size) for r in range(size) for c in range(size)]
            assert sorted(covered) == sorted(expected)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("v3_len64_state", (64,), True, 0.0, "mamba2"),
        cases.CheckCase("v3_len37_nostate", (37,), False, 0.0, "mamba2"),
        cases.CheckCase("v3_len200_65_state_fast", (200, 65), True, 0.05, "fast_decay"),
    ],
    ids=lambda c: c.name,
)
def test_matches_the_chunked_model_at_kernel_precision(case):
    inputs = cases.make_inputs(case, "cuda", seed=7)
    output, new_state = cases.poisoned_outputs(case, "cuda")
    candidate.run(*inputs.values(), output, new_state)
    torch.cuda.synchronize()
    want_output, want_state = model.run(*inputs.values(), precision=model.KERNEL)
    for name, got, want in (("output", output.float(), want_output.float()), ("new_state", new_state, want_state)):
        assert torch.isfinite(got).all(), name
        err = float((got - want).norm() / want.norm())
        # A wrong layout gives O(1); fp32 sums in another order flip an fp16 or bf16 rounding now and then.
        assert err < 2e-3, (name, err)


@pytest.mark.gpu
@needs_cuda
def test_the_inverse_tiles_change_no_bit():
    # Each output's sum runs over m in the same order whatever the tile, so the two kernels must agree exactly.
    case = cases.CheckCase("v3_tiles_vs_one_output", (200, 65, 9), True, 0.0, "mamba2")
    inputs = cases.make_inputs(case, "cuda", seed=11)
    outputs = []
    for kernel_class in (state_products.WgmmaChunked, OneOutputPerThread):
        output, new_state = cases.poisoned_outputs(case, "cuda")
        token_serial.run_kernel(kernel_class, *inputs.values(), output, new_state)
        outputs.append((output, new_state))
    torch.cuda.synchronize()
    assert torch.isfinite(outputs[0][0].float()).all() and torch.isfinite(outputs[0][1]).all()
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
