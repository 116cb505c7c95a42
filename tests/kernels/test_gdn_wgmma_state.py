"""GDN design v3, step 1 (kernels/gdn_prefill/wgmma_state.py): one chunk's state products on warpgroup MMA
with the state as an fp32 accumulator of two warpgroups.

CPU: the layout facts the kernel relies on, traced from CuTe's own layouts (the state accumulator's
fragment is the products' A fragment, coordinate for coordinate and in order, in every thread; one
swizzled copy of the keys is both B operands), the one step 2 will rely on (a products accumulator is
the register A of a product over the tokens), and the kernel compiles for sm_90a. GPU (marked `gpu`):
Yk = K S0^T, Yq = Q S0^T and S1 = g S0 + Vc^T K against PyTorch with the model's rounding points
(`chunked_model.py`: S0 and the operands in fp16, fp32 accumulation), outputs NaN-poisoned first.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
import pytest
import torch
from cutlass.cute.nvgpu import warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor
from cutlass.tensor_utils import LayoutEnum

from hopperbench.devcheck import load_folder_module
from hopperbench.paths import REPO_ROOT

state_products = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "wgmma_state")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _probe(body) -> None:
    """Trace `body` (a @cute.jit function of one unused tensor) at compile time."""
    cute.compile(body, make_fake_compact_tensor(cutlass.Float32, (4,), assumed_align=16), options="--gpu-arch sm_90a")


def test_the_state_accumulator_is_the_products_a_operand_in_order():
    traced: dict[int, tuple[list, list]] = {}
    size = state_products.HEAD_SIZE

    @cute.jit
    def body(unused: cute.Tensor):
        state_mma, products_mma, *_ = state_products.operands()
        for tid in cutlass.range_constexpr(state_products.NUM_THREADS):
            c = state_mma.get_slice(tid).partition_C(cute.make_identity_tensor((size, size)))
            a = products_mma.get_slice(tid).partition_A(cute.make_identity_tensor((size, size)))
            traced[tid] = ([tuple(c[i]) for i in range(cute.size(c))], [tuple(a[i]) for i in range(cute.size(a))])

    _probe(body)
    assert len(traced) == state_products.NUM_THREADS
    for tid, (c_coords, a_coords) in traced.items():
        assert len(c_coords) == size * size // state_products.NUM_THREADS
        assert c_coords == a_coords, tid
    # and the threads together hold the whole state once
    assert sorted(c for c_coords, _ in traced.values() for c in c_coords) == [(v, k) for v in range(size) for k in range(size)]


def test_a_products_accumulator_is_the_register_a_operand_of_a_product_over_the_tokens():
    """For step 2 (no kernel yet): V' = (V^T - Yk^T) T^T comes out as a [v, token] accumulator of the
    products' shape and feeds S += V'c K and O += V' P^T as their register A operand (K = tokens): that
    too is an element-wise conversion in every thread."""
    traced: dict[int, tuple[list, list]] = {}
    size, chunk = state_products.HEAD_SIZE, state_products.CHUNK

    @cute.jit
    def body(unused: cute.Tensor):
        _, products_mma, *_ = state_products.operands()
        over_tokens = sm90_utils.make_trivial_tiled_mma(
            cutlass.Float16, cutlass.Float16, LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            LayoutEnum.COL_MAJOR.sm90_mma_major_mode(), cutlass.Float32, (state_products.NUM_WARPGROUPS, 1, 1),
            tiler_mn=(64, size), a_source=warpgroup.OperandSource.RMEM,
        )  # fmt: skip
        for tid in cutlass.range_constexpr(state_products.NUM_THREADS):
            c = products_mma.get_slice(tid).partition_C(cute.make_identity_tensor((size, chunk)))
            a = over_tokens.get_slice(tid).partition_A(cute.make_identity_tensor((size, chunk)))
            traced[tid] = ([tuple(c[i]) for i in range(cute.size(c))], [tuple(a[i]) for i in range(cute.size(a))])

    _probe(body)
    assert len(traced) == state_products.NUM_THREADS
    assert all(c_coords == a_coords and len(c_coords) == size * chunk // state_products.NUM_THREADS
               for c_coords, a_coords in traced.values())  # fmt: skip


def test_one_swizzled_copy_of_the_keys_is_both_b_operands():
    offsets: list[tuple[int, int]] = []
    swizzles: list[str] = []

    @cute.jit
    def body(unused: cute.Tensor):
        *_, keys_k_major, keys_mn_major, values_t = state_products.operands()
        swizzles.extend(str(layout.inner) for layout in (keys_k_major, keys_mn_major, values_t))
        for token in cutlass.range_constexpr(state_products.CHUNK):
            for col in cutlass.range_constexpr(state_products.HEAD_SIZE):
                # (token, k) of the keys in both views, and (v, token) of Vc^T against Vc's (token, v)
                offsets.append((keys_k_major.outer((token, col, 0)), keys_mn_major.outer((col, token, 0))))
                offsets.append((keys_k_major.outer((token, col, 0)), values_t.outer((col, token, 0))))

    _probe(body)
    assert len(set(swizzles)) == 1 and swizzles[0] == "S<3,4,3>"
    assert all(a == b for a, b in offsets)
    assert sorted({a for a, _ in offsets}) == list(range(state_products.CHUNK * state_products.HEAD_SIZE))


def test_compiles_for_sm90a_without_gpu():
    fn = state_products.compiled_for("sm_90a")
    assert callable(fn) and state_products.compiled_for("sm_90a") is fn


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("g_last", [0.83, 1.0])
def test_state_products_match_the_model(g_last):
    generator = torch.Generator(device="cuda").manual_seed(int(g_last * 100))
    size, chunk = state_products.HEAD_SIZE, state_products.CHUNK

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", generator=generator) * scale

    s0 = randn(size, size, scale=0.5)
    k = torch.nn.functional.normalize(randn(chunk, size), dim=-1).half()
    q = torch.nn.functional.normalize(randn(chunk, size), dim=-1).half()
    vc = randn(chunk, size, scale=0.3).half()
    yk, yq = (torch.full((chunk, size), float("nan"), device="cuda") for _ in range(2))
    s1 = torch.full((size, size), float("nan"), device="cuda")
    state_products.run(s0, k, q, vc, g_last, yk, yq, s1)
    torch.cuda.synchronize()

    s0_r = s0.half().float()
    expected = {
        "yk": k.float() @ s0_r.T,
        "yq": q.float() @ s0_r.T,
        "s1": g_last * s0 + vc.float().T @ k.float(),
    }
    for name, got in (("yk", yk), ("yq", yq), ("s1", s1)):
        assert torch.isfinite(got).all(), name
        err = float((got - expected[name]).norm() / expected[name].norm())
        assert err < 1e-4, (name, err)  # a wrong layout gives O(1); fp32 sums in another order ~1e-6
