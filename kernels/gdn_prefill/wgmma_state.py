"""GDN design v3, step 1 (NOTES.md, "Design v3"): the state products of one chunk on Hopper's warpgroup MMA,
with the 128 x 128 state held as an fp32 WGMMA accumulator by two warpgroups (64 value rows each).

Not used by `kernel.py`: a building block with its own GPU test against `chunked_model.py`'s algebra, so
that the next steps (the key side and the inverse, the chunk loop, varlen) start from products known to
be right. For one chunk of one (sequence, v-head), with S0 [V = 128, K = 128] fp32, keys and queries
[C = 64, K] and the carried corrected values Vc [C, V] in fp16:

    Yk = K S0^T,  Yq = Q S0^T            [C, V]: m64n64k16 x 8, A = S0 in registers
    S1 = g S0 + Vc^T K                   [V, K]: m64n128k16 x 4, A = Vc^T and B = K from shared memory

Two layout facts make this cheap, and the CPU tests check both on CuTe's own layouts:
- the state accumulator's fragment (the C of the m64n128 product, two warpgroups along M) holds, in
  every thread, exactly the coordinates of the A fragment of the m64n64 products over K = 128, in the
  same order: converting the state into their operand is an element-wise fp32 -> fp16 in registers;
- one copy of the keys in shared memory, 128-B swizzled with k contiguous, is both the K-major B of
  K S0^T (N = tokens, K = k) and the MN-major B of Vc^T K (N = k, K = tokens).
The rounding points are the model's: S0 and the operands in fp16, fp32 accumulation.
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float16, Float32
from cutlass.cute.nvgpu import warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from cutlass.tensor_utils import LayoutEnum

__all__ = ["CHUNK", "HEAD_SIZE", "NUM_THREADS", "compiled_for", "operands", "run"]

GPU_ARCH = "sm_90a"
CHUNK = 64  # tokens per chunk
HEAD_SIZE = 128  # K = V = 128
NUM_WARPGROUPS = 2  # each owns 64 of the 128 value rows of the state
NUM_THREADS = 128 * NUM_WARPGROUPS
K_STEPS_STATE = HEAD_SIZE // 16  # k16 steps of K S0^T over k
K_STEPS_UPDATE = CHUNK // 16  # k16 steps of Vc^T K over the tokens

K_MAJOR = LayoutEnum.ROW_MAJOR
MN_MAJOR = LayoutEnum.COL_MAJOR


@cute.jit
def operands():
    """(state MMA, products MMA, keys as the products' B, keys as the state MMA's B, Vc^T as its A):
    the two tiled MMAs over both warpgroups and the 128-B-swizzled shared-memory layouts."""
    state_mma = sm90_utils.make_trivial_tiled_mma(
        Float16, Float16, MN_MAJOR.sm90_mma_major_mode(), MN_MAJOR.sm90_mma_major_mode(), Float32,
        (NUM_WARPGROUPS, 1, 1), tiler_mn=(64, HEAD_SIZE),
    )  # fmt: skip
    products_mma = sm90_utils.make_trivial_tiled_mma(
        Float16, Float16, K_MAJOR.sm90_mma_major_mode(), K_MAJOR.sm90_mma_major_mode(), Float32,
        (NUM_WARPGROUPS, 1, 1), tiler_mn=(64, CHUNK), a_source=warpgroup.OperandSource.RMEM,
    )  # fmt: skip
    keys_k_major = sm90_utils.make_smem_layout_b(K_MAJOR, (HEAD_SIZE, CHUNK, HEAD_SIZE), Float16, 1)
    keys_mn_major = sm90_utils.make_smem_layout_b(MN_MAJOR, (HEAD_SIZE, HEAD_SIZE, CHUNK), Float16, 1)
    values_t = sm90_utils.make_smem_layout_a(MN_MAJOR, (HEAD_SIZE, HEAD_SIZE, CHUNK), Float16, 1)
    return state_mma, products_mma, keys_k_major, keys_mn_major, values_t


class StateProductsSm90:
    """`launch(s0, k, q, vc, g_last, yk, yq, s1, stream)` for one chunk: s0/s1 [128, 128] fp32 (v, k),
    k/q [64, 128] fp16 (token, k), vc [64, 128] fp16 (token, v), yk/yq [64, 128] fp32 (token, v)."""

    @cute.jit
    def launch(self, s0, k, q, vc, g_last: Float32, yk, yq, s1, stream):
        state_mma, products_mma, keys_k_major, keys_mn_major, values_t = operands()
        tile = cute.cosize(keys_k_major.outer)

        @cute.struct
        class SharedStorage:
            keys: cute.struct.Align[cute.struct.MemRange[Float16, tile], 1024]
            queries: cute.struct.Align[cute.struct.MemRange[Float16, tile], 1024]
            values: cute.struct.Align[cute.struct.MemRange[Float16, tile], 1024]

        self.kernel(
            s0, k, q, vc, g_last, yk, yq, s1, state_mma, products_mma, keys_k_major, keys_mn_major, values_t,
            SharedStorage,
        ).launch(grid=[1, 1, 1], block=[NUM_THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        s0: cute.Tensor,
        k: cute.Tensor,
        q: cute.Tensor,
        vc: cute.Tensor,
        g_last: Float32,
        yk: cute.Tensor,
        yq: cute.Tensor,
        s1: cute.Tensor,
        state_mma: cute.TiledMma,
        products_mma: cute.TiledMma,
        keys_k_major: cute.ComposedLayout,
        keys_mn_major: cute.ComposedLayout,
        values_t: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        s_keys = storage.keys.get_tensor(keys_k_major.outer, swizzle=keys_k_major.inner)  # (token, k, 1)
        s_keys_mn = storage.keys.get_tensor(keys_mn_major.outer, swizzle=keys_mn_major.inner)  # (k, token, 1)
        s_queries = storage.queries.get_tensor(keys_k_major.outer, swizzle=keys_k_major.inner)
        s_values_t = storage.values.get_tensor(values_t.outer, swizzle=values_t.inner)  # (v, token, 1)

        # Element-wise loads through the swizzled views (a prototype: correctness, not bandwidth).
        for i in cutlass.range_constexpr(CHUNK * HEAD_SIZE // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            token = linear // HEAD_SIZE
            col = linear % HEAD_SIZE
            s_keys[token, col, 0] = k[token, col]
            s_queries[token, col, 0] = q[token, col]
            s_values_t[col, token, 0] = vc[token, col]
        cute.arch.fence_view_async_shared()  # the generic-proxy stores, before the tensor core reads them
        cute.arch.sync_threads()

        # The state as the m64n128 accumulator of both warpgroups, and its fp16 copy as the A operand of
        # the m64n64 products: the same coordinates in the same order in every thread (CPU-tested).
        thr_state = state_mma.get_slice(tidx)
        thr_products = products_mma.get_slice(tidx)
        state = cute.make_rmem_tensor(thr_state.partition_shape_C((HEAD_SIZE, HEAD_SIZE)), Float32)
        state_coords = thr_state.partition_C(cute.make_identity_tensor((HEAD_SIZE, HEAD_SIZE)))
        for i in cutlass.range_constexpr(cute.size(state)):
            v_row, k_col = state_coords[i]
            state[i] = s0[v_row, k_col]
        state_a = cute.make_rmem_tensor(thr_products.partition_shape_A((HEAD_SIZE, HEAD_SIZE)), Float16)
        for i in cutlass.range_constexpr(cute.size(state)):
            state_a[i] = state[i].to(Float16)

        # Yk^T = S0 K^T and Yq^T = S0 Q^T: [v, token] accumulators.
        t_keys = products_mma.make_fragment_B(thr_products.partition_B(s_keys))
        t_queries = products_mma.make_fragment_B(thr_products.partition_B(s_queries))
        yk_acc = cute.make_rmem_tensor(thr_products.partition_shape_C((HEAD_SIZE, CHUNK)), Float32)
        yq_acc = cute.make_rmem_tensor(thr_products.partition_shape_C((HEAD_SIZE, CHUNK)), Float32)
        warpgroup.fence()
        for acc, t_b in ((yk_acc, t_keys), (yq_acc, t_queries)):
            products_mma.set(warpgroup.Field.ACCUMULATE, False)
            for step in cutlass.range_constexpr(K_STEPS_STATE):
                cute.gemm(products_mma, acc, state_a[None, None, step], t_b[None, None, step, 0], acc)
                products_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

        # S1 = g S0 + Vc^T K, accumulated onto the state (issued while the products finish).
        for i in cutlass.range_constexpr(cute.size(state)):
            state[i] = state[i] * g_last
        t_values = state_mma.make_fragment_A(thr_state.partition_A(s_values_t))
        t_keys_mn = state_mma.make_fragment_B(thr_state.partition_B(s_keys_mn))
        state_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.fence()
        for step in cutlass.range_constexpr(K_STEPS_UPDATE):
            cute.gemm(state_mma, state, t_values[None, None, step, 0], t_keys_mn[None, None, step, 0], state)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        product_coords = thr_products.partition_C(cute.make_identity_tensor((HEAD_SIZE, CHUNK)))
        for i in cutlass.range_constexpr(cute.size(yk_acc)):
            v_row, token = product_coords[i]
            yk[token, v_row] = yk_acc[i]
            yq[token, v_row] = yq_acc[i]
        for i in cutlass.range_constexpr(cute.size(state)):
            v_row, k_col = state_coords[i]
            s1[v_row, k_col] = state[i]


_COMPILED: dict[str, Callable] = {}


def compiled_for(arch: str = GPU_ARCH) -> Callable:
    """The compiled launcher for `arch` (compiled on first use; needs no GPU)."""
    fn = _COMPILED.get(arch)
    if fn is None:

        def fake(dtype, shape):
            return make_fake_compact_tensor(dtype, shape, stride_order=(1, 0), assumed_align=16)

        square, chunk = (HEAD_SIZE, HEAD_SIZE), (CHUNK, HEAD_SIZE)
        fn = _COMPILED[arch] = cute.compile(
            StateProductsSm90().launch,
            fake(Float32, square), fake(Float16, chunk), fake(Float16, chunk), fake(Float16, chunk), 1.0,
            fake(Float32, chunk), fake(Float32, chunk), fake(Float32, square),
            make_fake_stream(use_tvm_ffi_env_stream=True),
            options=f"--enable-tvm-ffi --gpu-arch {arch}",
        )  # fmt: skip
    return fn


def run(s0, k, q, vc, g_last: float, yk, yq, s1) -> None:
    """One chunk's state products on the current torch stream (torch tensors of the shapes above)."""
    compiled_for()(s0, k, q, vc, g_last, yk, yq, s1)
