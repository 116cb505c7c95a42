"""kernels/gdn_prefill/lookahead.py (candidate `cand_lookahead`): the token-serial recurrence reducing one
token ahead. CPU: its scalar step (`lookahead_step`, the kernel's own code) transcribed per chunk in torch
equals the definition's recurrence in float64 and passes the reference in fp32; it compiles for sm_90a.
Its GPU checks are test_gdn_prefill_kernel.py's, which run every module of `KERNEL_CHOICES`."""

from __future__ import annotations

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT
from tests.kernels.compile_checks import assert_compiles_and_caches

cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
reference_run = cases.load_reference_run()
device_check = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/probes/device_check_gdn.py", "device_check_gdn")
lookahead = device_check.load_kernel_module("lookahead")


def _recurrence(advance, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, dtype):
    """(output, new_state) with `advance(s, start, end, ctx)` stepping each sequence's state s [8, V, K] over its
    tokens and writing ctx["output"]; ctx holds the scale, v-head q and k rows, gates, beta and values in `dtype`."""
    ctx = {
        "scale": lookahead.resolve_scale(scale),
        "q": q.to(dtype).repeat_interleave(2, dim=1),
        "k": k.to(dtype).repeat_interleave(2, dim=1),
        "v": v.to(dtype),
        "gate": torch.exp(-A_log.to(dtype).exp() * torch.nn.functional.softplus(a.to(dtype) + dt_bias.to(dtype))),
        "beta": torch.sigmoid(b.to(dtype)),
        "output": torch.zeros(q.shape[0], 8, 128, dtype=dtype),
    }
    num_seqs = cu_seqlens.numel() - 1
    new_state = torch.zeros(num_seqs, 8, 128, 128, dtype=dtype)
    for n in range(num_seqs):
        s = state[n].to(dtype).clone() if state is not None else torch.zeros(8, 128, 128, dtype=dtype)
        new_state[n] = advance(s, int(cu_seqlens[n]), int(cu_seqlens[n + 1]), ctx)
    return ctx["output"], new_state


def _plain_steps(s, start, end, ctx):
    """The definition's S <- g S; S <- S + beta (v - S k) k^T; o = scale S q, token by token (S is [V, K])."""
    kh, qh = ctx["k"], ctx["q"]
    for t in range(start, end):
        s = ctx["gate"][t][:, None, None] * s
        delta = ctx["beta"][t][:, None] * (ctx["v"][t] - torch.einsum("hvk,hk->hv", s, kh[t]))
        s = s + delta[:, :, None] * kh[t][:, None, :]
        ctx["output"][t] = ctx["scale"] * torch.einsum("hvk,hk->hv", s, qh[t])
    return s


def _lookahead_steps(s, start, end, ctx):
    """The kernel's loop, all heads and rows at once: per chunk of token_serial.CHUNK tokens a direct u = S k_0,
    then `lookahead.lookahead_step` per token with the row sums of the state before it."""
    kh, qh = ctx["k"], ctx["q"]
    for first in range(start, end, lookahead.CHUNK):
        last = min(first + lookahead.CHUNK, end)
        u = torch.einsum("hvk,hk->hv", s, kh[first])
        for t in range(first, last):
            k_next = kh[t + 1] if t + 1 < last else torch.zeros_like(kh[t])  # the kernel's u there is unused
            g = ctx["gate"][t][:, None]
            out, delta, u = lookahead.lookahead_step(
                ctx["scale"], g, ctx["beta"][t][:, None], ctx["v"][t], u,
                torch.einsum("hvk,hk->hv", s, qh[t]), torch.einsum("hvk,hk->hv", s, k_next),
                (kh[t] * qh[t]).sum(-1, keepdim=True), (kh[t] * k_next).sum(-1, keepdim=True),
            )  # fmt: skip
            ctx["output"][t] = out
            s = g[:, :, None] * s + delta[:, :, None] * kh[t][:, None, :]
    return s


def plain_recurrence(*inputs, dtype=torch.float64):
    return _recurrence(_plain_steps, *inputs, dtype)


def lookahead_recurrence(*inputs, dtype=torch.float64):
    return _recurrence(_lookahead_steps, *inputs, dtype)


CPU_CASES = ("len1_state", "len6_state_scale05", "len6_nostate", "chunk_edges_31_32_33_1", "zero_length_seqs")


@pytest.mark.parametrize("case_name", CPU_CASES)
def test_lookahead_equals_the_recurrence_in_float64(case_name):
    case = next(c for c in cases.CASES if c.name == case_name)
    inputs = cases.make_inputs(case, "cpu", seed=11)
    out, state = lookahead_recurrence(*inputs.values())
    expected_out, expected_state = plain_recurrence(*inputs.values())
    torch.testing.assert_close(out, expected_out, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(state, expected_state, rtol=1e-9, atol=1e-12)


def test_lookahead_in_fp32_passes_the_reference_with_long_memory_gates():
    # 40 tokens across two chunks, decays near 1: the state must survive every token.
    case = cases.CheckCase("cpu_slow_40", (40, 33, 7), True, 0.0, "slow_decay")
    inputs = cases.make_inputs(case, "cpu", seed=12)
    out, state = lookahead_recurrence(*inputs.values(), dtype=torch.float32)
    result = cases.compare(out.to(torch.bfloat16), state, *reference_run(*inputs.values()))
    assert result.passed, result


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(lookahead.compile_only, forms=1)
