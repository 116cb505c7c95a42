"""kernels/gdn_prefill/fused_chain.py (candidate `cand_fused_chain`): the WGMMA chain with its key side inside the CTA.

CPU: each operand buffer's two views of the keys address the same elements, and one buffer of keys is the same
canonical layout read as the Gram products' A operand as read as their B operand; the register split after
setmaxnreg is the launch allocation (an increase the CTA's pool cannot grant hangs the chain); it compiles for
sm_90a and caches; the candidate replaces only the WGMMA chain. GPU: its outputs and states equal the two-kernel
path's bit for bit (on the H200 the WGMMA Grams sum as the `mma.sync` tiles do); its checks against the reference
are test_gdn_prefill_kernel.py's, which run every module of `KERNEL_CHOICES`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass.cute.runtime import make_fake_compact_tensor

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT
from tests.kernels.compile_checks import assert_compiles_and_caches

cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
device_check = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/probes/device_check_gdn.py", "device_check_gdn")
fused_chain = device_check.load_kernel_module("fused_chain")
kernel = fused_chain.kernel
wgmma_value_side = fused_chain.wgmma_value_side
HEAD_SIZE, CHUNK = fused_chain.HEAD_SIZE, fused_chain.CHUNK

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
REGISTER_FILE = 64 * 1024  # 32-bit registers of an SM, and of the one CTA it holds


def test_each_buffer_of_keys_is_both_b_operands():
    offsets: dict[int, list[tuple[int, int]]] = {}

    @cute.jit
    def body(unused: cute.Tensor):
        keys, keys_mn, square = fused_chain.buffered_layouts()
        assert str(keys.inner) == str(keys_mn.inner) == str(square.inner) == "S<3,4,3>"
        for buffer in cutlass.range_constexpr(fused_chain.NUM_BUFFERS):
            offsets[buffer] = [
                (keys.outer((token, col, (0, buffer))), keys_mn.outer((col, token, (0, buffer))))
                for token in range(CHUNK)
                for col in range(HEAD_SIZE)
            ]

    cute.compile(body, make_fake_compact_tensor(cutlass.Float32, (4,), assumed_align=16), options="--gpu-arch sm_90a")
    size = CHUNK * HEAD_SIZE
    for buffer, pairs in offsets.items():
        assert all(k_major == mn_major for k_major, mn_major in pairs), buffer
        assert sorted(k_major for k_major, _ in pairs) == list(range(buffer * size, (buffer + 1) * size))


def test_a_buffer_of_keys_reads_alike_as_the_grams_a_and_b_operands():
    layouts: dict[str, str] = {}

    @cute.jit
    def body(unused: cute.Tensor):
        keys, _, _ = fused_chain.buffered_layouts()
        one_buffer = cute.slice_(keys.outer, (None, None, (None, 0)))
        as_a = fused_chain.sm90_utils.make_smem_layout_a(
            fused_chain.K_MAJOR, (CHUNK, CHUNK, HEAD_SIZE), cutlass.Float16, 1
        )
        layouts["keys"] = str(cute.coalesce(one_buffer))
        layouts["a"] = str(cute.coalesce(cute.slice_(as_a.outer, (None, None, 0))))
        layouts["swizzles"] = f"{keys.inner} {as_a.inner}"

    cute.compile(body, make_fake_compact_tensor(cutlass.Float32, (4,), assumed_align=16), options="--gpu-arch sm_90a")
    assert layouts["keys"] == layouts["a"], layouts
    assert layouts["swizzles"] == "S<3,4,3> S<3,4,3>"


def test_the_register_split_is_the_launch_allocation():
    chain, key, producer = fused_chain.CHAIN_REGISTERS, fused_chain.KEY_REGISTERS, fused_chain.PRODUCER_REGISTERS
    assert all(r % 8 == 0 for r in (chain, key, producer)) and 24 <= producer <= key <= chain <= 256
    # 512 threads start with 128 registers each (a warp's share rounded down to 8 per thread). setmaxnreg.inc
    # waits until the CTA's pool, fed only by this CTA's decreases, holds the registers: a split above the
    # launch allocation hangs the chain warpgroups for good.
    start = REGISTER_FILE // fused_chain.NUM_THREADS // 8 * 8
    assert start == 128
    per_warpgroup = fused_chain.WARPGROUP_THREADS
    assert fused_chain.CHAIN_THREADS * chain + per_warpgroup * (key + producer) == fused_chain.NUM_THREADS * start


def test_every_hand_over_barrier_is_distinct_and_in_range():
    ids = [fused_chain.KEY_SIDE_BARRIER, fused_chain.PRODUCER_BARRIER]
    for base in (fused_chain.READY_BARRIER, fused_chain.FREE_KEY_BARRIER, fused_chain.FREE_PRODUCER_BARRIER,
                 fused_chain.KQ_READY_BARRIER):  # fmt: skip
        ids += [base + buffer for buffer in range(fused_chain.NUM_BUFFERS)]
    # 0 is the CTA's barrier, 1 and 2 value_side's (one per chain warpgroup); the hardware has 16.
    assert len(set(ids)) == len(ids) and min(ids) == 3 and max(ids) < 16


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(fused_chain.compile_only, 1)


def test_the_candidate_replaces_only_the_wgmma_chain(monkeypatch: pytest.MonkeyPatch):
    called = []
    monkeypatch.setattr(fused_chain, "run", lambda *args: called.append("fused_chain"))
    for path in (kernel.token_serial, kernel.chunked, kernel.wy_prepass, kernel.context_parallel):
        monkeypatch.setattr(path, "run", lambda *args, name=path.__name__.rsplit(".", 1)[-1]: called.append(name))

    for num_tokens, num_seqs in ((40, 2), (300, 4), (8192, 32), (1377, 1), (8192, 1)):
        q = torch.empty(num_tokens, 4, 128, device="meta")
        new_state = torch.empty(num_seqs, 8, 128, 128, device="meta")
        fused_chain.run_as_kernel(q, *[None] * 10, new_state)
    assert called == ["token_serial", "chunked", "fused_chain", "wy_prepass", "context_parallel"]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("fifteen_short_and_empty", (1, 0, 63, 64, 65, 7, 128, 0, 200, 3, 64, 1, 90, 31, 129), True,
                        0.0, "mamba2"),  # fmt: skip
        cases.CheckCase("twenty_no_state", tuple(range(5, 405, 20)), False, 0.1, "fast_decay"),
        cases.CheckCase("thirty_two_of_256", (256,) * 32, True, 0.0, "slow_decay"),
        cases.CheckCase("long_among_short", (3000,) + (40,) * 16, True, 0.0, "mamba2"),
    ],
    ids=lambda case: case.name,
)
def test_bit_identical_to_the_two_kernel_path(case):
    results = cases.outputs_of_runs(case, [wgmma_value_side.run, fused_chain.run], "cuda", seed=91)
    (out_two, state_two), (out_fused, state_fused) = results
    assert torch.isfinite(out_fused).all() and torch.isfinite(state_fused).all()
    assert torch.equal(out_fused, out_two)
    assert torch.equal(state_fused, state_two)
