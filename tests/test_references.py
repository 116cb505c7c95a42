"""Our references against independent float64 formulations (tests/naive_formulations.py).

The references compute in fp32 and the naive forms in float64, so fp32 outputs are
compared tightly and bf16 outputs within bf16 rounding (2^-8 relative). Where the
official contest definition is at hand, the official reference text is run on the
same inputs as a second witness (GDN and DSA on CPU; MoE only on a GPU, as its
reference dequantises all experts at once).
"""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

import naive_formulations as naive
from hopperbench.paths import shared_contest_data_dir
from hopperbench.tracks.dsa_attention import reference as dsa_attention
from hopperbench.tracks.gdn_prefill import reference as gdn_prefill
from hopperbench.tracks.moe import reference as moe
from hopperbench.tracks import DSA_ATTENTION, GDN_PREFILL, MOE, Track

BF16_UNIT_ROUNDOFF = 2.0**-8
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ---------------------------------------------------------------------------------------------
# comparison helpers


def bf16_mismatch(actual: torch.Tensor, expected: torch.Tensor, atol_share: float = 1e-5, roundings: int = 1) -> float:
    """Largest excess over the bf16 rounding bound (<= 0 means a match).

    A bf16 result of an exact value e may be off by 2^-8 |e| per rounding (two when
    `expected` is itself a bf16 result); `atol_share` of the largest |e| absorbs the fp32
    error of the reference before its final rounding.
    """
    assert actual.dtype == torch.bfloat16
    expected = expected.double()
    bound = roundings * BF16_UNIT_ROUNDOFF * expected.abs() + atol_share * expected.abs().max().clamp_min(1e-30)
    return float(((actual.double() - expected).abs() - bound).max())


def fp32_matches(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> bool:
    assert actual.dtype == torch.float32
    expected = expected.double()
    scale = float(expected.abs().max().clamp_min(1e-30))
    return bool(((actual.double() - expected).abs() <= tol * (expected.abs() + scale)).all())


def official_reference(track: Track) -> types.FunctionType:
    """The official definition's `run`, executed from its JSON text (skips when the file is absent)."""
    data_dir = shared_contest_data_dir()
    if data_dir is None:
        pytest.skip("official contest data not found (../shared/contest_data or HOPPERBENCH_CONTEST_DATA)")
    name = track.definition_name
    source = json.loads((data_dir / name / f"{name}.json").read_text())["reference"]
    namespace: dict = {}
    exec(compile(source, f"<official {name}>", "exec"), namespace)
    return namespace["run"]


# ---------------------------------------------------------------------------------------------
# GDN prefill


def gdn_inputs(lengths: list[int], seed: int, with_state: bool = True, scale: float | None = 0.0) -> dict:
    """Inputs in definition order; keys are unit-norm per head, as in the model, so the rule stays stable."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    keys = torch.randn(total, 4, 128, generator=gen)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return {
        "q": torch.randn(total, 4, 128, generator=gen).bfloat16(),
        "k": (keys / keys.norm(dim=-1, keepdim=True)).bfloat16(),
        "v": torch.randn(total, 8, 128, generator=gen).bfloat16(),
        "state": torch.randn(len(lengths), 8, 128, 128, generator=gen) if with_state else None,
        "A_log": torch.randn(8, generator=gen) * 0.5,
        "a": torch.randn(total, 8, generator=gen).bfloat16(),
        "dt_bias": torch.randn(8, generator=gen) * 0.5,
        "b": torch.randn(total, 8, generator=gen).bfloat16(),
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int64),
        "scale": scale,
    }


def gdn_mismatch(result: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]) -> str:
    """'' when both outputs match, else which one does not."""
    output, new_state = result
    problems = []
    if bf16_mismatch(output, expected[0]) > 0:
        problems.append("output")
    if not fp32_matches(new_state, expected[1]):
        problems.append("new_state")
    return ", ".join(problems)


GDN_CASES = [
    pytest.param([5, 0, 1, 9, 3], 1, True, 0.0, id="uneven-with-empty-and-single-zero-scale"),
    pytest.param([1], 2, False, None, id="single-token-no-state-no-scale"),
    pytest.param([7, 2, 12], 3, True, 0.3, id="given-state-and-scale"),
    pytest.param([0, 4, 0], 4, False, 0.05, id="empty-sequences-around-one"),
]


@pytest.mark.parametrize("lengths,seed,with_state,scale", GDN_CASES)
def test_gdn_matches_naive_recurrence(lengths: list[int], seed: int, with_state: bool, scale: float | None) -> None:
    inputs = gdn_inputs(lengths, seed, with_state, scale)
    state_before = None if inputs["state"] is None else inputs["state"].clone()
    result = gdn_prefill.run(*inputs.values())
    assert result[0].shape == (sum(lengths), 8, 128) and result[0].dtype == torch.bfloat16
    assert result[1].shape == (len(lengths), 8, 128, 128) and result[1].dtype == torch.float32
    assert gdn_mismatch(result, naive.gdn_prefill(*inputs.values())) == ""
    if state_before is not None:
        assert torch.equal(inputs["state"], state_before), "the reference modified its input state"


def test_gdn_comparison_detects_ignored_or_transposed_state() -> None:
    inputs = gdn_inputs([6, 3], seed=5)
    expected = naive.gdn_prefill(*inputs.values())
    assert gdn_mismatch(gdn_prefill.run(*inputs.values()), expected) == ""
    ignored = dict(inputs, state=None)
    assert gdn_mismatch(gdn_prefill.run(*ignored.values()), expected) != ""
    transposed = dict(inputs, state=inputs["state"].transpose(-1, -2).contiguous())
    assert gdn_mismatch(gdn_prefill.run(*transposed.values()), expected) != ""


def test_gdn_default_scale_is_inverse_sqrt_head_size() -> None:
    base = gdn_inputs([3, 2], seed=6, scale=1.0 / math.sqrt(128))
    explicit = gdn_prefill.run(*base.values())
    for default in (None, 0.0):
        result = gdn_prefill.run(*dict(base, scale=default).values())
        assert torch.equal(result[0], explicit[0]) and torch.equal(result[1], explicit[1])


def test_gdn_empty_sequence_state_is_zero_as_in_the_contest_definition() -> None:
    inputs = gdn_inputs([2, 0, 3], seed=7)
    _, new_state = gdn_prefill.run(*inputs.values())
    assert not new_state[1].any()
    assert new_state[0].abs().sum() > 0 and new_state[2].abs().sum() > 0


def test_gdn_rejects_decreasing_cu_seqlens() -> None:
    inputs = gdn_inputs([2, 2], seed=8)
    inputs["cu_seqlens"] = torch.tensor([0, 3, 2], dtype=torch.int64)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gdn_prefill.run(*inputs.values())


def test_gdn_agrees_with_official_reference() -> None:
    official = official_reference(GDN_PREFILL)
    for inputs in (gdn_inputs([4, 0, 2], seed=9), gdn_inputs([3], seed=10, with_state=False, scale=None)):
        ours, theirs = gdn_prefill.run(*inputs.values()), official(*inputs.values())
        assert bf16_mismatch(ours[0], theirs[0], atol_share=1e-4, roundings=2) <= 0
        assert fp32_matches(ours[1], theirs[1])


# ---------------------------------------------------------------------------------------------
# DSA sparse attention

TOPK = 2048


def dsa_inputs(num_tokens: int, num_pages: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "q_nope": torch.randn(num_tokens, 16, 512, generator=gen).bfloat16(),
        "q_pe": torch.randn(num_tokens, 16, 64, generator=gen).bfloat16(),
        "ckv_cache": torch.randn(num_pages, 64, 512, generator=gen).bfloat16(),
        "kpe_cache": torch.randn(num_pages, 64, 64, generator=gen).bfloat16(),
        "sparse_indices": torch.randint(0, num_pages * 64, (num_tokens, TOPK), generator=gen, dtype=torch.int32),
        "sm_scale": 1.0 / math.sqrt(192),
    }


def dsa_mixed_indices(inputs: dict, seed: int) -> dict:
    """Tokens: 0 all valid, 1 all padding, 2 scattered padding, 3 = token 0's rows, 4 one valid row,
    5 distinct rows then a padded tail."""
    gen = torch.Generator().manual_seed(seed)
    indices = inputs["sparse_indices"].clone()
    rows = inputs["ckv_cache"].shape[0] * 64
    indices[1] = -1
    indices[2, torch.rand(TOPK, generator=gen) < 0.4] = -1
    indices[3] = indices[0]
    indices[4] = -1
    indices[4, 1234] = rows - 1
    count = min(rows, TOPK)
    indices[5] = -1
    indices[5, :count] = torch.randperm(rows, generator=gen)[:count].to(torch.int32)
    return dict(inputs, sparse_indices=indices)


def dsa_mismatch(result: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]) -> str:
    output, lse = result
    problems = []
    if bf16_mismatch(output, expected[0]) > 0:
        problems.append("output")
    infinite = torch.isinf(expected[1])
    if not torch.equal(torch.isinf(lse), infinite) or not (lse[infinite] < 0).all():
        problems.append("lse -inf pattern")
    elif not fp32_matches(lse[~infinite], expected[1][~infinite]):
        problems.append("lse")
    return ", ".join(problems)


@pytest.mark.parametrize("num_pages", [2, 40])
def test_dsa_matches_naive_attention(num_pages: int) -> None:
    inputs = dsa_mixed_indices(dsa_inputs(6, num_pages, seed=num_pages), seed=11)
    result = dsa_attention.run(*inputs.values())
    assert result[0].shape == (6, 16, 512) and result[0].dtype == torch.bfloat16
    assert result[1].shape == (6, 16) and result[1].dtype == torch.float32
    assert dsa_mismatch(result, naive.dsa_sparse_attention(*inputs.values())) == ""


def test_dsa_row_without_valid_index_gives_zero_and_minus_inf() -> None:
    inputs = dsa_mixed_indices(dsa_inputs(6, 3, seed=12), seed=13)
    output, lse = dsa_attention.run(*inputs.values())
    assert not output[1].any()
    assert torch.equal(lse[1], torch.full((16,), -math.inf))
    assert torch.isfinite(lse[[0, 2, 3, 4, 5]]).all()


def test_dsa_single_valid_row_returns_that_row() -> None:
    inputs = dsa_mixed_indices(dsa_inputs(6, 3, seed=14), seed=15)
    output, _ = dsa_attention.run(*inputs.values())
    only_row = inputs["ckv_cache"].reshape(-1, 512)[-1]
    assert torch.equal(output[4], only_row.expand(16, 512))


def test_dsa_lse_is_base_two() -> None:
    inputs = dsa_inputs(2, 4, seed=16)
    _, lse = dsa_attention.run(*inputs.values())
    _, natural = naive.dsa_sparse_attention(*inputs.values())
    assert fp32_matches(lse, natural)
    assert not fp32_matches(lse * math.log(2.0), natural, tol=1e-3)  # i.e. not a natural-log lse


def test_dsa_chunks_match_whole_batch() -> None:
    inputs = dsa_mixed_indices(dsa_inputs(6, 5, seed=17), seed=18)
    chunked = dsa_attention._sparse_attention(*inputs.values(), tokens_per_chunk=4)
    assert dsa_mismatch(chunked, naive.dsa_sparse_attention(*inputs.values())) == ""


def test_dsa_agrees_with_official_reference() -> None:
    official = official_reference(DSA_ATTENTION)
    inputs = dsa_mixed_indices(dsa_inputs(6, 3, seed=19), seed=20)
    ours, theirs = dsa_attention.run(*inputs.values()), official(*inputs.values())
    assert bf16_mismatch(ours[0], theirs[0], atol_share=1e-4, roundings=2) <= 0
    infinite = torch.isinf(theirs[1])
    assert torch.equal(ours[1][infinite], theirs[1][infinite])
    assert fp32_matches(ours[1][~infinite], theirs[1][~infinite])


# ---------------------------------------------------------------------------------------------
# MoE FP8 block scale

NUM_EXPERTS = 256
NUM_LOCAL = 32


def random_fp8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).clamp(-2, 2).to(torch.float8_e4m3fn)


def moe_inputs(num_tokens: int, offset: int, seed: int, hidden: int = 256, intermediate: int = 128) -> dict:
    """Inputs in definition order at reduced hidden/intermediate sizes (multiples of 128)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "routing_logits": torch.randn(num_tokens, NUM_EXPERTS, generator=gen),
        "routing_bias": (torch.randn(NUM_EXPERTS, generator=gen) * 0.05).bfloat16(),
        "hidden_states": random_fp8((num_tokens, hidden), gen),
        "hidden_states_scale": torch.rand(hidden // 128, num_tokens, generator=gen) + 0.5,
        "gemm1_weights": random_fp8((NUM_LOCAL, 2 * intermediate, hidden), gen),
        "gemm1_weights_scale": torch.rand(NUM_LOCAL, 2 * intermediate // 128, hidden // 128, generator=gen) * 0.02,
        "gemm2_weights": random_fp8((NUM_LOCAL, hidden, intermediate), gen),
        "gemm2_weights_scale": torch.rand(NUM_LOCAL, hidden // 128, intermediate // 128, generator=gen) * 0.02,
        "local_expert_offset": offset,
        "routed_scaling_factor": 2.5,
    }


def local_experts_used(inputs: dict) -> set[int]:
    offset = inputs["local_expert_offset"]
    used = set()
    for t in range(inputs["routing_logits"].shape[0]):
        routes = naive.deepseek_route(inputs["routing_logits"][t], inputs["routing_bias"], 2.5)
        used |= {e - offset for e in routes if 0 <= e - offset < NUM_LOCAL}
    return used


@pytest.mark.parametrize("offset", [0, 32, 224])
def test_moe_matches_naive_loop(offset: int) -> None:
    inputs = moe_inputs(num_tokens=4, offset=offset, seed=offset + 1)
    # Pull some tokens onto this rank so several local experts and a shared expert occur.
    inputs["routing_logits"][:2, offset : offset + 4] += 6.0
    assert len(local_experts_used(inputs)) >= 2
    output = moe._moe_forward(*inputs.values())
    assert output.shape == (4, 256) and output.dtype == torch.bfloat16
    assert bf16_mismatch(output, naive.moe_fp8_block_scale(*inputs.values()), atol_share=1e-4) <= 0


def test_moe_token_without_local_expert_gives_zero_row() -> None:
    inputs = moe_inputs(num_tokens=3, offset=0, seed=21)
    # Local experts 0..31 are exactly group 0: sink it for token 0, favour it for token 1.
    inputs["routing_logits"][0, :32] = -20.0
    inputs["routing_logits"][1, :32] += 5.0
    output = moe._moe_forward(*inputs.values())
    assert not output[0].any()
    assert output[1].abs().sum() > 0
    assert bf16_mismatch(output, naive.moe_fp8_block_scale(*inputs.values()), atol_share=1e-4) <= 0


def test_moe_skewed_routing() -> None:
    inputs = moe_inputs(num_tokens=6, offset=64, seed=22)
    # A large bias on three local experts makes every token choose them.
    inputs["routing_bias"][[64, 70, 90]] = 4.0
    assert {0, 6, 26} <= local_experts_used(inputs)
    expected = naive.moe_fp8_block_scale(*inputs.values())
    assert bf16_mismatch(moe._moe_forward(*inputs.values()), expected, atol_share=1e-4) <= 0


def test_moe_routing_selects_with_bias_and_weighs_without() -> None:
    inputs = moe_inputs(num_tokens=8, offset=0, seed=25)
    inputs["routing_bias"][[3, 100, 200]] = 4.0  # always chosen, yet weighed by their plain sigmoid
    experts, weights = moe._route(inputs["routing_logits"], inputs["routing_bias"], 2.5)
    for t in range(8):
        expected = naive.deepseek_route(inputs["routing_logits"][t], inputs["routing_bias"], 2.5)
        assert set(experts[t].tolist()) == set(expected)
        ours = dict(zip(experts[t].tolist(), weights[t].tolist()))
        assert all(math.isclose(ours[e], w, rel_tol=1e-5) for e, w in expected.items())
        assert math.isclose(sum(ours.values()), 2.5, rel_tol=1e-5)


def test_moe_run_at_definition_sizes() -> None:
    """`run` itself on the definition's shapes (7168 x 2048, 32 experts) with two tokens.

    Only the experts the tokens reach get random weights; the rest stay zero, so the test is
    cheap and any use of a wrong expert shows up as a missing contribution.
    """
    gen = torch.Generator().manual_seed(23)
    hidden, intermediate, offset = 7168, 2048, 96
    inputs = moe_inputs(num_tokens=2, offset=offset, seed=23, hidden=128, intermediate=128)
    inputs["routing_logits"][:, offset : offset + 3] += 6.0
    inputs["hidden_states"] = random_fp8((2, hidden), gen)
    inputs["hidden_states_scale"] = torch.rand(hidden // 128, 2, generator=gen) + 0.5
    inputs["gemm1_weights"] = torch.zeros(NUM_LOCAL, 2 * intermediate, hidden, dtype=torch.float8_e4m3fn)
    inputs["gemm2_weights"] = torch.zeros(NUM_LOCAL, hidden, intermediate, dtype=torch.float8_e4m3fn)
    inputs["gemm1_weights_scale"] = torch.rand(NUM_LOCAL, 2 * intermediate // 128, hidden // 128, generator=gen) * 0.01
    inputs["gemm2_weights_scale"] = torch.rand(NUM_LOCAL, hidden // 128, intermediate // 128, generator=gen) * 0.01
    used = local_experts_used(inputs)
    for expert in used:
        inputs["gemm1_weights"][expert] = random_fp8((2 * intermediate, hidden), gen)
        inputs["gemm2_weights"][expert] = random_fp8((hidden, intermediate), gen)
    assert len(used) >= 3
    output = moe.run(*inputs.values())
    assert output.shape == (2, hidden) and output.dtype == torch.bfloat16
    assert bf16_mismatch(output, naive.moe_fp8_block_scale(*inputs.values()), atol_share=1e-4) <= 0


def test_moe_run_rejects_reduced_sizes() -> None:
    with pytest.raises(ValueError, match="hidden_states must have shape"):
        moe.run(*moe_inputs(num_tokens=2, offset=0, seed=24).values())


# ---------------------------------------------------------------------------------------------
# on a GPU: the same references on CUDA, and the official MoE reference at definition sizes


def _to_cuda(inputs: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


@pytest.mark.gpu
@needs_cuda
def test_references_on_cuda_match_naive() -> None:
    gdn = gdn_inputs([5, 0, 1, 9], seed=30)
    result = gdn_prefill.run(*_to_cuda(gdn).values())
    assert gdn_mismatch(tuple(r.cpu() for r in result), naive.gdn_prefill(*gdn.values())) == ""
    dsa = dsa_mixed_indices(dsa_inputs(6, 40, seed=31), seed=32)
    result = dsa_attention.run(*_to_cuda(dsa).values())
    assert dsa_mismatch(tuple(r.cpu() for r in result), naive.dsa_sparse_attention(*dsa.values())) == ""
    mixture = moe_inputs(num_tokens=4, offset=32, seed=33)
    mixture["routing_logits"][:, 32:36] += 4.0
    output = moe._moe_forward(*_to_cuda(mixture).values()).cpu()
    assert bf16_mismatch(output, naive.moe_fp8_block_scale(*mixture.values()), atol_share=1e-4) <= 0


@pytest.mark.gpu
@needs_cuda
def test_moe_agrees_with_official_reference_on_cuda() -> None:
    official = official_reference(MOE)
    gen = torch.Generator(device="cuda").manual_seed(34)
    t, hidden, intermediate = 16, 7168, 2048

    def fp8(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device="cuda").clamp(-2, 2).to(torch.float8_e4m3fn)

    inputs = {
        "routing_logits": torch.randn(t, NUM_EXPERTS, generator=gen, device="cuda"),
        "routing_bias": (torch.randn(NUM_EXPERTS, generator=gen, device="cuda") * 0.2).bfloat16(),
        "hidden_states": fp8((t, hidden)),
        "hidden_states_scale": torch.rand(hidden // 128, t, generator=gen, device="cuda") + 0.5,
        "gemm1_weights": fp8((NUM_LOCAL, 2 * intermediate, hidden)),
        "gemm1_weights_scale": torch.rand(NUM_LOCAL, 32, 56, generator=gen, device="cuda") * 0.01,
        "gemm2_weights": fp8((NUM_LOCAL, hidden, intermediate)),
        "gemm2_weights_scale": torch.rand(NUM_LOCAL, 56, 16, generator=gen, device="cuda") * 0.01,
        "local_expert_offset": 32,
        "routed_scaling_factor": 2.5,
    }
    inputs["routing_logits"][:, 32:40] += 3.0
    ours, theirs = moe.run(*inputs.values()), official(*inputs.values())
    assert bf16_mismatch(ours.cpu(), theirs.cpu(), atol_share=1e-4, roundings=2) <= 0
