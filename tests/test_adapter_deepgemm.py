"""DeepGEMM moe adapter: the whole pipeline on CPU with a torch stand-in for deep_gemm, results on GPU."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hopperbench.acceptance import compare_output
from hopperbench.adapters import deepgemm_moe
from hopperbench.references import moe as reference
from hopperbench.tracks import MOE

FP8 = torch.float8_e4m3fn
NUM_LOCAL = 32
CONTEST_RULE = MOE.acceptance


def moe_inputs(
    num_tokens: int, offset: int, seed: int, hidden: int = 256, intermediate: int = 256, device: str = "cpu"
) -> dict[str, Any]:
    """Definition-ordered inputs; weights scaled so that every stage stays O(1)."""
    gen = torch.Generator().manual_seed(seed)

    def fp8(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 2).clamp(-448, 448).to(FP8)

    inputs = {
        "routing_logits": torch.randn(num_tokens, 256, generator=gen),
        "routing_bias": (torch.randn(256, generator=gen) * 0.05).bfloat16(),
        "hidden_states": fp8(num_tokens, hidden),
        "hidden_states_scale": torch.rand(hidden // 128, num_tokens, generator=gen) + 0.5,
        "gemm1_weights": fp8(NUM_LOCAL, 2 * intermediate, hidden),
        "gemm1_weights_scale": (torch.rand(NUM_LOCAL, 2 * intermediate // 128, hidden // 128, generator=gen) + 0.5)
        / hidden**0.5,
        "gemm2_weights": fp8(NUM_LOCAL, hidden, intermediate),
        "gemm2_weights_scale": (torch.rand(NUM_LOCAL, hidden // 128, intermediate // 128, generator=gen) + 0.5)
        / intermediate**0.5,
        "local_expert_offset": offset,
        "routed_scaling_factor": 2.5,
    }
    # Pull tokens onto this rank so that most have local experts, some several.
    inputs["routing_logits"][:, offset : offset + NUM_LOCAL] += 2.0
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def dequantize_rows(values: torch.Tensor, mn_major_scales: torch.Tensor) -> torch.Tensor:
    return values.float() * mn_major_scales.repeat_interleave(128, dim=1)


def dequantize_blocks(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return values.float() * scales.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)


class FakeDeepGemm(types.ModuleType):
    """deep_gemm's SM90 contiguous grouped GEMM in torch, checking the layout contract it documents.

    Rows of `m_indices == -1` are poisoned with NaN (the real kernel leaves them unwritten),
    so an adapter reading them gives NaN outputs.
    """

    def __init__(self, alignment: int = 128) -> None:
        super().__init__("deep_gemm")
        self.alignment = alignment
        self.calls: list[dict[str, Any]] = []

    def get_mk_alignment_for_contiguous_layout(self) -> int:
        return self.alignment

    def m_grouped_fp8_gemm_nt_contiguous(
        self,
        a: tuple[torch.Tensor, torch.Tensor],
        b: tuple[torch.Tensor, torch.Tensor],
        d: torch.Tensor,
        grouped_layout: torch.Tensor,
        **options: Any,
    ) -> None:
        (x, x_scales), (w, w_scales) = a, b
        m, k = x.shape
        groups, n, _ = w.shape
        assert not options, "the adapter relies on the default recipe"
        assert x.dtype == FP8 and w.dtype == FP8 and x.stride(-1) == 1 and w.is_contiguous()
        assert d.dtype == torch.bfloat16 and d.shape == (m, n) and d.stride(-1) == 1
        assert grouped_layout.dtype == torch.int32 and grouped_layout.shape == (m,) and grouped_layout.is_contiguous()
        # SM90 activation scales: fp32, MN-major, K-block stride TMA-aligned (16 bytes).
        assert x_scales.dtype == torch.float32 and x_scales.shape == (m, k // 128)
        assert x_scales.stride() == (1, (m + 3) // 4 * 4)
        assert w_scales.dtype == torch.float32 and w_scales.shape == (groups, n // 128, k // 128)
        assert w_scales.is_contiguous()
        assert m % self.alignment == 0
        for block in grouped_layout.view(-1, self.alignment):
            assert block[0] >= 0, "a block's first row names its expert"
            valid = block >= 0
            assert torch.all(block[valid] == block[0]), "one expert per block"
            assert torch.all(valid[: int(valid.sum())]), "padding only at a segment's end"
        self.calls.append({"m": m, "n": n, "k": k, "m_indices": grouped_layout.clone()})

        d.fill_(float("nan"))
        for expert in grouped_layout.unique().tolist():
            if expert < 0:
                continue
            rows = (grouped_layout == expert).nonzero().flatten()
            # float64, as in `requantising_formulation`: fp32 products of different shapes sum in different
            # orders per CPU kernel, and a bf16 or e4m3 rounding step downstream then flips (seen on an AMD
            # EPYC host: one element 0.5 off); in float64 both sides round the same sums.
            x_rows = dequantize_rows(x[rows], x_scales[rows]).double()
            product = x_rows @ dequantize_blocks(w[expert], w_scales[expert]).double().T
            d[rows] = product.to(torch.bfloat16)


def requantising_formulation(inputs: dict[str, Any]) -> torch.Tensor:
    """Token by token, expert by expert, with the pipeline's roundings: bf16 GEMM outputs (of float64 sums, as
    `FakeDeepGemm`'s), e4m3 SwiGLU."""
    experts, weights = reference._route(inputs["routing_logits"], inputs["routing_bias"], 2.5)
    x = reference._dequantize_activations(inputs["hidden_states"], inputs["hidden_states_scale"])
    num_tokens, hidden = x.shape
    w13s = [dequantize_blocks(w, s) for w, s in zip(inputs["gemm1_weights"], inputs["gemm1_weights_scale"])]
    w2s = [dequantize_blocks(w, s) for w, s in zip(inputs["gemm2_weights"], inputs["gemm2_weights_scale"])]
    out = torch.zeros(num_tokens, hidden)
    for t in range(num_tokens):
        for slot in range(8):
            e = int(experts[t, slot]) - inputs["local_expert_offset"]
            if not 0 <= e < NUM_LOCAL:
                continue
            g1 = (x[t].double() @ w13s[e].double().T).bfloat16().float()
            half = g1.shape[0] // 2
            c = (F.silu(g1[half:]) * g1[:half]).view(-1, 128)
            scale = c.abs().amax(dim=1, keepdim=True).clamp_min(1e-4) / 448.0
            c_q = ((c / scale).to(FP8).float() * scale).flatten()
            out[t] += weights[t, slot] * (c_q.double() @ w2s[e].double().T).bfloat16().float()
    return out.bfloat16()


def run_pipeline(inputs: dict[str, Any], fake: FakeDeepGemm) -> torch.Tensor:
    output = torch.full(inputs["hidden_states"].shape, 7.0, dtype=torch.bfloat16)  # stale values must go
    deepgemm_moe.moe_pipeline(fake, *inputs.values(), output)
    return output


@pytest.mark.parametrize(("offset", "alignment"), [(0, 32), (96, 128), (224, 64)])
def test_pipeline_matches_a_formulation_with_the_same_roundings(offset: int, alignment: int) -> None:
    inputs = moe_inputs(num_tokens=24, offset=offset, seed=offset + 1)
    fake = FakeDeepGemm(alignment)
    output = run_pipeline(inputs, fake)
    assert len(fake.calls) == 2
    assert (fake.calls[0]["n"], fake.calls[0]["k"]) == (512, 256)  # GEMM1: [M, H] x [2I, H]^T
    assert (fake.calls[1]["n"], fake.calls[1]["k"]) == (256, 256)  # GEMM2: [M, I] x [H, I]^T
    assert torch.equal(fake.calls[0]["m_indices"], fake.calls[1]["m_indices"])
    torch.testing.assert_close(output, requantising_formulation(inputs), rtol=1e-2, atol=1e-2)


def test_pipeline_against_our_reference_under_the_moe_rule() -> None:
    """The contest rule holds; the relative L2 shows the requantisation cost the docstring states."""
    inputs = moe_inputs(num_tokens=64, offset=32, seed=5, intermediate=512)
    output = run_pipeline(inputs, FakeDeepGemm())
    expected = reference._moe_forward(*inputs.values())
    stats = compare_output(CONTEST_RULE, output, expected)
    assert stats.passed, stats.reason
    assert stats.nan_count == 0
    assert stats.relative_l2 is not None and 5e-3 < stats.relative_l2 < 5e-2
    full = compare_output(MOE.acceptance_for("ours"), output, expected)
    assert full.relative_l2 == stats.relative_l2
    assert full.passed == (stats.relative_l2 <= 1e-2)


def test_routing_is_our_references_routing() -> None:
    inputs = moe_inputs(num_tokens=33, offset=0, seed=9)
    args = inputs["routing_logits"], inputs["routing_bias"], 2.5
    ours, theirs = deepgemm_moe.route(*args), reference._route(*args)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_contiguous_layout_places_every_local_pair_once() -> None:
    experts = torch.tensor([[3, 40, 5, 70, 90, 100, 110, 120], [5, 6, 200, 201, 202, 203, 204, 205], [1] * 8])
    experts[2] = torch.tensor([250, 251, 252, 253, 254, 255, 249, 248])  # no local expert
    weights = torch.arange(24, dtype=torch.float32).view(3, 8)
    layout = deepgemm_moe.contiguous_layout(experts, weights, local_expert_offset=0, num_local=32, alignment=4)
    assert layout is not None
    # Experts 3, 5, 6 hold 1, 2, 1 pairs -> segments of 4 rows each.
    assert layout.num_rows == 12
    assert layout.m_indices.tolist() == [3, -1, -1, -1, 5, 5, -1, -1, 6, -1, -1, -1]
    assert layout.pair_rows.tolist() == [0, 4, 5, 8]
    assert layout.pair_tokens.tolist() == [0, 0, 1, 1]
    assert layout.pair_weights.tolist() == [0.0, 2.0, 8.0, 9.0]
    assert layout.row_token[layout.pair_rows].tolist() == layout.pair_tokens.tolist()


def test_tokens_without_a_local_expert_get_zero_rows_and_no_rank_work_means_no_gemm() -> None:
    inputs = moe_inputs(num_tokens=12, offset=0, seed=3)
    inputs["routing_logits"][:4, :32] -= 50.0  # tokens 0..3 route away from experts 0..31
    output = run_pipeline(inputs, FakeDeepGemm())
    assert torch.all(output[:4] == 0) and torch.all(output[4:].abs().sum(dim=1) > 0)

    inputs["routing_logits"][:, :32] -= 50.0
    fake = FakeDeepGemm()
    output = run_pipeline(inputs, fake)
    assert fake.calls == [] and torch.all(output == 0)


def test_activation_scales_are_built_in_deepgemms_layout() -> None:
    hidden_states = (torch.randn(5, 256) * 4).to(FP8)
    scales = torch.rand(2, 5)
    row_token = torch.tensor([4, 0, 0, 2, 1, 3, 3, 3])
    rows, row_scales = deepgemm_moe.gather_activations(hidden_states, scales, row_token)
    assert rows.dtype == FP8 and torch.equal(rows.view(torch.uint8), hidden_states[row_token].view(torch.uint8))
    assert row_scales.stride() == (1, 8) and torch.equal(row_scales, scales.T[row_token])


def test_requantisation_round_trips_within_e4m3_precision() -> None:
    gemm1_out = (torch.randn(8, 512) * 3).bfloat16()
    quantized, scales = deepgemm_moe.swiglu_requantize(gemm1_out)
    assert quantized.dtype == FP8 and quantized.shape == (8, 256) and scales.stride() == (1, 8)
    exact = F.silu(gemm1_out[:, 256:].float()) * gemm1_out[:, :256].float()
    restored = dequantize_rows(quantized, scales)
    assert restored.abs().view(8, 2, 128).amax(dim=-1).allclose(exact.abs().view(8, 2, 128).amax(dim=-1), rtol=1e-6)
    assert ((restored - exact).norm() / exact.norm()).item() < 0.04


def test_run_pins_the_definition_sizes_and_checks_destinations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deepgemm_moe, "load_deep_gemm", FakeDeepGemm)
    inputs = moe_inputs(num_tokens=2, offset=0, seed=1)
    with pytest.raises(deepgemm_moe.AdapterInputError, match=r"hidden_states must have shape \(2, 7168\)"):
        deepgemm_moe.run(*inputs.values(), torch.empty(2, 256, dtype=torch.bfloat16))
    with pytest.raises(deepgemm_moe.AdapterInputError, match="output must be bfloat16"):
        deepgemm_moe.moe_pipeline(FakeDeepGemm(), *inputs.values(), torch.empty(2, 256))
    with pytest.raises(deepgemm_moe.AdapterInputError, match=r"output must have shape \(2, 256\)"):
        deepgemm_moe.moe_pipeline(FakeDeepGemm(), *inputs.values(), torch.empty(3, 256, dtype=torch.bfloat16))


def test_library_absent_other_build_or_incomplete_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    load_uncached = deepgemm_moe.load_deep_gemm.__wrapped__

    def absent(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", absent)
    with pytest.raises(deepgemm_moe.LibraryUnavailableError, match="deep_gemm is not installed"):
        load_uncached()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.6.1+local")
    with pytest.raises(deepgemm_moe.LibraryUnavailableError, match=r"targets 2\.6\.1\+54e2261"):
        load_uncached()

    monkeypatch.setattr(importlib.metadata, "version", lambda name: deepgemm_moe.DEEP_GEMM_VERSION)
    fake = FakeDeepGemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    assert load_uncached() is fake
    monkeypatch.setitem(sys.modules, "deep_gemm", types.ModuleType("deep_gemm"))
    with pytest.raises(deepgemm_moe.LibraryUnavailableError, match="lacks m_grouped_fp8_gemm_nt_contiguous"):
        load_uncached()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("num_tokens", "offset"), [(1, 0), (80, 32), (901, 224)])
def test_deepgemm_against_our_reference_on_gpu(num_tokens: int, offset: int) -> None:
    try:
        deepgemm_moe.load_deep_gemm()
    except deepgemm_moe.LibraryUnavailableError as error:
        pytest.skip(str(error))
    inputs = moe_inputs(num_tokens, offset, seed=num_tokens, hidden=7168, intermediate=2048, device="cuda")
    expected = reference.run(*inputs.values())
    output = torch.full_like(expected, float("nan"))
    deepgemm_moe.run(*inputs.values(), output)
    torch.cuda.synchronize()
    stats = compare_output(CONTEST_RULE, output, expected)
    assert stats.passed, stats.reason
    # The e4m3 requantisation of the SwiGLU output: ~2.5 % (module docstring).
    assert stats.relative_l2 is not None and stats.relative_l2 < 5e-2
