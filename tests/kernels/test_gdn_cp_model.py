"""The context-parallel model of the GDN prefill (kernels/gdn_prefill/cp_model.py), on the CPU.

EXACT (float64) matches the definition's token recurrence, transcribed in float64 (`token_recurrence`,
itself checked against hopperbench's reference), to float64 rounding: single sequences of 1, 63, 64,
65, 2048 and 8192 tokens, mixed lengths, zero-length sequences, with and without an initial state,
and decays close to 1 (A_log very negative: the state survives the whole sequence). KERNEL precision
passes the track's acceptance rule against the reference. The segment transition is the product of
the per-token factors; the work list covers every token once with unique slots below the host bound;
the cost model reproduces the measured times it is calibrated on.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT

cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
cp = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/cp_model.py", "gdn_cp_model")
chunked_model = cp.cm
reference_run = cases.load_reference_run()


@pytest.fixture(autouse=True)
def _flush_denormals():
    # Fast decays underflow exp(G_i - G_j) into subnormals, which the CPU computes ~100x slower; the
    # checks here have tolerances far above the smallest normal number.
    previous = torch.set_flush_denormal(True)
    yield
    torch.set_flush_denormal(False)
    del previous


def _inputs(lengths, with_state=True, gates="mamba2", scale=0.0, a_log=None, seed=None):
    name = f"cp_{'_'.join(map(str, lengths[:8]))}_{len(lengths)}_{with_state}_{gates}_{a_log}"
    case = cases.CheckCase(name, tuple(lengths), with_state, scale, gates)
    inputs = cases.make_inputs(case, "cpu", seed=zlib.crc32(name.encode()) % 1000 if seed is None else seed)
    if a_log is not None:  # decays close to 1: log g = -exp(A_log) softplus(...) ~ -exp(A_log)
        inputs["A_log"] = torch.full_like(inputs["A_log"], a_log)
    return inputs


def _rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max() / max(1.0, float(y.abs().max()))) if x.numel() else 0.0


# ------------------------------------------------------------------------------------------------
# The oracle
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths,with_state", [((63, 0, 65), True), ((70,), False)])
def test_oracle_is_the_reference(lengths, with_state):
    inputs = _inputs(lengths, with_state, scale=0.05)
    ref_out, ref_state = reference_run(*inputs.values())
    out, state = cp.token_recurrence(*inputs.values())
    # The reference rounds its output to bf16 and computes in fp32.
    assert torch.allclose(ref_out.double(), out, rtol=2**-8, atol=1e-5)
    assert torch.allclose(ref_state.double(), state, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# EXACT: the algebra
# ------------------------------------------------------------------------------------------------

EXACT_CASES = [
    # (lengths, with_state, A_log, segment_chunks, split_tokens)
    ((1,), True, None, 1, 64),
    ((63,), False, None, 1, 64),
    ((64,), True, None, 1, 0),
    ((65,), True, -12.0, 1, 64),
    ((65,), False, None, 1, 64),
    ((2048,), True, -12.0, 4, None),
    ((1000,), False, None, 2, None),
    ((200, 0, 7, 130, 300, 1, 0, 64), True, None, 1, 64),
    ((300, 129, 0, 600), False, -12.0, 2, 128),
    ((5, 0, 3, 0), True, None, 1, 0),
    ((0, 0), True, None, 1, 0),
]


@pytest.mark.parametrize("lengths,with_state,a_log,segment_chunks,split_tokens", EXACT_CASES)
def test_exact_matches_token_recurrence(lengths, with_state, a_log, segment_chunks, split_tokens):
    inputs = _inputs(lengths, with_state, a_log=a_log)
    out, state = cp.run_raw(*inputs.values(), precision=cp.EXACT, segment_chunks=segment_chunks, split_tokens=split_tokens)
    ref_out, ref_state = cp.token_recurrence(*inputs.values())
    assert _rel_err(out, ref_out) < 1e-11
    assert _rel_err(state, ref_state) < 1e-11
    # Zero-length sequences get a zero state.
    for n, length in enumerate(lengths):
        if length == 0:
            assert not state[n].any()


def test_exact_8192_tokens_slow_decay():
    # Decays close to 1 (log g ~ -3e-4 per token at most): the initial state survives all 8192 tokens,
    # through 16 segments of 512 tokens and 15 scan steps.
    inputs = _inputs((8192,), True, a_log=-8.0, seed=8192)
    log_g, _ = chunked_model.gates(inputs["A_log"], inputs["a"], inputs["dt_bias"], inputs["b"])
    assert float(log_g.sum(0).min()) > -5.0  # exp(-5): the state has not been forgotten
    out, state = cp.run_raw(*inputs.values(), precision=cp.EXACT, segment_chunks=8)
    ref_out, ref_state = cp.token_recurrence(*inputs.values())
    assert _rel_err(out, ref_out) < 1e-10
    assert _rel_err(state, ref_state) < 1e-10
    # The scan carries the initial state into later segments: without it the outputs of the second
    # segment differ beyond the tolerance (the delta rule's own erasure, not the decay, wears it down).
    out0, _ = cp.token_recurrence(*dict(inputs, state=None).values())
    assert _rel_err(out0[512:576], ref_out[512:576]) > 1e-2


def test_summary_is_the_product_of_token_factors():
    # M = prod_t g_t (I - beta_t k_t k_t^T) (right-multiplied, in token order), B = the state from zero.
    inputs = _inputs((150,), False, gates="mamba2")
    ops = cp.Operands.build(
        *(inputs[n] for n in ("q", "k", "v", "A_log", "a", "dt_bias", "b", "scale")), dtype=torch.float64
    )
    B, M = cp.segment_summary(ops, 0, 150, cp.EXACT)
    eye = torch.eye(cp.HEAD_SIZE, dtype=torch.float64)
    for h in (0, 5):
        product = eye.clone()
        for t in range(150):
            k_t = ops.k[h, t, :, None]
            product = product @ (torch.exp(ops.log_g[h, t]) * (eye - ops.beta[h, t] * k_t @ k_t.T))
        assert _rel_err(M[h], product) < 1e-12
    _, ref_state = cp.token_recurrence(*inputs.values())
    assert _rel_err(B, ref_state[0]) < 1e-12
    # An incoming state composes affinely: S_out = S_in M + B.
    S_in = torch.randn(cp.NUM_V_HEADS, cp.HEAD_SIZE, cp.HEAD_SIZE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    _, S_out = cp.segment_outputs(ops, 0, 150, S_in, cp.EXACT)
    assert _rel_err(S_out, S_in @ M + B) < 1e-12


# ------------------------------------------------------------------------------------------------
# KERNEL precision: the acceptance rule
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lengths,gates,a_log",
    [((1024,), "mamba2", None), ((1024,), "mamba2", -8.0), ((700, 0, 300), "fast_decay", None)],
)
def test_kernel_precision_passes_acceptance(lengths, gates, a_log):
    inputs = _inputs(lengths, True, gates=gates, a_log=a_log)
    out, state = cp.run(*inputs.values(), precision=cp.KERNEL, segment_chunks=4)
    ref_out, ref_state = reference_run(*inputs.values())
    verdict = cases.compare(out, state, ref_out, ref_state)
    assert verdict.passed, verdict
    # Same rounding points as the chained path: close to its model.
    chain_out, chain_state = chunked_model.run(*inputs.values(), precision=cp.KERNEL)
    assert _rel_err(out.float(), chain_out.float()) < 2e-2
    assert _rel_err(state, chain_state) < 2e-3


# ------------------------------------------------------------------------------------------------
# The work list
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("segment_chunks,split_tokens", [(1, 0), (1, None), (4, None), (2, 1000)])
@pytest.mark.parametrize("lengths", [(0,), (1,), (5, 0, 3, 0), (2000, 64, 65, 0, 1, 640, 129), cases.MANY_130])
def test_work_list_covers_every_token_once(lengths, segment_chunks, split_tokens):
    L = segment_chunks * cp.CHUNK
    split = 2 * L if split_tokens is None else split_tokens
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    total = bounds[-1]
    segments = cp.work_list(bounds, total, L, split_tokens)
    bound = cp.segment_bound(len(lengths), total, L)
    assert len({s.slot for s in segments}) == len(segments)
    assert all(0 <= s.slot < bound for s in segments)
    covered = torch.zeros(total, dtype=torch.int64)
    for s in segments:
        covered[s.start : s.end] += 1
        assert bounds[s.seq] <= s.start < s.end <= bounds[s.seq + 1]
        if s.count > 1:
            assert s.start == bounds[s.seq] + s.index * L and (s.end - s.start == L or s.is_last)
    assert bool((covered == 1).all())
    for n, length in enumerate(lengths):
        count = sum(1 for s in segments if s.seq == n)
        assert count == cp.segment_count(length, L, split)
        if 0 < length <= split:
            assert count == 1


# ------------------------------------------------------------------------------------------------
# The cost model
# ------------------------------------------------------------------------------------------------


def test_cost_model_reproduces_the_measured_chained_times():
    m = cp.Machine()
    # 8192 tokens in 20-57 sequences: 130-143 us measured (eager, ours).
    for n in (20, 38, 57):
        t = cp.total_us(cp.chained_cost(cp.random_composition(8192, n, n), True, m), m)
        assert 120 < t < 150
    # One sequence of 20000 tokens: ~0.84 ms measured.
    assert 0.75e3 < cp.total_us(cp.chained_cost([20000], True, m), m) < 0.95e3


def test_segment_choice_splits_only_where_the_chain_bounds():
    m = cp.Machine()
    for row in cp.cost_table(m):
        lengths_long = row["longest"] >= 8192
        # Single long sequences: CP beats the chain; the 8192-token batches of 20-57 sequences are
        # busy-bound, and the chosen segment splits none of their sequences.
        if lengths_long:
            assert row["cp_us"] < 0.7 * row["chained_us"]
        else:
            assert row["cp_us"] == pytest.approx(row["chained_us"])

