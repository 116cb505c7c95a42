"""DeepGEMM moe adapter: the whole pipeline on CPU with a torch stand-in for deep_gemm, in both layouts; the
masked layout's freedom from host syncs and data-dependent shapes, the contiguous layout's one host read and the
split between them; on GPU the results, a CUDA-graph replay (masked) and a refused capture (contiguous)."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from hopperbench.acceptance import compare_output
from hopperbench.tracks.moe import reference
from hopperbench.tracks.moe.adapters import deepgemm_moe
from hopperbench.tracks import MOE

FP8 = torch.float8_e4m3fn
NUM_LOCAL = 32
CONTEST_RULE = MOE.acceptance
# Eight 0x7F bytes: e4m3fn NaN in every byte of an int64 word of fp8 rows.
FP8_NAN_WORD = 0x7F7F7F7F7F7F7F7F


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


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8 [..., M, K] with per-row 1x128 scales [..., M, K/128] -> fp32."""
    return values.float() * scales.repeat_interleave(128, dim=-1)


def dequantize_blocks(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return values.float() * scales.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)


class FakeDeepGemm(types.ModuleType):
    """deep_gemm's SM90 masked and contiguous grouped GEMMs in torch, checking the layout contracts they document.

    Rows a GEMM does not own (a group's rows at or beyond `masked_m`; rows of `m_indices == -1`) are poisoned
    with NaN (the real kernel leaves them unwritten or writes garbage there), so an adapter reading them gives
    NaN outputs. While it runs, the `HostSyncGuard` of a test is paused: the stand-in reads `masked_m` and
    `m_indices` on the host, the kernel does not.
    """

    def __init__(self, alignment: int = 128) -> None:
        super().__init__("deep_gemm")
        self.alignment = alignment
        self.calls: list[dict[str, Any]] = []
        self.guard: HostSyncGuard | None = None

    def get_mk_alignment_for_contiguous_layout(self) -> int:
        return self.alignment

    def m_grouped_fp8_gemm_nt_contiguous(
        self,
        a: tuple[torch.Tensor, torch.Tensor],
        b: tuple[torch.Tensor, torch.Tensor],
        d: torch.Tensor,
        m_indices: torch.Tensor,
        **options: Any,
    ) -> None:
        if self.guard is not None:
            self.guard.paused += 1
        try:
            self._contiguous_gemm(a, b, d, m_indices, options)
        finally:
            if self.guard is not None:
                self.guard.paused -= 1

    def _contiguous_gemm(self, a, b, d, m_indices, options) -> None:  # noqa: ANN001
        (x, x_scales), (w, w_scales) = a, b
        m, k = x.shape
        groups, n, _ = w.shape
        assert not options, "the adapter relies on the default recipe"
        # gemm.hpp:166-232: A [M, K] K-major, B [G, N, K], D [M, N] bf16 N-major, m_indices int32 [M] contiguous.
        assert x.dtype == FP8 and x.stride() == (k, 1)
        assert w.dtype == FP8 and w.is_contiguous()
        assert d.dtype == torch.bfloat16 and d.shape == (m, n) and d.stride() == (n, 1)
        assert m_indices.dtype == torch.int32 and m_indices.shape == (m,) and m_indices.is_contiguous()
        # SM90 activation scales: fp32, MN-major, TMA-aligned K-block stride (utils/layout.hpp:100-107).
        assert x_scales.dtype == torch.float32 and x_scales.shape == (m, k // 128)
        assert x_scales.stride() == (1, (m + 3) // 4 * 4)
        assert w_scales.dtype == torch.float32 and w_scales.shape == (groups, n // 128, k // 128)
        assert w_scales.is_contiguous()
        # Segments aligned to the block M: a block's first row names its expert (scheduler/gemm.cuh:160-162).
        assert m % self.alignment == 0
        for block in m_indices.view(-1, self.alignment):
            assert 0 <= block[0] < groups, "a block's first row names its expert"
            valid = block >= 0
            assert torch.all(block[valid] == block[0]), "one expert per block"
            assert torch.all(valid[: int(valid.sum())]), "padding only at a segment's end"
        self.calls.append({"layout": "contiguous", "m": m, "n": n, "k": k, "m_indices": m_indices.clone()})

        d.fill_(float("nan"))
        for expert in m_indices.unique().tolist():
            if expert < 0:
                continue
            rows = (m_indices == expert).nonzero().flatten()
            # float64 as in the masked stand-in below.
            x_rows = dequantize_rows(x[rows], x_scales[rows]).double()
            d[rows] = (x_rows @ dequantize_blocks(w[expert], w_scales[expert]).double().T).to(torch.bfloat16)

    def m_grouped_fp8_gemm_nt_masked(
        self,
        a: tuple[torch.Tensor, torch.Tensor],
        b: tuple[torch.Tensor, torch.Tensor],
        d: torch.Tensor,
        masked_m: torch.Tensor,
        expected_m: int,
        **options: Any,
    ) -> None:
        if self.guard is not None:
            self.guard.paused += 1
        try:
            self._gemm(a, b, d, masked_m, expected_m, options)
        finally:
            if self.guard is not None:
                self.guard.paused -= 1

    def _gemm(self, a, b, d, masked_m, expected_m, options) -> None:  # noqa: ANN001
        (x, x_scales), (w, w_scales) = a, b
        groups, m, k = x.shape
        _, n, _ = w.shape
        assert not options, "the adapter relies on the default recipe"
        # gemm.hpp:260-279 and utils/layout.hpp:13-30: A, B K-major with stride(0) = rows x cols, D N-major.
        assert x.dtype == FP8 and x.stride() == (m * k, k, 1)
        assert w.dtype == FP8 and w.is_contiguous() and w.shape == (groups, n, k)
        assert d.dtype == torch.bfloat16 and d.shape == (groups, m, n) and d.stride() == (m * n, n, 1)
        assert masked_m.dtype == torch.int32 and masked_m.shape == (groups,) and masked_m.is_contiguous()
        assert isinstance(expected_m, int) and 0 < expected_m <= m
        # SM90 activation scales: fp32, MN-major, TMA-aligned (utils/layout.hpp:100-107), already in the layout
        # `get_mn_major_tma_aligned_tensor` returns untouched (smxx_layout.hpp:124).
        aligned_m = (m + 3) // 4 * 4
        assert x_scales.dtype == torch.float32 and x_scales.shape == (groups, m, k // 128)
        assert x_scales.stride() == (aligned_m * (k // 128), 1, aligned_m)
        assert w_scales.dtype == torch.float32 and w_scales.shape == (groups, n // 128, k // 128)
        assert w_scales.is_contiguous()
        # Whole 128-row tiles stay inside their group (runtime_utils.hpp:190-245, 2-D tensor maps).
        assert m % 128 == 0
        counts = masked_m.tolist()
        assert all(0 <= c <= m for c in counts)
        self.calls.append({"layout": "masked", "m": m, "n": n, "k": k, "expected_m": expected_m, "masked_m": counts})

        d.fill_(float("nan"))
        for g, count in enumerate(counts):
            if count == 0:
                continue
            # float64, as in `requantising_formulation`: fp32 products of different shapes sum in different
            # orders per CPU kernel, and a bf16 or e4m3 rounding step downstream then flips (seen on an AMD
            # EPYC host: one element 0.5 off); in float64 both sides round the same sums.
            rows = dequantize_rows(x[g, :count], x_scales[g, :count]).double()
            d[g, :count] = (rows @ dequantize_blocks(w[g], w_scales[g]).double().T).to(torch.bfloat16)


# Ops that read a device value on the host (`.item()`, `int(t)`, `float(t)`, `bool(t)`, `.tolist()` all end in
# `_local_scalar_dense`) or whose output shape depends on the data.
FORBIDDEN_OPS = (
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten.masked_scatter",
    "aten.unique",
    "aten._unique",
    "aten.bincount",
    "aten.item",
    "aten.argwhere",
    "aten.repeat_interleave.Tensor",
    "aten._assert_async",
)


class HostSyncGuard(TorchDispatchMode):
    """Records every aten op with its output shapes; raises on an op that syncs or has a data-dependent shape.

    Boolean-mask indexing dispatches `nonzero`; a `.cpu()`/`.to("cpu")` of a CUDA tensor is a device
    copy; on CPU both are caught through the ops above and the Python-level patches of `syncs_forbidden`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.paused = 0
        self.trace: list[tuple[str, tuple[tuple[int, ...], ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        result = func(*args, **(kwargs or {}))
        if self.paused:
            return result
        name = str(func)
        if name.startswith(FORBIDDEN_OPS):
            raise AssertionError(f"host sync or data-dependent shape in the pipeline: {name}")
        if name.startswith(("aten.index.", "aten.index_put", "aten._index_put_impl_")):
            indices = args[1] if len(args) > 1 else ()
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                raise AssertionError(f"boolean-mask indexing in the pipeline: {name}")
        target = (kwargs or {}).get("device")
        if name.startswith(("aten._to_copy", "aten.copy_")) and target is not None and torch.device(target).type == "cpu":
            if any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args):
                raise AssertionError("device-to-host copy in the pipeline")
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        shapes = tuple(tuple(o.shape) for o in outputs if isinstance(o, torch.Tensor))
        self.trace.append((name, shapes))
        return result


@pytest.fixture
def syncs_forbidden(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`.item()`, `.tolist()`, `.cpu()`, `.numpy()` and `torch.nonzero` raise (the stand-in GEMM excepted)."""
    guard_holder: list[HostSyncGuard] = []

    def forbid(name: str, original: Any) -> Any:
        def patched(*args: Any, **kwargs: Any) -> Any:
            guards = [g for g in guard_holder if not g.paused]
            if guards:
                raise AssertionError(f"{name} called in the pipeline")
            return original(*args, **kwargs)

        return patched

    for name in ("item", "tolist", "cpu", "numpy", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, forbid(f"Tensor.{name}", getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "nonzero", forbid("torch.nonzero", torch.nonzero))
    yield guard_holder  # type: ignore[misc]


@pytest.fixture(autouse=True)
def fresh_workspaces(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No workspace crosses tests; every new one is poisoned (NaN everywhere but d2's zero row), so a result
    that depends on a buffer part the call did not write shows up as NaN."""
    allocate = deepgemm_moe.Workspace.allocate

    def poisoned(*args: Any, **kwargs: Any) -> deepgemm_moe.Workspace:
        ws = allocate(*args, **kwargs)
        if ws.x_rows.device.type == "cpu":
            with _disable_current_modes():  # the test's bookkeeping, not the pipeline's
                poison(ws)
        return ws

    def poison(ws: deepgemm_moe.Workspace) -> None:
        assert torch.all(ws.gemm2_out[-1] == 0), "the zero row must be zeroed by the allocation"
        ws.x_rows.fill_(FP8_NAN_WORD)
        ws.act_rows.fill_(FP8_NAN_WORD)
        for buffer in (ws.x_scales, ws.gemm1_out, ws.act_scales, ws.gemm2_out[:-1]):
            buffer.fill_(float("nan"))

    deepgemm_moe.release_workspaces()
    monkeypatch.setattr(deepgemm_moe.Workspace, "allocate", staticmethod(poisoned))
    yield
    deepgemm_moe.release_workspaces()


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


@pytest.mark.parametrize(("num_tokens", "offset"), [(24, 0), (130, 96), (5, 224)])
def test_pipeline_matches_a_formulation_with_the_same_roundings(num_tokens: int, offset: int) -> None:
    inputs = moe_inputs(num_tokens=num_tokens, offset=offset, seed=offset + 1)
    fake = FakeDeepGemm()
    output = run_pipeline(inputs, fake)
    rows = 128 * ((num_tokens + 127) // 128)
    assert len(fake.calls) == 2
    assert (fake.calls[0]["m"], fake.calls[0]["n"], fake.calls[0]["k"]) == (rows, 512, 256)  # GEMM1
    assert (fake.calls[1]["m"], fake.calls[1]["n"], fake.calls[1]["k"]) == (rows, 256, 256)  # GEMM2
    assert fake.calls[0]["masked_m"] == fake.calls[1]["masked_m"]
    experts, _ = reference._route(inputs["routing_logits"], inputs["routing_bias"], 2.5)
    local = experts - offset
    assert fake.calls[0]["masked_m"] == [int((local == e).sum()) for e in range(NUM_LOCAL)]
    assert fake.calls[0]["expected_m"] == deepgemm_moe.expected_rows(num_tokens)
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


def test_a_kept_workspace_carries_nothing_into_the_next_call() -> None:
    """Two calls at one T share the workspace; the second's result is its own (stale rows never read)."""
    fake = FakeDeepGemm()
    first = moe_inputs(num_tokens=40, offset=64, seed=11)
    second = moe_inputs(num_tokens=40, offset=64, seed=12)
    second["routing_logits"][:20, 64:96] -= 50.0  # fewer local pairs than the first call left behind
    run_pipeline(first, fake)
    kept = dict(deepgemm_moe._KEPT)
    output = run_pipeline(second, fake)
    assert len(kept) == 1 and deepgemm_moe._KEPT == kept
    torch.testing.assert_close(output, requantising_formulation(second), rtol=1e-2, atol=1e-2)
    run_pipeline(moe_inputs(num_tokens=200, offset=64, seed=13), fake)  # another T replaces it
    assert len(deepgemm_moe._KEPT) == 1 and deepgemm_moe._KEPT != kept


def test_the_pipeline_has_no_host_sync_and_no_data_dependent_shape(syncs_forbidden: list) -> None:
    """Structurally capturable: no host read, and the same ops with the same shapes whatever the routing."""
    traces = []
    for shift in (0.0, 50.0, -50.0):  # mixed routing; every pair local; no pair local
        inputs = moe_inputs(num_tokens=19, offset=128, seed=21)
        inputs["routing_logits"][:, 128:160] += shift
        deepgemm_moe.release_workspaces()  # each trace includes the workspace's allocation
        fake, guard = FakeDeepGemm(), HostSyncGuard()
        fake.guard = guard
        syncs_forbidden[:] = [guard]
        with guard:
            output = run_pipeline(inputs, fake)
        syncs_forbidden[:] = []
        traces.append(guard.trace)
        if shift < 0:
            assert torch.all(output == 0) and fake.calls[0]["masked_m"] == [0] * NUM_LOCAL
        else:
            assert torch.isfinite(output.float()).all()
    assert traces[0] == traces[1] == traces[2]
    assert len(traces[0]) > 30


def test_the_guard_catches_what_it_is_for(syncs_forbidden: list) -> None:
    guard = HostSyncGuard()
    syncs_forbidden[:] = [guard]
    x = torch.arange(6.0)
    with guard:
        for sync in (lambda: x.sum().item(), lambda: x.tolist(), lambda: x[x > 2], lambda: int(x[1])):
            with pytest.raises(AssertionError):
                sync()
    syncs_forbidden[:] = []


def test_routing_is_our_references_routing() -> None:
    inputs = moe_inputs(num_tokens=33, offset=0, seed=9)
    args = inputs["routing_logits"], inputs["routing_bias"], 2.5
    ours, theirs = deepgemm_moe.route(*args), reference._route(*args)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_masked_layout_places_every_local_pair_once() -> None:
    experts = torch.tensor([[3, 40, 5, 70, 90, 100, 110, 120], [5, 6, 200, 201, 202, 203, 204, 205], [1] * 8])
    experts[2] = torch.tensor([250, 251, 252, 253, 254, 255, 249, 248])  # no local expert
    layout = deepgemm_moe.masked_layout(experts, local_expert_offset=0, num_local=32)
    counts = [0] * 32
    counts[3], counts[5], counts[6] = 1, 2, 1
    assert layout.masked_m.dtype == torch.int32 and layout.masked_m.tolist() == counts
    assert layout.is_local.tolist()[0] == [True, False, True] + [False] * 5
    assert layout.group.tolist() == [
        [3, 32, 5, 32, 32, 32, 32, 32],
        [5, 6, 32, 32, 32, 32, 32, 32],
        [32] * 8,
    ]
    # Local pairs: slots in token order within their expert; others: their token's row of group 32.
    assert layout.row.tolist() == [[0, 0, 0, 0, 0, 0, 0, 0], [1, 0, 1, 1, 1, 1, 1, 1], [2] * 8]


def test_masked_layout_with_an_offset_and_random_routing() -> None:
    gen = torch.Generator().manual_seed(3)
    experts = torch.stack([torch.randperm(256, generator=gen)[:8] for _ in range(300)])
    layout = deepgemm_moe.masked_layout(experts, local_expert_offset=96, num_local=32)
    local = experts - 96
    for e in range(32):
        tokens = (local == e).any(dim=1).nonzero().flatten()
        assert layout.masked_m[e] == len(tokens)
        chosen = local == e
        assert layout.row[chosen].tolist() == list(range(len(tokens)))  # token order, dense
    assert torch.all(layout.group[~layout.is_local] == 32)
    assert torch.equal(layout.row[~layout.is_local], torch.arange(300)[:, None].expand(300, 8)[~layout.is_local])


def test_rows_and_scales_land_in_deepgemms_layout() -> None:
    hidden_states = (torch.randn(5, 256) * 4).to(FP8)
    scales = torch.rand(2, 5)
    experts = torch.tensor([[0, 1, 100, 101, 102, 103, 104, 105]] * 2 + [[1, 31, 200, 201, 202, 203, 204, 205]] * 3)
    layout = deepgemm_moe.masked_layout(experts, 0, 32)
    ws = deepgemm_moe.Workspace.allocate(32, 128, 256, 256, torch.device("cpu"))
    words = hidden_states.view(torch.int64)[:, None, :]
    deepgemm_moe.scatter_rows(ws.x_rows, ws.x_scales, layout, words, scales.T[:, None, :])
    x, sfx = ws.x_rows[:32].view(FP8), ws.x_scales[:32].transpose(1, 2)
    assert x.shape == (32, 128, 256) and sfx.shape == (32, 128, 2) and sfx.stride() == (256, 1, 128)
    assert torch.equal(x[1, :5].view(torch.uint8), hidden_states.view(torch.uint8))  # every token chose 1
    assert torch.equal(x[31, :3].view(torch.uint8), hidden_states[2:].view(torch.uint8))
    assert torch.equal(sfx[1, :5], scales.T) and torch.equal(sfx[0, :2], scales.T[:2])


def test_requantisation_round_trips_within_e4m3_precision() -> None:
    gemm1_out = (torch.randn(8, 512) * 3).bfloat16()
    gemm1_out[3, 256:384] = 0  # an all-zero block quantises to zeros
    quantized, scales = deepgemm_moe.swiglu_requantize(gemm1_out)
    assert quantized.dtype == FP8 and quantized.shape == (8, 256) and scales.shape == (8, 2)
    exact = F.silu(gemm1_out[:, 256:].float()) * gemm1_out[:, :256].float()
    restored = dequantize_rows(quantized, scales)
    assert torch.all(restored[3, :128] == 0)
    amax = exact.abs().view(8, 2, 128).amax(dim=-1)
    assert restored.abs().view(8, 2, 128).amax(dim=-1)[amax > 0].allclose(amax[amax > 0], rtol=1e-6)
    assert ((restored - exact).norm() / exact.norm()).item() < 0.04


def test_row_budget_and_expected_m_come_from_t_only() -> None:
    assert [deepgemm_moe.row_budget(t) for t in (1, 7, 128, 129, 901, 14107)] == [128, 128, 128, 256, 1024, 14208]
    assert [deepgemm_moe.expected_rows(t) for t in (1, 7, 80, 901, 14107)] == [1, 1, 3, 34, 530]


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
    with pytest.raises(deepgemm_moe.LibraryUnavailableError, match="lacks m_grouped_fp8_gemm_nt_masked"):
        load_uncached()
    partial = types.ModuleType("deep_gemm")
    partial.m_grouped_fp8_gemm_nt_masked = fake.m_grouped_fp8_gemm_nt_masked  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deep_gemm", partial)
    with pytest.raises(deepgemm_moe.LibraryUnavailableError, match="lacks m_grouped_fp8_gemm_nt_contiguous"):
        load_uncached()


# Contiguous layout (T > PREFILL_TOKENS). Small T on CPU: the split is moved below them.


@pytest.fixture
def contiguous_at_every_t(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deepgemm_moe, "PREFILL_TOKENS", 0)


@pytest.mark.parametrize(("num_tokens", "offset", "alignment"), [(24, 0, 32), (130, 96, 128), (40, 224, 64)])
def test_contiguous_pipeline_matches_a_formulation_with_the_same_roundings(
    contiguous_at_every_t: None, num_tokens: int, offset: int, alignment: int
) -> None:
    inputs = moe_inputs(num_tokens=num_tokens, offset=offset, seed=offset + 2)
    fake = FakeDeepGemm(alignment)
    output = run_pipeline(inputs, fake)
    assert [c["layout"] for c in fake.calls] == ["contiguous"] * 2
    assert (fake.calls[0]["n"], fake.calls[0]["k"]) == (512, 256)  # GEMM1: [M, H] x [2I, H]^T
    assert (fake.calls[1]["n"], fake.calls[1]["k"]) == (256, 256)  # GEMM2: [M, I] x [H, I]^T
    assert torch.equal(fake.calls[0]["m_indices"], fake.calls[1]["m_indices"])
    experts, _ = reference._route(inputs["routing_logits"], inputs["routing_bias"], 2.5)
    local = experts - offset
    counts = [int((local == e).sum()) for e in range(NUM_LOCAL)]
    assert fake.calls[0]["m"] == sum(-(-c // alignment) * alignment for c in counts)
    assert torch.bincount(fake.calls[0]["m_indices"] + 1, minlength=NUM_LOCAL + 1)[1:].tolist() == counts
    torch.testing.assert_close(output, requantising_formulation(inputs), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("prefill_tokens", [1024, 0], ids=["masked", "contiguous"])
def test_uneven_routing_in_both_layouts(monkeypatch: pytest.MonkeyPatch, prefill_tokens: int) -> None:
    """Every token on one expert (several 32-row blocks), a third on another, the rest spread thin."""
    monkeypatch.setattr(deepgemm_moe, "PREFILL_TOKENS", prefill_tokens)
    inputs = moe_inputs(num_tokens=45, offset=160, seed=31)
    inputs["routing_bias"][160 + 3] = 1.0  # selection is by biased score: expert 3 always wins
    inputs["routing_bias"][160 + 17] = 0.5  # expert 17 wins where its logit is high
    inputs["routing_logits"][:, 160 + 17] = -50.0
    inputs["routing_logits"][::3, 160 + 17] = 50.0
    fake = FakeDeepGemm(alignment=32)
    output = run_pipeline(inputs, fake)
    layout = "masked" if prefill_tokens else "contiguous"
    assert [c["layout"] for c in fake.calls] == [layout] * 2
    if layout == "contiguous":
        m_indices = fake.calls[0]["m_indices"]
        assert int((m_indices == 3).sum()) == 45 and int((m_indices == 17).sum()) == 15
    torch.testing.assert_close(output, requantising_formulation(inputs), rtol=1e-2, atol=1e-2)


def test_pipeline_against_our_reference_in_the_contiguous_layout(contiguous_at_every_t: None) -> None:
    inputs = moe_inputs(num_tokens=64, offset=32, seed=5, intermediate=512)
    fake = FakeDeepGemm()
    output = run_pipeline(inputs, fake)
    assert [c["layout"] for c in fake.calls] == ["contiguous"] * 2
    stats = compare_output(CONTEST_RULE, output, reference._moe_forward(*inputs.values()))
    assert stats.passed, stats.reason
    assert stats.nan_count == 0
    assert stats.relative_l2 is not None and 5e-3 < stats.relative_l2 < 5e-2


def test_contiguous_tokens_without_a_local_expert_get_zero_rows_and_no_rank_work_means_no_gemm(
    contiguous_at_every_t: None,
) -> None:
    inputs = moe_inputs(num_tokens=12, offset=0, seed=3)
    inputs["routing_logits"][:4, :32] -= 50.0  # tokens 0..3 route away from experts 0..31
    output = run_pipeline(inputs, FakeDeepGemm())
    assert torch.all(output[:4] == 0) and torch.all(output[4:].abs().sum(dim=1) > 0)
    torch.testing.assert_close(output, requantising_formulation(inputs), rtol=1e-2, atol=1e-2)

    inputs["routing_logits"][:, :32] -= 50.0
    fake = FakeDeepGemm()
    output = run_pipeline(inputs, fake)
    assert fake.calls == [] and torch.all(output == 0)


@pytest.mark.parametrize(("num_tokens", "layout"), [(1024, "masked"), (1025, "contiguous")])
def test_the_layout_follows_the_phase(monkeypatch: pytest.MonkeyPatch, num_tokens: int, layout: str) -> None:
    """Masked up to PREFILL_TOKENS = 1024, contiguous above; both layouts give the same result."""
    assert deepgemm_moe.PREFILL_TOKENS == 1024
    inputs = moe_inputs(num_tokens=num_tokens, offset=64, seed=2)
    fake = FakeDeepGemm()
    output = run_pipeline(inputs, fake)
    assert [c["layout"] for c in fake.calls] == [layout] * 2
    monkeypatch.setattr(deepgemm_moe, "PREFILL_TOKENS", 2048 if layout == "contiguous" else 0)
    other = FakeDeepGemm()
    torch.testing.assert_close(run_pipeline(inputs, other), output, rtol=1e-2, atol=1e-2)
    assert [c["layout"] for c in other.calls] != [c["layout"] for c in fake.calls]


def test_the_contiguous_path_reads_the_host_exactly_once(
    contiguous_at_every_t: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One `.tolist()` and nothing else that reads device data (the guard refuses `.item()`, `int(t)`,
    `nonzero`, boolean masks), whatever the routing."""
    reads: list[str] = []
    guard = HostSyncGuard()

    def counted(name: str, original: Any) -> Any:
        def patched(*args: Any, **kwargs: Any) -> Any:
            if not guard.paused:
                reads.append(name)
            return original(*args, **kwargs)

        return patched

    for name in ("item", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    for shift in (0.0, 50.0, -50.0):  # mixed routing; every pair local; no pair local
        inputs = moe_inputs(num_tokens=19, offset=128, seed=21)
        inputs["routing_logits"][:, 128:160] += shift
        fake = FakeDeepGemm()
        fake.guard = guard
        reads.clear()
        with guard:
            run_pipeline(inputs, fake)
        assert reads == ["tolist"]
        assert len(fake.calls) == (0 if shift < 0 else 2)


def test_the_contiguous_path_under_a_host_read_ban_raises(contiguous_at_every_t: None, syncs_forbidden: list) -> None:
    guard = HostSyncGuard()
    syncs_forbidden[:] = [guard]
    with guard, pytest.raises(AssertionError, match="Tensor.tolist called in the pipeline"):
        run_pipeline(moe_inputs(num_tokens=19, offset=128, seed=21), FakeDeepGemm())
    syncs_forbidden[:] = []


def test_the_contiguous_path_refuses_a_cuda_graph_capture(
    contiguous_at_every_t: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside a capture it raises before its host read, with the reason, so the harness records NOT_CAPTURABLE."""
    monkeypatch.setattr(deepgemm_moe, "capturing", lambda device: True)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("read the host while capturing"))
    fake = FakeDeepGemm()
    with pytest.raises(deepgemm_moe.HostSyncInCapture, match="host sync.*not capturable in a CUDA graph"):
        run_pipeline(moe_inputs(num_tokens=19, offset=128, seed=21), fake)
    assert fake.calls == []
    assert issubclass(deepgemm_moe.HostSyncInCapture, RuntimeError)


def test_contiguous_layout_places_every_local_pair_once() -> None:
    experts = torch.tensor([[3, 40, 5, 70, 90, 100, 110, 120], [5, 6, 200, 201, 202, 203, 204, 205], [1] * 8])
    experts[2] = torch.tensor([250, 251, 252, 253, 254, 255, 249, 248])  # no local expert
    weights = torch.arange(24, dtype=torch.float32).view(3, 8)
    layout = deepgemm_moe.contiguous_layout(experts, weights, local_expert_offset=0, num_local=32, alignment=4)
    assert layout is not None
    # Experts 3, 5, 6 hold 1, 2, 1 pairs -> segments of 4 rows each.
    assert layout.num_rows == 12
    assert layout.m_indices.dtype == torch.int32
    assert layout.m_indices.tolist() == [3, -1, -1, -1, 5, 5, -1, -1, 6, -1, -1, -1]
    assert layout.pair_rows.tolist() == [0, 4, 5, 8]
    assert layout.pair_tokens.tolist() == [0, 0, 1, 1]
    assert layout.pair_weights.tolist() == [0.0, 2.0, 8.0, 9.0]
    assert layout.row_token.tolist() == [0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0]
    assert deepgemm_moe.contiguous_layout(experts[2:], weights[2:], 0, 32, 4) is None


def test_contiguous_layout_with_an_offset_and_random_routing() -> None:
    gen = torch.Generator().manual_seed(4)
    experts = torch.stack([torch.randperm(256, generator=gen)[:8] for _ in range(300)])
    weights = torch.rand(300, 8, generator=gen)
    layout = deepgemm_moe.contiguous_layout(experts, weights, local_expert_offset=64, num_local=32, alignment=128)
    assert layout is not None
    local = experts - 64
    start = 0
    for e in range(32):
        tokens, slots = ((local == e)).nonzero(as_tuple=True)  # token order
        rows = torch.arange(start, start + len(tokens))
        assert torch.all(layout.m_indices[rows] == e)
        assert torch.all(layout.m_indices[start + len(tokens) : start + -(-len(tokens) // 128) * 128] == -1)
        assert torch.equal(layout.row_token[rows], tokens)
        chosen = (layout.pair_rows >= start) & (layout.pair_rows < start + len(tokens))
        assert torch.equal(layout.pair_rows[chosen], rows) and torch.equal(layout.pair_tokens[chosen], tokens)
        assert torch.equal(layout.pair_weights[chosen], weights[tokens, slots])
        start += -(-len(tokens) // 128) * 128
    assert layout.num_rows == start and len(layout.pair_rows) == int(((local >= 0) & (local < 32)).sum())


def test_activation_rows_and_scales_are_built_in_deepgemms_contiguous_layout() -> None:
    hidden_states = (torch.randn(5, 256) * 4).to(FP8)
    scales = torch.rand(2, 5)
    row_token = torch.tensor([4, 0, 0, 2, 1, 3, 3, 3])
    rows, row_scales = deepgemm_moe.gather_activations(hidden_states, scales, row_token)
    assert rows.dtype == FP8 and torch.equal(rows.view(torch.uint8), hidden_states[row_token].view(torch.uint8))
    assert row_scales.stride() == (1, 8) and torch.equal(row_scales, scales.T[row_token])
    activation_scales = torch.rand(8, 2)
    assert deepgemm_moe.mn_major(activation_scales).stride() == (1, 8)
    assert torch.equal(deepgemm_moe.mn_major(activation_scales), activation_scales)


def test_the_two_combines_agree() -> None:
    """combine_slots (every slot, zero row for other ranks') and combine_pairs (local pairs only)."""
    rows = torch.randn(10, 256).bfloat16()
    rows[-1] = 0
    index = torch.tensor([[0, 9, 3], [9, 9, 9], [4, 5, 9]])
    weights = torch.rand(3, 3)
    by_slots = torch.empty(3, 256, dtype=torch.bfloat16)
    deepgemm_moe.combine_slots(rows, index, weights, by_slots)
    local = index != 9
    tokens = torch.arange(3)[:, None].expand(3, 3)[local]
    by_pairs = torch.full((3, 256), 7.0, dtype=torch.bfloat16)
    deepgemm_moe.combine_pairs(rows, index[local], tokens, weights[local], by_pairs)
    assert torch.all(by_pairs[1] == 0)
    torch.testing.assert_close(by_pairs, by_slots, rtol=0, atol=0)


def _deep_gemm_or_skip() -> None:
    try:
        deepgemm_moe.load_deep_gemm()
    except deepgemm_moe.LibraryUnavailableError as error:
        pytest.skip(str(error))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("num_tokens", "offset"), [(1, 0), (7, 192), (80, 32), (901, 224)])
def test_deepgemm_against_our_reference_on_gpu(num_tokens: int, offset: int) -> None:
    _deep_gemm_or_skip()
    inputs = moe_inputs(num_tokens, offset, seed=num_tokens, hidden=7168, intermediate=2048, device="cuda")
    expected = reference.run(*inputs.values())
    output = torch.full_like(expected, float("nan"))
    deepgemm_moe.run(*inputs.values(), output)
    torch.cuda.synchronize()
    stats = compare_output(CONTEST_RULE, output, expected)
    assert stats.passed, stats.reason
    assert stats.nan_count == 0
    # The e4m3 requantisation of the SwiGLU output: ~2.5 % (module docstring).
    assert stats.relative_l2 is not None and stats.relative_l2 < 5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens", [7, 901])
def test_deepgemm_call_replays_from_a_cuda_graph(num_tokens: int) -> None:
    """One call captured after an eager warm-up (which JIT-compiles the GEMMs); the replay equals the eager
    output bit for bit, and follows new inputs written in place."""
    _deep_gemm_or_skip()
    inputs = moe_inputs(num_tokens, 96, seed=3, hidden=7168, intermediate=2048, device="cuda")
    eager = torch.empty(num_tokens, 7168, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        deepgemm_moe.run(*inputs.values(), eager)  # warm-up: compiles, fills the kept workspace of `side`
    torch.cuda.current_stream().wait_stream(side)
    deepgemm_moe.run(*inputs.values(), eager)
    torch.cuda.synchronize()

    replayed = torch.full_like(eager, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        deepgemm_moe.run(*inputs.values(), replayed)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)

    fresh = moe_inputs(num_tokens, 96, seed=4, hidden=7168, intermediate=2048, device="cuda")
    for name, value in fresh.items():
        if isinstance(value, torch.Tensor):
            inputs[name].copy_(value)
    graph.replay()
    deepgemm_moe.run(*inputs.values(), eager)
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)
    stats = compare_output(CONTEST_RULE, replayed, reference.run(*inputs.values()))
    assert stats.passed, stats.reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("num_tokens", "offset"), [(1025, 0), (14107, 96)])
def test_deepgemm_contiguous_against_our_reference_on_gpu(num_tokens: int, offset: int) -> None:
    _deep_gemm_or_skip()
    assert num_tokens > deepgemm_moe.PREFILL_TOKENS
    inputs = moe_inputs(num_tokens, offset, seed=num_tokens, hidden=7168, intermediate=2048, device="cuda")
    expected = reference.run(*inputs.values())
    output = torch.full_like(expected, float("nan"))
    deepgemm_moe.run(*inputs.values(), output)
    torch.cuda.synchronize()
    stats = compare_output(CONTEST_RULE, output, expected)
    assert stats.passed, stats.reason
    assert stats.nan_count == 0
    assert stats.relative_l2 is not None and stats.relative_l2 < 5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_deepgemm_contiguous_call_is_not_capturable_and_leaves_the_device_usable() -> None:
    """The harness's capture reports the host sync (NOT_CAPTURABLE); eager calls go on working."""
    from hopperbench.timing.graph import NotCapturable, capture_call

    _deep_gemm_or_skip()
    inputs = moe_inputs(1025, 32, seed=6, hidden=7168, intermediate=2048, device="cuda")
    output = torch.empty(1025, 7168, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(NotCapturable, match=r"^HostSyncInCapture: .*host sync"):
        capture_call(deepgemm_moe.run, (*inputs.values(), output))
    output.fill_(float("nan"))
    deepgemm_moe.run(*inputs.values(), output)
    torch.cuda.synchronize()
    stats = compare_output(CONTEST_RULE, output, reference.run(*inputs.values()))
    assert stats.passed, stats.reason
