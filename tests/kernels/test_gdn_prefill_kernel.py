"""Our CuTe-DSL GDN prefill kernel (kernels/gdn_prefill/kernel.py).

CPU: the kernel compiles for sm_90a without a GPU; input validation; the scale rule; the check
cases and the comparison helper the GPU tests rely on (including that ignoring or transposing the
initial state fails them); the kernel's regrouped per-token update against the reference.
GPU (marked `gpu`, skipped without CUDA), for kernel.py and each candidate of the folder
(SOLUTIONS): `run` against our reference on fresh inputs for every case in
kernels/gdn_prefill/check_cases.py with NaN-poisoned outputs (the 65536-token case only with
HOPPERBENCH_LONG_TESTS=1); the input state is left untouched; CUDA-graph capture and replay with new
sequence bounds.
"""

from __future__ import annotations

import functools
import math
import os
import zlib

import pytest
import torch

from hopperbench.devcheck import load_module_by_path, replay_on_fresh_inputs, total_nan
from hopperbench.paths import REPO_ROOT
from tests.kernels.compile_checks import assert_compiles_and_caches

# kernels/ is not a package: load the case helpers and the kernel by path, as the harness does.
cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
kernel = cases.load_kernel()
reference_run = cases.load_reference_run()
device_check = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/probes/device_check_gdn.py", "device_check_gdn")
# kernel.py and each of its four paths alone (and any candidate of the folder): every GPU test below
# runs each of them, so every path is checked at every shape, not only where kernel.py picks it.
SOLUTIONS = device_check.KERNEL_CHOICES


@functools.cache
def solution_module(name: str):
    """kernel.py, or another module of kernels/gdn_prefill loaded as the harness packs it."""
    return kernel if name == "kernel" else device_check.load_kernel_module(name)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LONG_TESTS = os.environ.get("HOPPERBENCH_LONG_TESTS") == "1"


# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------


def test_compiles_every_path_for_sm90a_without_gpu():
    # the warp chain at its three CTA widths, token-serial, the WY-prepass pair at both chain widths, the WGMMA
    # chain, and the context-parallel launcher with each of those three chains
    assert_compiles_and_caches(kernel.compile_only, 10)


@pytest.mark.parametrize(
    ("num_tokens", "num_seqs", "path"),
    [
        (0, 1, "token_serial"), (1, 1, "token_serial"), (21, 1, "token_serial"), (22, 1, "warp_chain"),
        (40, 1, "warp_chain"), (23, 2, "token_serial"), (24, 2, "warp_chain"), (40, 3, "token_serial"),
        (41, 3, "warp_chain"), (40, 40, "token_serial"), (8, 4, "token_serial"), (0, 0, "token_serial"),
        (41, 1, "warp_chain"), (64, 1, "warp_chain"), (501, 1, "warp_chain"), (1377, 1, "warp_chain"),
        (2047, 1, "warp_chain"), (1001, 2, "warp_chain"), (3071, 2, "warp_chain"),
        (461, 2, "warp_chain"), (294, 3, "warp_chain"), (511, 57, "warp_chain"), (3999, 14, "warp_chain"),
        (8192, 20, "warp_chain"), (8192, 57, "warp_chain"), (7500, 15, "warp_chain"),
        (7515, 15, "wgmma_value_side"), (8192, 15, "wgmma_value_side"),
        (1501, 3, "wy_prepass"), (1592, 3, "wy_prepass"), (1699, 3, "wy_prepass"), (1700, 3, "warp_chain"),
        (2284, 3, "warp_chain"), (3600, 3, "warp_chain"), (3601, 3, "wy_prepass"), (3028, 5, "warp_chain"),
        (9600, 8, "warp_chain"), (9601, 8, "wy_prepass"), (4600, 9, "wy_prepass"),
        (2048, 1, "context_parallel"), (65536, 1, "context_parallel"),
        (3072, 2, "context_parallel"), (5709, 2, "context_parallel"), (8192, 3, "wy_prepass"),
    ],
)  # fmt: skip
def test_path_is_chosen_from_the_token_and_sequence_counts(num_tokens, num_seqs, path):
    assert kernel.TOKEN_SERIAL_MAX_TOKENS == 40 and kernel.WGMMA_CHAIN_MIN_SEQS == 15
    assert kernel.CONTEXT_PARALLEL_MIN_TOKENS == {1: 2048, 2: 3072}
    assert kernel.WARP_CHAIN_MAX_MEAN_LENGTH == 500 and kernel.WARP_CHAIN_MIN_TOKENS == {1: 22, 2: 24}
    assert (kernel.MEDIUM_BATCH_SEQS, kernel.MEDIUM_BATCH_MIN_TOKENS, kernel.MEDIUM_BATCH_MAX_MEAN_LENGTH) == (
        range(3, 9), 1700, 1200)
    assert kernel.path_for(num_tokens, num_seqs) is solution_module(path)


def test_the_warp_chain_takes_long_sequences_only_on_its_16_row_ctas():
    # Up to two sequences (16-row CTAs, 64 a sequence) the warp chain takes every length below the context-parallel
    # path's; from three, above a mean of 500 tokens (1200 from 1700 tokens in 3-8 sequences) a sequence's chunks on
    # one chain of a 64-row CTA lose to the WY path's V slices, whatever T and N. No batch of zero sequences.
    assert solution_module("warp_chain").NARROW_MAX_SEQS == 2
    for num_seqs in (0, 1, 2, 3, 5, 8, 9, 14, 15, 57, 130):
        for num_tokens in range(0, 70000, 97):
            if kernel.takes_warp_chain(num_tokens, num_seqs):
                assert not kernel.takes_context_parallel(num_tokens, num_seqs)
                medium = 3 <= num_seqs <= 8 and num_tokens >= 1700
                max_mean_length = None if num_seqs <= 2 else 1200 if medium else 500
                assert num_seqs >= 1 and num_tokens >= 22
                assert max_mean_length is None or num_tokens <= max_mean_length * num_seqs


@pytest.mark.parametrize(
    ("lengths", "path"),
    [((6,), "token_serial"), ((41,), "warp_chain"), ((100, 100), "warp_chain"), ((35,), "warp_chain"),
     ((600, 600), "warp_chain"), ((600, 600, 600), "warp_chain"), ((500, 500, 501), "wy_prepass"),
     ((40,) * 15, "warp_chain"), ((520,) * 15, "wgmma_value_side"), ((2048,), "context_parallel"),
     ((3000, 271), "context_parallel")],
    ids=str,
)  # fmt: skip
def test_run_calls_exactly_the_chosen_path(lengths, path, monkeypatch):
    calls = []
    for name in ("warp_chain", "token_serial", "wy_prepass", "wgmma_value_side", "context_parallel"):
        monkeypatch.setattr(solution_module(name), "run", lambda *args, name=name: calls.append((name, args)))
    num_tokens = sum(lengths)
    case = cases.CheckCase(f"len{num_tokens}", lengths, True, 0.0, "mamba2")
    inputs = cases.make_inputs(case, "cpu", seed=1)
    output, new_state = cases.poisoned_outputs(case, "cpu")
    kernel.run(*inputs.values(), output, new_state)
    assert [name for name, _ in calls] == [path]
    assert calls[0][1][-2] is output and calls[0][1][-1] is new_state


@pytest.mark.parametrize("lanes_per_row", [8, 16])
def test_tiling_covers_every_state_element_once(lanes_per_row):
    # Token-serial path: the slices' rows cover V; the lanes of a row cover K, each with its 8-wide
    # pieces (8 lanes: two pieces 64 apart; 16 lanes: one piece).
    serial = solution_module("token_serial")
    split = serial.RowSplit(lanes_per_row=lanes_per_row)
    assert split.num_slices * split.rows_per_cta == serial.HEAD_SIZE
    assert split.rows_per_cta * split.lanes_per_row == serial.NUM_THREADS
    columns = sorted(
        split.column_piece(piece, lane) * serial.COPY_ELEMS + i
        for lane in range(split.lanes_per_row)
        for piece in range(split.pieces_per_lane)
        for i in range(serial.COPY_ELEMS)
    )
    assert columns == list(range(serial.HEAD_SIZE))
    assert split.cols_per_lane == split.pieces_per_lane * serial.COPY_ELEMS


def test_token_serial_path_splits_each_row_over_16_lanes():
    # 8-row slices, 16 per head, 8 columns per lane.
    split = solution_module("token_serial")._Recurrence.SPLIT
    assert (split.rows_per_cta, split.num_slices, split.cols_per_lane) == (8, 16, 8)


@pytest.mark.parametrize("scale, expected", [(None, 128**-0.5), (0, 128**-0.5), (0.0, 128**-0.5), (0.05, 0.05)])
def test_resolve_scale(scale, expected):
    assert kernel.resolve_scale(scale) == pytest.approx(expected)


def _cpu_call_args(case_name="len6_state_scale05"):
    case = next(c for c in cases.CASES if c.name == case_name)
    inputs = cases.make_inputs(case, "cpu", seed=1)
    output, new_state = cases.poisoned_outputs(case, "cpu")
    return inputs, output, new_state


def test_run_rejects_wrong_dtype_with_one_line_error():
    inputs, output, new_state = _cpu_call_args()
    inputs["cu_seqlens"] = inputs["cu_seqlens"].int()
    with pytest.raises(kernel.GdnShapeError, match="cu_seqlens") as info:
        kernel.run(*inputs.values(), output, new_state)
    assert "\n" not in str(info.value)


def test_run_rejects_state_for_a_different_number_of_sequences():
    inputs, output, new_state = _cpu_call_args()
    inputs["state"] = torch.zeros(2, 8, 128, 128)
    with pytest.raises(kernel.GdnShapeError, match="state"):
        kernel.run(*inputs.values(), output, new_state)


def test_run_rejects_transposed_view():
    inputs, output, new_state = _cpu_call_args()
    inputs["state"] = inputs["state"].transpose(2, 3)  # right shape, k-first memory: not contiguous
    with pytest.raises(kernel.GdnShapeError, match="state"):
        kernel.run(*inputs.values(), output, new_state)


def test_run_rejects_wrong_output_shape():
    inputs, _, new_state = _cpu_call_args()
    with pytest.raises(kernel.GdnShapeError, match="output"):
        kernel.run(*inputs.values(), torch.empty(6, 4, 128, dtype=torch.bfloat16), new_state)


def test_cases_cover_the_required_shapes():
    lengths = {c.lengths for c in cases.CASES}
    for required in [(1,), (6,), (134,), (63, 64, 65), (4096,), (8192,), (32768,), (65536,), cases.LONG_PLUS_SHORT]:
        assert required in lengths
    assert len(cases.MANY_SHORT) == 57 and sum(cases.MANY_SHORT) == 1000 and min(cases.MANY_SHORT) >= 1
    assert {c.with_state for c in cases.CASES} == {True, False}
    assert {c.scale for c in cases.CASES} == {0.0, 0.05}
    assert {c.gates for c in cases.CASES} == set(cases.GATE_REGIMES)
    assert any(0 in c.lengths for c in cases.CASES)
    assert len(cases.MANY_130) == 130 and sum(cases.MANY_130) == 700 and min(cases.MANY_130) >= 1


@pytest.mark.parametrize(
    "lengths",
    [(5, 0, 3, 0, 9, 9, 0, 5, 2, 7), (3, -2, 3, 7, 1, 1, 1, 0, 4), cases.MANY_SHORT, tuple(range(1, 129))],
)
def test_the_kernels_length_ranking_serves_every_sequence_once_longest_first(lengths):
    # The kernel's rule, transcribed: row y serves the i with rank(i) == y.
    rank = [sum(lj > li or (lj == li and j < i) for j, lj in enumerate(lengths)) for i, li in enumerate(lengths)]
    rows = [rank.index(y) for y in range(len(lengths))]
    assert rows == solution_module("chunked").longest_first_order(lengths, ctas_per_sequence=32)
    assert sorted(rows) == list(range(len(lengths)))
    assert all(lengths[a] >= lengths[b] for a, b in zip(rows, rows[1:]))


@pytest.mark.parametrize(("ctas_per_sequence", "fewest"), [(64, 3), (32, 5), (8, 17)])
def test_the_rows_are_ranked_once_the_grid_has_more_ctas_than_sms(ctas_per_sequence, fewest):
    module = solution_module("chunked")
    assert module.min_ranked_seqs(ctas_per_sequence) == fewest
    assert (fewest - 1) * ctas_per_sequence <= module.NUM_SMS < fewest * ctas_per_sequence
    below = (3,) * (fewest - 2) + (9,)
    assert module.longest_first_order(below, ctas_per_sequence) == list(range(fewest - 1))
    assert module.longest_first_order(below + (1,), ctas_per_sequence)[0] == fewest - 2


def test_outside_the_ranked_counts_the_rows_keep_their_order():
    module = solution_module("chunked")
    assert module.MAX_RANKED_SEQS == 128
    assert module.longest_first_order(cases.MANY_130, 32) == list(range(130))
    assert module.longest_first_order((70, 0, 99, 2), 32) == list(range(4))


def test_inputs_follow_the_synth_distributions():
    case = cases.CheckCase("dist", (40, 24), True, 0.0, "mamba2")
    inputs = cases.make_inputs(case, "cpu", seed=3)
    for name in ("q", "k"):
        norms = inputs[name].float().norm(dim=-1)
        assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2), name
    assert inputs["dt_bias"].min() > -7.0 and inputs["dt_bias"].max() < -2.2
    assert (inputs["A_log"].exp() >= 1.0).all() and (inputs["A_log"].exp() <= 16.0).all()
    assert inputs["cu_seqlens"].tolist() == [0, 40, 64]
    fast = cases.make_inputs(cases.CheckCase("fast", (4,), False, 0.0, "fast_decay"), "cpu", seed=3)
    assert fast["dt_bias"].abs().max() <= 0.1 and fast["state"] is None


def test_repeated_keys_share_one_key_per_chunk_of_each_sequence():
    case = cases.CheckCase("r", (70, 0, 130), True, 0.0, "slow_decay", keys="repeated")
    inputs = cases.make_inputs(case, "cpu", seed=4)
    k, beta = inputs["k"], torch.sigmoid(inputs["b"].float())
    # Runs of 64 tokens from each sequence's start: [0, 64), [64, 70); [70, 134), [134, 198), [198, 200).
    for lo, hi in ((0, 64), (64, 70), (70, 134), (134, 198), (198, 200)):
        assert torch.equal(k[lo:hi], k[lo].expand(hi - lo, -1, -1))
    assert not torch.equal(k[63], k[64]) and not torch.equal(k[69], k[70])
    assert torch.allclose(beta, torch.full_like(beta, cases.REPEAT_BETA), atol=2e-3)
    random = cases.make_inputs(cases.CheckCase("r", (70, 0, 130), True, 0.0, "slow_decay"), "cpu", seed=4)
    assert all(torch.equal(inputs[name], random[name]) for name in ("q", "v", "state", "a", "A_log"))


def test_slow_decays_keep_the_state_over_the_whole_sequence():
    for case in (c for c in cases.CASES if c.gates == "slow_decay" and not c.long):
        inputs = cases.make_inputs(case, "cpu", seed=1)
        # The definition's gate: log g = -exp(A_log) softplus(a + dt_bias), per token and head.
        log_g = -inputs["A_log"].exp() * torch.nn.functional.softplus(inputs["a"].float() + inputs["dt_bias"])
        kept = log_g[: case.lengths[0]].sum(dim=0).exp()  # per head, over the first (longest) sequence
        assert float(kept.min()) > 0.5 and float(log_g.min()) > -1e-3, case.name
    # The regime changes A_log alone: every other input is the same draw as "mamba2"'s.
    slow = cases.make_inputs(cases.CheckCase("s", (9,), True, 0.0, "slow_decay"), "cpu", seed=3)
    mamba = cases.make_inputs(cases.CheckCase("m", (9,), True, 0.0, "mamba2"), "cpu", seed=3)
    assert all(torch.equal(slow[k], mamba[k]) for k in ("q", "k", "v", "state", "a", "dt_bias", "b"))
    assert (slow["A_log"] >= cases.SLOW_A_LOG[0]).all() and (slow["A_log"] <= cases.SLOW_A_LOG[1]).all()


def test_compare_accepts_the_reference_and_flags_errors():
    case = cases.CheckCase("cpu", (5, 0, 3), True, 0.0, "mamba2")
    inputs = cases.make_inputs(case, "cpu", seed=4)
    ref_out, ref_state = reference_run(*inputs.values())
    assert cases.compare(ref_out, ref_state, ref_out, ref_state).passed
    assert torch.count_nonzero(ref_state[1]) == 0  # the empty sequence's state is zero

    shifted = ref_state.clone()
    shifted[2, 3, 7, 9] += 0.5
    result = cases.compare(ref_out, shifted, ref_out, ref_state)
    assert not result.passed and result.outputs["new_state"].bad_count == 1

    nan_out = ref_out.clone()
    nan_out[2, 0, 0] = math.nan
    result = cases.compare(nan_out, ref_state, ref_out, ref_state)
    assert total_nan(result) == 1 and result.outputs["output"].bad_count == 1


def test_bitwise_mismatch_finds_one_flipped_bit_and_unwritten_outputs():
    # The helper behind the bit-for-bit GPU tests (another tiling of the same products), on the CPU with
    # the reference as the kernel: equal runs pass; one changed element or an unwritten output does not.
    case = cases.CheckCase("cpu", (5, 0, 3), True, 0.0, "mamba2")

    def reference_into(*args):
        out, state = reference_run(*args[:-2])
        args[-2].copy_(out)
        args[-1].copy_(state)

    def one_element_off(*args):
        reference_into(*args)
        args[-1][2, 3, 7, 9] = torch.nextafter(args[-1][2, 3, 7, 9], torch.tensor(math.inf))

    assert cases.bitwise_mismatch(case, [reference_into, reference_into], "cpu", seed=4) is None
    assert cases.bitwise_mismatch(case, [reference_into, one_element_off], "cpu", seed=4) == (
        "run 1: new_state differs from run 0's"
    )
    assert "non-finite" in cases.bitwise_mismatch(case, [lambda *args: None, reference_into], "cpu", seed=4)


@pytest.mark.parametrize("corrupt", ["ignored", "transposed"])
def test_mishandled_initial_state_fails_the_comparison(corrupt):
    # Long-memory gates: a kernel that drops the state or reads it as [K, V] must fail the checks.
    case = cases.CheckCase("cpu", (6, 3), True, 0.0, "mamba2")
    inputs = cases.make_inputs(case, "cpu", seed=5)
    expected = reference_run(*inputs.values())
    wrong = dict(inputs)
    wrong["state"] = None if corrupt == "ignored" else inputs["state"].transpose(2, 3).contiguous()
    result = cases.compare(*reference_run(*wrong.values()), *expected)
    assert result.outputs["output"].bad_count > 0 and result.outputs["new_state"].bad_count > 0


def _regrouped_recurrence(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale):
    """The kernel's per-token update in torch (fp32), token by token, all heads at once:
    u = S k, w = S q on the OLD state; delta = beta (v - g u); o = scale (g w + delta k.q);
    S = g S + delta k^T. v-head h reads q/k head h // 2; S is [V, K]."""
    scale = kernel.resolve_scale(scale)
    qh = q.float().repeat_interleave(2, dim=1)
    kh = k.float().repeat_interleave(2, dim=1)
    gate = torch.exp(-A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias))
    beta = torch.sigmoid(b.float())
    num_seqs = cu_seqlens.numel() - 1
    new_state = torch.zeros(num_seqs, 8, 128, 128)
    output = torch.empty(q.shape[0], 8, 128)
    for n in range(num_seqs):
        start, end = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        if start == end:
            continue
        s = state[n].clone() if state is not None else torch.zeros(8, 128, 128)
        for t in range(start, end):
            u = torch.einsum("hvk,hk->hv", s, kh[t])
            w = torch.einsum("hvk,hk->hv", s, qh[t])
            kq = (kh[t] * qh[t]).sum(-1, keepdim=True)
            g = gate[t][:, None]
            delta = beta[t][:, None] * (v[t].float() - g * u)
            output[t] = scale * (g * w + delta * kq)
            s = g[:, :, None] * s + delta[:, :, None] * kh[t][:, None, :]
        new_state[n] = s
    return output.to(torch.bfloat16), new_state


@pytest.mark.parametrize("case_name", ["len6_state_scale05", "len6_nostate", "zero_length_seqs"])
def test_regrouped_update_matches_reference(case_name):
    case = next(c for c in cases.CASES if c.name == case_name)
    inputs = cases.make_inputs(case, "cpu", seed=6)
    result = cases.compare(*_regrouped_recurrence(*inputs.values()), *reference_run(*inputs.values()))
    assert result.passed, result
    assert result.outputs["new_state"].max_abs_err < 1e-4


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


@pytest.fixture(params=SOLUTIONS)
def solution(request):
    return solution_module(request.param)


def _check_on_gpu(solution, case, seed):
    inputs = cases.make_inputs(case, "cuda", seed=seed)
    state_before = None if inputs["state"] is None else inputs["state"].clone()
    output, new_state = cases.poisoned_outputs(case, "cuda")
    solution.run(*inputs.values(), output, new_state)
    result = cases.compare(output, new_state, *reference_run(*inputs.values()))
    assert total_nan(result) == 0, result
    assert result.passed, result
    if state_before is not None:
        assert torch.equal(inputs["state"], state_before), "run modified its input state"


def test_the_paired_paths_are_solutions_and_a_long_case_has_a_known_failure():
    assert set(cases.PAIRED_PATHS) <= set(SOLUTIONS)
    assert any(c.known_failure for c in cases.CASES if c.long)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", [c for c in cases.CASES if not c.long], ids=lambda c: c.name)
def test_matches_reference(solution, case):
    _check_on_gpu(solution, case, seed=zlib.crc32(case.name.encode()) % 1000)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not LONG_TESTS, reason="set HOPPERBENCH_LONG_TESTS=1 (minutes of reference time)")
@pytest.mark.parametrize(
    "case",
    [c for c in cases.CASES if c.long],
    ids=lambda c: c.name,
)
def test_long_sequence_matches_reference(solution, case, request):
    if case.known_failure and request.node.callspec.params["solution"] not in cases.PAIRED_PATHS:
        request.applymarker(pytest.mark.xfail(reason=case.known_failure))
    _check_on_gpu(solution, case, seed=zlib.crc32(case.name.encode()) % 1000)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_follows_new_inputs_and_bounds(solution):
    static = cases.make_inputs(device_check.GRAPH_CASE, "cuda", seed=1)
    output, new_state = cases.poisoned_outputs(device_check.GRAPH_CASE, "cuda")
    # Same T and N, different split: the kernel must read the bounds on the device at replay.
    fresh = cases.make_inputs(device_check.GRAPH_FRESH, "cuda", seed=2)
    replay_on_fresh_inputs(
        lambda: solution.run(*static.values(), output, new_state), static, fresh, (output, new_state)
    )
    result = cases.compare(output, new_state, *reference_run(*fresh.values()))
    assert result.passed, result
