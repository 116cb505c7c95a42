"""GDN's WY-prepass path with its chain on warpgroup MMA (kernels/gdn_prefill/wgmma_value_side.py, candidate
`cand_wgmma_value_side`): one CTA per (sequence, head), the state an fp32 accumulator of two warpgroups.

CPU: the layout facts the kernel relies on, traced from CuTe's own layouts for every thread (each accumulator
it hands to the next product's register A holds the same coordinates in the same order; one swizzled copy of
the keys is both B operands that read them), and it compiles for sm_90a and caches. The GPU checks (every
check case under the contest rule, CUDA-graph replay with new bounds) are test_gdn_prefill_kernel.py's: the
module is in its SOLUTIONS.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass.cute.runtime import make_fake_compact_tensor

from hopperbench.devcheck import load_folder_module, load_module_by_path
from hopperbench.paths import REPO_ROOT
from tests.kernels.compile_checks import assert_compiles_and_caches

value_side = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "wgmma_value_side")
wy_prepass = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "wy_prepass")
cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
HEAD_SIZE, CHUNK = value_side.HEAD_SIZE, value_side.CHUNK


def _probe(body) -> None:
    """Trace `body` (a @cute.jit function of one unused tensor) at compile time."""
    cute.compile(body, make_fake_compact_tensor(cutlass.Float32, (4,), assumed_align=16), options="--gpu-arch sm_90a")


@pytest.mark.parametrize("warpgroups", [value_side.NUM_WARPGROUPS, 4])
def test_every_accumulator_hand_over_is_element_wise_in_order(warpgroups):
    """The kernel converts an accumulator into the next product's register A by index: the state [v, k] into
    the A of Yk^T, Yq^T (K = 128); [v, token] accumulators into the A of V'^T, O^T and of the state update
    (K = 64 tokens). Each needs the same coordinates in the same order, in every thread: for the chain's 128
    state rows and the context-parallel summary's 256 (4 warpgroups)."""
    traced: dict[int, list[tuple[list, list]]] = {}
    rows = 64 * warpgroups

    @cute.jit
    def body(unused: cute.Tensor):
        update, products, *_ = value_side.operands(warpgroups)
        pairs = (
            (update, (rows, HEAD_SIZE), products, (rows, HEAD_SIZE)),
            (products, (rows, CHUNK), products, (rows, CHUNK)),
            (products, (rows, CHUNK), update, (rows, CHUNK)),
        )
        for tid in cutlass.range_constexpr(128 * warpgroups):
            traced[tid] = []
            for c_mma, c_tile, a_mma, a_tile in pairs:
                c = c_mma.get_slice(tid).partition_C(cute.make_identity_tensor(c_tile))
                a = a_mma.get_slice(tid).partition_A(cute.make_identity_tensor(a_tile))
                traced[tid].append(([tuple(c[i]) for i in range(cute.size(c))], [tuple(a[i]) for i in range(cute.size(a))]))

    _probe(body)
    assert len(traced) == 128 * warpgroups
    for tid, hand_overs in traced.items():
        for number, (c_coords, a_coords) in enumerate(hand_overs):
            assert c_coords == a_coords and len(c_coords) > 0, (tid, number)
    # and the threads together hold the whole state once
    held = sorted(c for hand_overs in traced.values() for c in hand_overs[0][0])
    assert held == [(v, k) for v in range(rows) for k in range(HEAD_SIZE)]


def test_one_swizzled_copy_of_the_keys_is_both_b_operands():
    """Keys [token, k] are stored once: the K-major B of K S^T and the MN-major B of the state update read the
    same element at the same offset, and T and P share the swizzle."""
    offsets: list[tuple[int, int]] = []
    swizzles: list[str] = []

    @cute.jit
    def body(unused: cute.Tensor):
        *_, keys_k_major, keys_mn_major, square = value_side.operands()
        swizzles.extend(str(layout.inner) for layout in (keys_k_major, keys_mn_major, square))
        for token in cutlass.range_constexpr(CHUNK):
            for col in cutlass.range_constexpr(HEAD_SIZE):
                offsets.append((keys_k_major.outer((token, col, 0)), keys_mn_major.outer((col, token, 0))))

    _probe(body)
    assert len(set(swizzles)) == 1 and swizzles[0] == "S<3,4,3>"
    assert all(a == b for a, b in offsets)
    assert sorted(a for a, _ in offsets) == list(range(CHUNK * HEAD_SIZE))


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(value_side.compile_only, 1)


def test_an_output_off_a_16_byte_boundary_goes_to_the_element_wise_chain(monkeypatch: pytest.MonkeyPatch):
    """The kernel stores output rows in 16-B pieces, compiled for a 16-B-aligned `output`; a view that starts
    elsewhere is served by `wy_prepass.py`'s chain (same values) instead of faulting."""
    calls = []
    monkeypatch.setattr(wy_prepass, "run", lambda *args: calls.append(args))
    case = cases.CheckCase("len600_15", (40,) * 15, True, 0.0, "mamba2")
    inputs = cases.make_inputs(case, "cpu", seed=3)
    output, new_state = cases.poisoned_outputs(case, "cpu")
    shifted = torch.empty(output.numel() + 1, dtype=output.dtype)[1:].view(output.shape)
    assert shifted.data_ptr() % value_side.OUTPUT_ALIGN != 0 and shifted.is_contiguous()
    value_side.run(*inputs.values(), shifted, new_state)
    assert len(calls) == 1 and calls[0][-2] is shifted and calls[0][-1] is new_state
