"""kernels/gdn_prefill/warp_chain.py, the candidate for short batches: each warp steps 16 state rows through 16-token
chunks in mma.sync accumulators.

CPU: it compiles for sm_90a without a GPU, without spills or ptxas remarks; the chunk form it computes
(chunked_model.py at C = 16) matches the reference in float64 and passes the track's rule with fp16 operands, as
accurately as 64-token chunks on slow decays and repeated keys; ldmatrix on each of its shared-memory views gives the
MMA fragments (warp_mma_layouts.py); its chain step, transcribed product by product (float64, NaN in unwritten
staging), is the model's chunk step. GPU: the tests of test_gdn_prefill_kernel.py run `warp_chain.run` at every check
case (`warp_chain` is one of KERNEL_CHOICES).
"""

from __future__ import annotations

import collections
import math
import random
import zlib

import cutlass.cute as cute
import pytest
import torch

from hopperbench.devcheck import load_folder_module, load_module_by_path
from hopperbench.paths import REPO_ROOT
from tests.kernels import warp_mma_layouts as layouts
from tests.kernels.compile_checks import assert_compiles_and_caches

cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
device_check = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/probes/device_check_gdn.py", "device_check_gdn")
warp_chain = device_check.load_kernel_module("warp_chain")
chunked = device_check.load_kernel_module("chunked")
model = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/chunked_model.py", "gdn_chunked_model")
reference_run = cases.load_reference_run()


def _inputs(case):
    return cases.make_inputs(case, "cpu", seed=zlib.crc32(case.name.encode()) % 1000)


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(warp_chain.compile_only, 3)


def test_ptxas_keeps_it_in_registers():
    ptxas_report = load_module_by_path(REPO_ROOT / "tools/ptxas_report.py", "ptxas_report_for_warp_chain")
    entries = ptxas_report.compile_track("gdn_prefill", "warp_chain")
    kernels = (warp_chain._NarrowWarpChain(), warp_chain._WarpChain(), warp_chain._AdaptiveWarpChain())
    assert [e.kernel for e in entries] == [f"kernel_warp_chain{type(k).__name__}" for k in kernels]
    for entry, kernel in zip(entries, kernels):
        assert entry.spill_stores == 0 and not entry.remarks
        assert entry.registers * kernel.num_threads <= 64 * 1024  # the step and key warps' CTA fits an SM


def test_one_cta_fits_an_sm(monkeypatch):
    # A fresh load of the folder, so that the launcher is traced again and its shared storage seen.
    fresh = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_warp_chain_smem", "warp_chain")
    sizes = []
    launch_grid = fresh._Chunked.launch_grid

    def spy(kernel, grid, SharedStorage, stream, threads=128, min_blocks=0):
        sizes.append((SharedStorage.size_in_bytes(), threads))
        return launch_grid(kernel, grid, SharedStorage, stream, threads, min_blocks)

    monkeypatch.setattr(fresh._Chunked, "launch_grid", staticmethod(spy))
    fresh.compile_only("sm_90a")
    sm_smem, cta_reserved = 228 * 1024, 1024  # H100 / H200: shared memory an SM, and the driver's per-CTA reserve
    kernels = (warp_chain._NarrowWarpChain(), warp_chain._WarpChain(), warp_chain._AdaptiveWarpChain())
    assert [threads for _, threads in sizes] == [kernel.num_threads for kernel in kernels] == [160, 256, 384]
    assert all(smem + cta_reserved <= sm_smem for smem, _ in sizes)


def test_narrow_ctas_take_the_batches_whose_16_row_grid_fits_the_gpu():
    narrow = warp_chain._NarrowWarpChain()
    assert narrow.rows_per_cta == narrow.slice_rows == warp_chain.ROWS_PER_WARP and narrow.step_warps == 1
    ctas_per_sequence = narrow.ctas_per_sequence
    assert ctas_per_sequence == 64
    assert warp_chain.NARROW_MAX_SEQS * ctas_per_sequence <= chunked.NUM_SMS < (warp_chain.NARROW_MAX_SEQS + 1) * 64


def test_adaptive_ctas_take_the_batches_whose_slice_grid_outgrows_the_gpu():
    adaptive = warp_chain._AdaptiveWarpChain()
    ctas_per_sequence = adaptive.ctas_per_sequence
    assert ctas_per_sequence == warp_chain._WarpChain().ctas_per_sequence == 16
    assert adaptive.rows_per_cta == warp_chain.HEAD_SIZE and adaptive.adaptive
    from_seqs = warp_chain.ADAPTIVE_FROM_SEQS
    assert (from_seqs - 1) * ctas_per_sequence <= chunked.NUM_SMS < from_seqs * ctas_per_sequence
    # the long sequences fill a wave of slice CTAs once the one at WAVE_RANK is long
    assert warp_chain.WAVE_RANK * ctas_per_sequence <= chunked.NUM_SMS < (warp_chain.WAVE_RANK + 1) * ctas_per_sequence


def test_is_a_solution_the_gpu_tests_run():
    assert "warp_chain" in device_check.KERNEL_CHOICES


# ------------------------------------------------------------------------------------------------
# The 16-token chunk form
# ------------------------------------------------------------------------------------------------

# Lengths around the chunk and the group (64 tokens), empty sequences, with and without a state.
SHORT_CASES = [
    cases.CheckCase("w_len1_15_16_17", (1, 15, 16, 17), True, 0.05, "mamba2"),
    cases.CheckCase("w_len40_0_64_65", (40, 0, 64, 65), True, 0.0, "slow_decay"),
    cases.CheckCase("w_len33_fast_nostate", (33, 7), False, 0.0, "fast_decay"),
    cases.CheckCase("w_len40_repeated", (40,), True, 0.0, "slow_decay", keys="repeated"),
]


@pytest.mark.parametrize("case", SHORT_CASES, ids=lambda c: c.name)
def test_sixteen_token_chunks_are_the_recurrence(case):
    inputs = _inputs(case)
    out, new_state = model.run(*inputs.values(), precision=model.EXACT, chunk=warp_chain.CHUNK)
    ref_out, ref_state = reference_run(*inputs.values())
    assert (new_state - ref_state).abs().max() < 1e-5
    assert (out.float() - ref_out.float()).abs().max() <= 2e-3
    for n, length in enumerate(case.lengths):
        if length == 0:
            assert torch.count_nonzero(new_state[n]) == 0


@pytest.mark.parametrize("case", SHORT_CASES, ids=lambda c: c.name)
def test_sixteen_token_chunks_pass_with_fp16_operands(case):
    inputs = _inputs(case)
    result = cases.compare(
        *model.run(*inputs.values(), precision=model.KERNEL, chunk=warp_chain.CHUNK), *reference_run(*inputs.values())
    )
    assert result.passed, result
    assert result.outputs["new_state"].max_abs_err < 2e-3 and result.outputs["output"].max_abs_err < 2e-3


def test_sixteen_token_chunks_are_as_accurate_as_64_over_a_long_ill_conditioned_sequence():
    # One key repeated over each 64 tokens, beta 0.95, decays within 4e-4 of 1: the case closest to the rule for the
    # 64-token form (NOTES.md). Four times the chunks, each inverse better conditioned.
    case = cases.CheckCase("w_repeated1024_slow", (1024,), True, 0.0, "slow_decay", keys="repeated")
    inputs = _inputs(case)
    reference = reference_run(*inputs.values())
    errors = {}
    for chunk in (warp_chain.CHUNK, model.CHUNK):
        result = cases.compare(*model.run(*inputs.values(), precision=model.KERNEL, chunk=chunk), *reference)
        assert result.passed, result
        errors[chunk] = result.outputs["new_state"].max_abs_err
    assert errors[warp_chain.CHUNK] <= 1.1 * errors[model.CHUNK]


# ------------------------------------------------------------------------------------------------
# The kernel's index maps and schedule
# ------------------------------------------------------------------------------------------------


def _rows(view):
    """A 3-D per-chunk view as the 2-D [chunks * rows, cols] buffer it tiles (its chunks are rows apart)."""
    (chunks, rows, cols), (chunk_stride, row_stride, one) = view
    assert chunk_stride == rows * row_stride and one == 1
    return (chunks * rows, cols), (row_stride, 1)


CHUNKS = range(warp_chain.GROUP_CHUNKS)
LDMATRIX_OPERANDS = [
    ("k rows: Gram A and B, (K S0^T)^T B", "A", warp_chain.KQ_VIEW, (16, 128), [(2 * c, 0) for c in CHUNKS]),
    ("k rows as B", "B", warp_chain.KQ_VIEW, (16, 128), [(2 * c, 0) for c in CHUNKS]),
    ("q rows: Gram A, (Q S0^T)^T B", "A", warp_chain.KQ_VIEW, (16, 128), [(2 * c + 1, 0) for c in CHUNKS]),
    ("q rows as B", "B", warp_chain.KQ_VIEW, (16, 128), [(2 * c + 1, 0) for c in CHUNKS]),
    ("K read transposed: the update's B", "Bt", warp_chain.KQ_T_VIEW, (128, 16), [(0, 2 * c) for c in CHUNKS]),
    ("T, P of each chunk: B of V' and O", "B", _rows(warp_chain.TILES_VIEW), (16, 16), [(c, 0) for c in CHUNKS]),
]


@pytest.mark.parametrize("operand", LDMATRIX_OPERANDS, ids=lambda o: o[0])
def test_ldmatrix_loads_give_the_mma_fragments(operand):
    layouts.check_ldmatrix_operand(chunked._make_warp_mma, chunked._make_operand_copies, *operand)


@pytest.mark.parametrize("tile", [(16, 128), (16, 16)], ids=str)
def test_accumulators_hand_over_to_the_a_operand_in_registers_in_every_lane(tile):
    # S0 -> the state products' A ([16, 128]); Xb^T, V'^T, V'c^T -> the next product's A ([16, 16]): element i of
    # a lane's A fragment is element order[i] of its accumulator, the order traced on lane 0.
    def body(records):
        tiled_mma = chunked._make_warp_mma()
        records.append(warp_chain.hand_over_order(tiled_mma, tile))
        for lane in range(32):
            thr = tiled_mma.get_slice(lane)
            identity = cute.make_identity_tensor(tile)
            records.append((layouts.coords(thr.partition_A(identity)), layouts.coords(thr.partition_C(identity))))

    order, *lanes = layouts.trace(body)
    assert sorted(order) == list(range(tile[0] * tile[1] // 32))
    for a_coords, c_coords in lanes:
        assert a_coords == [c_coords[i] for i in order]


def test_staged_buffers_keep_ldmatrix_rows_aligned():
    # Per-chunk tiles and the second stage of the staged rows start 16-B aligned.
    stages = (warp_chain.KQ_ROWS * warp_chain.WIDE_STRIDE, warp_chain.GROUP_TOKENS * 4 * 16)  # kq; v at 4 warps
    for elems in (warp_chain.CHUNK * warp_chain.TILE_STRIDE, *stages):
        assert (2 * elems) % 16 == 0
    # 48-B rows of 16: the 8 rows of an 8 x 8 matrix start on 8 distinct 16-B bank groups.
    assert len({(r * 2 * warp_chain.TILE_STRIDE // 16) % 8 for r in range(8)}) == 8


def _chain_step(S, kq, raw_v, G, beta, T, P, first: int, tokens_here: int, scale: float):
    """`_WarpChain.chain_step` for one warp's 16 rows, product by product (warp_gemm(a, b) is a @ b^T), float64.
    kq [128, 128] holds the group's fp16 rows as `kq_piece` places them; raw_v [64, 16] the warp's values (NaN past
    the end); G, beta [64] the gates. Returns (O^T [16 rows, 16 tokens] scaled, next S)."""
    c = first // warp_chain.CHUNK
    k_rows, q_rows = kq[32 * c : 32 * c + 16], kq[32 * c + 16 : 32 * c + 32]
    k_cols = kq.T[:, 32 * c : 32 * c + 16]  # kq_t's tile
    g, bt = G[first : first + 16], beta[first : first + 16]
    real = torch.arange(16) < tokens_here
    acc_y = S @ k_rows.T
    acc_o = (S @ q_rows.T) * torch.exp(g)[None, :]
    xb = torch.where(real[None, :], bt[None, :] * (raw_v[first : first + 16].T - torch.exp(g)[None, :] * acc_y), 0.0)
    vn = xb @ T.T
    vnc = vn * torch.exp(g[-1] - g)[None, :]
    acc_o = acc_o + vn @ P.T
    return scale * acc_o, torch.exp(g[-1]) * S + vnc @ k_cols.T


@pytest.mark.parametrize("length", [1, 16, 23, 40, 64])
def test_chain_step_schedule_is_the_model_chunk_step(length):
    generator = torch.Generator().manual_seed(length)
    f64 = torch.float64
    q = torch.nn.functional.normalize(torch.randn(length, 128, generator=generator, dtype=f64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(length, 128, generator=generator, dtype=f64), dim=-1)
    v = torch.randn(length, 16, generator=generator, dtype=f64)
    log_g = -torch.rand(length, generator=generator, dtype=f64) * 0.1
    beta = torch.rand(length, generator=generator, dtype=f64)
    S = torch.randn(16, 128, generator=generator, dtype=f64) * 0.2
    scale = 1 / math.sqrt(128)
    # The group's staging as the kernel leaves it: converted kq rows (zero past the end), values NaN past it.
    kq = torch.full((warp_chain.KQ_ROWS, 128), math.nan, dtype=f64)
    raw_v = torch.full((warp_chain.GROUP_TOKENS, 16), math.nan, dtype=f64)
    raw_v[:length] = v
    G = torch.zeros(warp_chain.GROUP_TOKENS, dtype=f64)
    gate_beta = torch.zeros(warp_chain.GROUP_TOKENS, dtype=f64)
    S_model = S.clone()[None]  # [heads, rows, 128]
    for first in range(0, length, 16):
        c, n = first // 16, min(16, length - first)
        pad = lambda x: torch.cat([x[first : first + n], torch.zeros(16 - n, *x.shape[1:], dtype=f64)])  # noqa: E731
        kq[32 * c : 32 * c + 16], kq[32 * c + 16 : 32 * c + 32] = pad(k), pad(q)
        G[first : first + 16] = torch.cumsum(pad(log_g), 0)  # the chunk-local scan, 0 past the end
        gate_beta[first : first + 16] = pad(beta)
        # The key side of `chunk_key_side`: A (strictly lower), P (lower), T by forward substitution.
        g = G[first : first + 16]
        decay = torch.exp(torch.clamp(g[:, None] - g[None, :], max=0.0))
        k_rows, q_rows = kq[32 * c : 32 * c + 16], kq[32 * c + 16 : 32 * c + 32]
        lower = torch.ones(16, 16, dtype=torch.bool).tril()
        A = torch.where(lower.tril(-1), gate_beta[first : first + 16, None] * decay * (k_rows @ k_rows.T), 0.0)
        P = torch.where(lower, decay * (q_rows @ k_rows.T), 0.0)
        T = torch.linalg.solve_triangular(torch.eye(16, dtype=f64) + A, torch.eye(16, dtype=f64), upper=False)
        out_t, S = _chain_step(S, kq, raw_v, G, gate_beta, T, P, first, n, scale)
        ref_out, S_model = model.chunk_step(
            S_model, pad(q)[None], pad(k)[None], pad(v)[None], pad(log_g)[None], pad(beta)[None], scale,
            model.EXACT,
        )  # fmt: skip
        assert not torch.isnan(out_t).any() and not torch.isnan(S).any()
        assert torch.allclose(out_t.T[:n], ref_out[0, :n], atol=1e-12)
        assert torch.allclose(S, S_model[0], atol=1e-12)


def test_the_copy_and_conversion_loops_cover_the_kq_rows_once():
    # `load_group` and `convert_kq_rows` walk the same (row, piece) of `kq_piece` per thread and round, so that each
    # thread converts in place exactly what it copied; the rows of chunk c are its 16 k rows, then its 16 q rows.
    kernel = warp_chain._WarpChain()
    threads = kernel.copy_threads
    rounds = -(-warp_chain.KQ_ROWS * chunked.PIECES_PER_ROW // threads)

    def body(records):
        for tidx in range(threads):
            for i in range(rounds):
                records.append(kernel.kq_piece(i * threads + tidx))

    pieces = [p for p in layouts.trace(body) if p[0] < warp_chain.KQ_ROWS]
    assert sorted((row, piece) for row, piece, _, _ in pieces) == [
        (row, piece) for row in range(warp_chain.KQ_ROWS) for piece in range(chunked.PIECES_PER_ROW)
    ]
    c = warp_chain.CHUNK
    for row, _, token, is_q in pieces:
        chunk, within = divmod(row, 2 * c)
        assert bool(is_q) == (within >= c) and token == chunk * c + within % c


# ------------------------------------------------------------------------------------------------
# The key warps / step warps protocol
# ------------------------------------------------------------------------------------------------


def _role_ops(role: str, num_groups: int) -> list[tuple]:
    """The named-barrier and staging operations of `key_role` / `step_role` in program order, with the kernel's own
    predicates for the FREE barrier: ("copy", stage, group) writes a stage, ("keys", group) converts the group's stage
    in place and writes its key buffer, ("steps", group) reads both."""
    kb, stages = warp_chain.KEY_BUFFERS, warp_chain.NUM_STAGES
    ops: list[tuple] = []
    if role == "key":
        if num_groups > 0:
            ops.append(("copy", 0, 0))
        for g in range(num_groups):
            if warp_chain.key_waits_for_free(g):
                ops.append(("sync", warp_chain.FREE_BARRIER + g % kb))
            if g + 1 < num_groups:
                ops.append(("copy", (g + 1) % stages, g + 1))
            ops += [("keys", g), ("arrive", warp_chain.READY_BARRIER + g % kb)]
    else:
        for g in range(num_groups):
            ops += [("sync", warp_chain.READY_BARRIER + g % kb), ("steps", g)]
            if warp_chain.steps_signal_free(g, num_groups):
                ops.append(("arrive", warp_chain.FREE_BARRIER + g % kb))
    return ops


@pytest.mark.parametrize("num_groups", range(8))
def test_key_and_step_warps_never_deadlock_race_or_leave_arrivals(num_groups):
    # Random interleavings of the two roles under bar.sync / bar.arrive semantics (a sync waits until the other role
    # has reached the same phase of its barrier). Checked: progress; neither role a phase ahead on a barrier (256
    # arrivals from one role would complete it); a stage or key buffer rewritten only after the steps are done with
    # the group it held; the steps read the group's own stage and key buffer; no arrival left over at exit.
    kb, stages = warp_chain.KEY_BUFFERS, warp_chain.NUM_STAGES
    for seed in range(200):
        rng = random.Random(seed)
        ops = {role: _role_ops(role, num_groups) for role in ("key", "step")}
        pos = dict.fromkeys(ops, 0)
        reached = {role: collections.Counter() for role in ops}
        holder: dict[tuple, int] = {}
        steps_done = -1
        while any(pos[r] < len(ops[r]) for r in ops):
            runnable = [
                r for r in ops
                if pos[r] < len(ops[r])
                and not (ops[r][pos[r]][0] == "sync"
                         and reached[_other(r)][ops[r][pos[r]][1]] <= reached[r][ops[r][pos[r]][1]])
            ]  # fmt: skip
            assert runnable, f"deadlock at {pos}"
            role = rng.choice(runnable)
            kind, *args = ops[role][pos[role]]
            pos[role] += 1
            if kind in ("sync", "arrive"):
                reached[role][args[0]] += 1
                assert reached[role][args[0]] <= reached[_other(role)][args[0]] + 1
            elif kind == "copy":
                stage, group = args
                assert steps_done >= group - stages
                holder["stage", stage] = group
            elif kind == "keys":
                (group,) = args
                assert holder["stage", group % stages] == group and steps_done >= group - kb
                holder["buffer", group % kb] = group
            else:
                (group,) = args
                assert holder["stage", group % stages] == group and holder["buffer", group % kb] == group
                steps_done = group
        assert steps_done == num_groups - 1 and reached["key"] == reached["step"]


def _other(role: str) -> str:
    return "step" if role == "key" else "key"
