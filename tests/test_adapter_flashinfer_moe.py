"""FlashInfer moe adapter: the pipeline on CPU with a torch stand-in for FlashInfer's routing and fused MoE (checking
the contracts the adapter relies on, computing with FlashInfer's roundings), its freedom from host syncs and
data-dependent shapes, the loader's refusals; on GPU the results against our reference and a CUDA-graph replay."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hopperbench.acceptance import compare_output
from hopperbench.tracks import MOE
from hopperbench.tracks.moe import reference
from hopperbench.tracks.moe.adapters import flashinfer_moe
from tests.test_adapter_deepgemm import (  # noqa: F401  (syncs_forbidden is a fixture)
    HostSyncGuard,
    dequantize_blocks,
    moe_inputs,
    syncs_forbidden,
)

FP8 = torch.float8_e4m3fn
NUM_LOCAL = 32
CONTEST_RULE = MOE.acceptance


def quantize_1x128(values: torch.Tensor) -> torch.Tensor:
    """FlashInfer's activation quantisation inside its block-scale GEMMs, back in fp32: e4m3 codes with one
    amax / 448 scale per row and 128 columns (fp8_blockscale_gemm.cu:100-121)."""
    blocks = values.float().view(*values.shape[:-1], -1, 128)
    scales = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / 448.0
    return ((blocks / scales).to(FP8).float() * scales).view(values.shape)


class FakeFlashInfer:
    """`fused_topk_deepseek`, `cutlass_fused_moe` (DeepSeek block-scale path) and the workspace query in torch.

    Each checks the contract the adapter relies on (dtypes, shapes, layouts, the EP split) and computes with
    FlashInfer's roundings: the routing in fp32; the bf16 input quantised to e4m3 1x128, GEMM1 (float64 sums)
    to bf16, SwiGLU silu(gate = second half) * up to bf16, quantised again, GEMM2 to bf16, the weighted sum of a
    token's local slots in fp32 to bf16. While it runs, a test's `HostSyncGuard` is paused (the stand-in reads
    the routing on the host; the kernels do not).
    """

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.guard: HostSyncGuard | None = None

    def _paused(self) -> Any:
        fake = self

        class Paused:
            def __enter__(self) -> None:
                if fake.guard is not None:
                    fake.guard.paused += 1

            def __exit__(self, *exc: object) -> None:
                if fake.guard is not None:
                    fake.guard.paused -= 1

        return Paused()

    def workspace_size(
        self, num_tokens: int, hidden: int, intermediate: int, ep_size: int, ep_rank: int, device: torch.device
    ) -> int:
        return 1000 + num_tokens

    def fused_topk_deepseek(
        self, scores, bias, n_group, topk_group, topk, routed_scaling_factor, topk_values, topk_indices, *rest, **kw
    ) -> None:  # noqa: ANN001
        assert not rest and not kw, "the adapter relies on the defaults (PDL launch, no replay buffer)"
        # noAuxTcKernels.cu:383-386, fused_routing_dsv3.py:133-146: dense contiguous tensors, fp32 values (the
        # scores' dtype) and int32 indices; a bf16 bias with fp32 scores is a supported pair (:460-466).
        assert scores.dtype == torch.float32 and scores.is_contiguous() and scores.shape[1] == 256
        assert bias.shape == (256,) and bias.is_contiguous() and bias.dtype in (torch.float32, torch.bfloat16)
        assert (n_group, topk_group, topk) == (8, 4, 8) and isinstance(routed_scaling_factor, float)
        assert topk_values.dtype == torch.float32 and topk_values.shape == (scores.shape[0], 8)
        assert topk_indices.dtype == torch.int32 and topk_indices.shape == (scores.shape[0], 8)
        assert topk_values.is_contiguous() and topk_indices.is_contiguous()
        with self._paused():
            experts, weights = reference._route(scores, bias, routed_scaling_factor)
            topk_indices.copy_(experts)
            topk_values.copy_(weights)

    def cutlass_fused_moe(
        self,
        input: torch.Tensor,
        token_selected_experts: torch.Tensor,
        token_final_scales: torch.Tensor,
        fc1_expert_weights: torch.Tensor,
        fc2_expert_weights: torch.Tensor,
        output_dtype: torch.dtype,
        quant_scales: list[torch.Tensor],
        **options: Any,
    ) -> list[torch.Tensor]:
        output = options.pop("output")
        workspace_buffer = options.pop("workspace_buffer")
        ep_size, ep_rank = options.pop("ep_size"), options.pop("ep_rank")
        assert options == {"use_deepseek_fp8_block_scale": True, "profile_ids": [-1, -1]}
        num_tokens, hidden = input.shape
        experts_here, gemm1_size, _ = fc1_expert_weights.shape
        intermediate = gemm1_size // 2
        # binding.cu:191-194,358-362: bf16 activations with fp8 weights, int32 ids, fp32 weights.
        assert input.dtype == torch.bfloat16 and input.is_contiguous()
        assert token_selected_experts.dtype == torch.int32 and token_selected_experts.shape == (num_tokens, 8)
        assert token_final_scales.dtype == torch.float32 and token_final_scales.shape == (num_tokens, 8)
        # binding.cu:402-410: fc1 [E, 2I, H], fc2 [E, H, I].
        assert fc1_expert_weights.dtype == FP8 and fc1_expert_weights.is_contiguous()
        assert fc2_expert_weights.dtype == FP8 and fc2_expert_weights.is_contiguous()
        assert fc2_expert_weights.shape == (experts_here, hidden, intermediate)
        assert output_dtype == torch.bfloat16 and output.dtype == torch.bfloat16 and output.shape == input.shape
        # binding.cu:1543-1548 and fp8_blockscale_gemm_kernel.cuh:287-292: [E, N/128, K/128] fp32, contiguous.
        s1, s2 = quant_scales
        assert s1.dtype == s2.dtype == torch.float32 and s1.is_contiguous() and s2.is_contiguous()
        assert s1.shape == (experts_here, gemm1_size // 128, hidden // 128)
        assert s2.shape == (experts_here, hidden // 128, intermediate // 128)
        assert ep_size * experts_here == 256 and 0 <= ep_rank < ep_size
        assert workspace_buffer.dtype == torch.uint8 and workspace_buffer.dim() == 1
        assert workspace_buffer.numel() >= self.workspace_size(num_tokens, hidden, intermediate, ep_size, ep_rank, input.device)
        self.calls.append({"num_tokens": num_tokens, "ep_rank": ep_rank, "workspace": workspace_buffer})

        with self._paused():
            x = quantize_1x128(input)
            local = token_selected_experts.long() - ep_rank * experts_here
            combined = torch.zeros(num_tokens, hidden, dtype=torch.float32)
            for expert in range(experts_here):
                tokens, slots = (local == expert).nonzero(as_tuple=True)
                if len(tokens) == 0:
                    continue
                w13 = dequantize_blocks(fc1_expert_weights[expert], s1[expert]).double()
                w2 = dequantize_blocks(fc2_expert_weights[expert], s2[expert]).double()
                g1 = (x[tokens].double() @ w13.T).bfloat16().float()
                act = (F.silu(g1[:, intermediate:]) * g1[:, :intermediate]).bfloat16()
                y = (quantize_1x128(act).double() @ w2.T).bfloat16().float()
                combined.index_add_(0, tokens, y * token_final_scales[tokens, slots][:, None])
            output.copy_(combined)
        return [output]


def flashinfer_formulation(inputs: dict[str, Any]) -> torch.Tensor:
    """Token by token, slot by slot, with FlashInfer's roundings (see FakeFlashInfer)."""
    experts, weights = reference._route(inputs["routing_logits"], inputs["routing_bias"], inputs["routed_scaling_factor"])
    x = reference._dequantize_activations(inputs["hidden_states"], inputs["hidden_states_scale"]).bfloat16()
    w13s = [dequantize_blocks(w, s).double() for w, s in zip(inputs["gemm1_weights"], inputs["gemm1_weights_scale"])]
    w2s = [dequantize_blocks(w, s).double() for w, s in zip(inputs["gemm2_weights"], inputs["gemm2_weights_scale"])]
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for slot in range(8):
            e = int(experts[t, slot]) - inputs["local_expert_offset"]
            if not 0 <= e < NUM_LOCAL:
                continue
            g1 = (quantize_1x128(x[t]).double() @ w13s[e].T).bfloat16().float()
            half = g1.shape[0] // 2
            act = (F.silu(g1[half:]) * g1[:half]).bfloat16()
            out[t] += weights[t, slot] * (quantize_1x128(act).double() @ w2s[e].T).bfloat16().float()
    return out.bfloat16()


@pytest.fixture(autouse=True)
def fresh_workspaces() -> Any:
    flashinfer_moe.release_workspaces()
    yield
    flashinfer_moe.release_workspaces()


def run_pipeline(inputs: dict[str, Any], fake: FakeFlashInfer) -> torch.Tensor:
    output = torch.full(inputs["hidden_states"].shape, 7.0, dtype=torch.bfloat16)  # stale values must go
    flashinfer_moe.moe_pipeline(fake, *flashinfer_moe.prepare(*inputs.values()).values(), output)  # type: ignore[arg-type]
    return output


@pytest.mark.parametrize(("num_tokens", "offset"), [(24, 0), (130, 96), (5, 224)])
def test_pipeline_matches_a_formulation_with_flashinfers_roundings(num_tokens: int, offset: int) -> None:
    inputs = moe_inputs(num_tokens=num_tokens, offset=offset, seed=offset + 1)
    fake = FakeFlashInfer()
    output = run_pipeline(inputs, fake)
    assert [(c["num_tokens"], c["ep_rank"]) for c in fake.calls] == [(num_tokens, offset // 32)]
    torch.testing.assert_close(output, flashinfer_formulation(inputs), rtol=1e-2, atol=1e-2)


def test_activations_reach_flashinfer_as_their_bf16_dequantisation() -> None:
    inputs = moe_inputs(num_tokens=9, offset=32, seed=2)
    x = flashinfer_moe.dequantize_activations(inputs["hidden_states"], inputs["hidden_states_scale"])
    expected = reference._dequantize_activations(inputs["hidden_states"], inputs["hidden_states_scale"])
    assert x.dtype == torch.bfloat16 and x.is_contiguous()
    assert torch.equal(x, expected.bfloat16())


def test_pipeline_against_our_reference_under_the_moe_rule() -> None:
    """The contest rule holds; the relative L2 is the requantisation cost the docstring states."""
    inputs = moe_inputs(num_tokens=64, offset=32, seed=5, intermediate=512)
    output = run_pipeline(inputs, FakeFlashInfer())
    stats = compare_output(CONTEST_RULE, output, reference._moe_forward(*inputs.values()))
    assert stats.passed, stats.reason
    assert stats.nan_count == 0
    assert stats.relative_l2 is not None and 5e-3 < stats.relative_l2 < 5e-2


def test_the_pipeline_has_no_host_sync_and_no_data_dependent_shape(syncs_forbidden: list) -> None:  # noqa: F811
    """Our part of the call (dequantisation, buffers, argument mapping) reads nothing back and has the same ops
    with the same shapes whatever the routing."""
    traces = []
    for shift in (0.0, 50.0, -50.0):  # mixed routing; every pair local; no pair local
        inputs = moe_inputs(num_tokens=19, offset=128, seed=21)
        inputs["routing_logits"][:, 128:160] += shift
        flashinfer_moe.release_workspaces()  # each trace includes the workspace's allocation
        fake, guard = FakeFlashInfer(), HostSyncGuard()
        fake.guard = guard
        syncs_forbidden[:] = [guard]
        with guard:
            output = run_pipeline(inputs, fake)
        syncs_forbidden[:] = []
        traces.append(guard.trace)
        if shift < 0:
            assert torch.all(output == 0)
        else:
            assert torch.isfinite(output.float()).all()
    assert traces[0] == traces[1] == traces[2]
    assert len(traces[0]) >= 5


def test_the_workspace_is_kept_and_grows_to_the_largest_token_count() -> None:
    fake = FakeFlashInfer()
    run_pipeline(moe_inputs(num_tokens=40, offset=64, seed=11), fake)
    first = fake.calls[-1]["workspace"]
    run_pipeline(moe_inputs(num_tokens=10, offset=64, seed=12), fake)  # smaller: the same buffer
    assert fake.calls[-1]["workspace"] is first
    run_pipeline(moe_inputs(num_tokens=200, offset=64, seed=13), fake)  # larger: replaced
    assert fake.calls[-1]["workspace"] is not first and fake.calls[-1]["workspace"].numel() == 1200
    assert len(flashinfer_moe._KEPT) == 1


def test_an_offset_flashinfers_ep_split_cannot_express_is_refused() -> None:
    inputs = moe_inputs(num_tokens=4, offset=16, seed=1)
    fake = FakeFlashInfer()
    with pytest.raises(flashinfer_moe.AdapterInputError, match="multiple of 32"):
        run_pipeline(inputs, fake)
    assert fake.calls == []


def test_bad_shapes_and_no_tokens_never_reach_the_library() -> None:
    fake = FakeFlashInfer()
    inputs = moe_inputs(num_tokens=4, offset=0, seed=1)
    inputs["hidden_states_scale"] = inputs["hidden_states_scale"].T.contiguous()
    with pytest.raises(flashinfer_moe.AdapterInputError, match="hidden_states_scale"):
        run_pipeline(inputs, fake)
    unprepared = moe_inputs(num_tokens=4, offset=0, seed=1)  # fp8 activations straight into the call
    with pytest.raises(flashinfer_moe.AdapterInputError, match="bf16 activations prepare"):
        flashinfer_moe.moe_pipeline(fake, *unprepared.values(), torch.empty(4, 256, dtype=torch.bfloat16))  # type: ignore[arg-type]
    empty = moe_inputs(num_tokens=0, offset=0, seed=1)
    run_pipeline(empty, fake)
    assert fake.calls == []
    with pytest.raises(flashinfer_moe.AdapterInputError, match="hidden_states must have shape"):
        flashinfer_moe.run(
            *flashinfer_moe.prepare(*moe_inputs(num_tokens=2, offset=0, seed=1).values()).values(), torch.empty(2, 256)
        )


@pytest.fixture
def fake_flashinfer_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """A stand-in `flashinfer` package (jit.env, fused_moe.core, fused_moe.fused_routing_dsv3) of the pinned
    release, its AOT folder and csrc under tmp_path; records the loads and the JIT switch they saw."""
    state: dict[str, Any] = {"loads": [], "fail": None}
    aot_dir, csrc = tmp_path / "aot", tmp_path / "csrc"
    env = types.ModuleType("flashinfer.jit.env")
    env.get_aot_path = lambda name: aot_dir / name / f"{name}.so"  # type: ignore[attr-defined]
    env.FLASHINFER_CSRC_DIR = csrc  # type: ignore[attr-defined]

    def loader(name: str) -> Any:
        def load(arg: str) -> object:
            state["loads"].append((name, arg, os.environ.get("FLASHINFER_DISABLE_JIT")))
            if state["fail"]:
                raise RuntimeError(f"{state['fail']}\nsecond line")
            return object()

        return load

    core = types.ModuleType("flashinfer.fused_moe.core")
    core.get_cutlass_fused_moe_module = loader("fused_moe")  # type: ignore[attr-defined]
    core.cutlass_fused_moe = lambda *a, **k: None  # type: ignore[attr-defined]
    core.cutlass_fused_moe_workspace_size = lambda *a, **k: 0  # type: ignore[attr-defined]
    routing = types.ModuleType("flashinfer.fused_moe.fused_routing_dsv3")
    routing.get_dsv3_fused_routing_module = loader("routing")  # type: ignore[attr-defined]
    routing.fused_topk_deepseek = lambda *a, **k: None  # type: ignore[attr-defined]
    package, jit, fused_moe = (types.ModuleType(n) for n in ("flashinfer", "flashinfer.jit", "flashinfer.fused_moe"))
    jit.env, fused_moe.core, fused_moe.fused_routing_dsv3 = env, core, routing  # type: ignore[attr-defined]
    package.jit, package.fused_moe = jit, fused_moe  # type: ignore[attr-defined]
    for module in (package, jit, env, fused_moe, core, routing):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(flashinfer_moe.importlib.metadata, "version", lambda name: "0.7.2.post1")
    monkeypatch.delenv("FLASHINFER_DISABLE_JIT", raising=False)
    flashinfer_moe.load_flashinfer.cache_clear()
    state["files"] = flashinfer_moe.prebuilt_paths(env.get_aot_path, csrc)  # type: ignore[attr-defined]
    yield state
    flashinfer_moe.load_flashinfer.cache_clear()


def test_without_the_prebuilt_modules_the_side_is_refused_in_one_line(fake_flashinfer_package: dict) -> None:
    for present in range(3):  # each of the three files missing in turn
        for i, path in enumerate(fake_flashinfer_package["files"]):
            if i < present:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("")
        missing = fake_flashinfer_package["files"][present]
        with pytest.raises(flashinfer_moe.LibraryUnavailableError) as error:
            flashinfer_moe.load_flashinfer()
        message = str(error.value)
        assert "\n" not in message and str(missing) in message and "third_party/README.md" in message
    assert fake_flashinfer_package["loads"] == []  # nothing was loaded, let alone built


def test_the_prebuilt_modules_load_with_flashinfers_jit_disabled(fake_flashinfer_package: dict) -> None:
    for path in fake_flashinfer_package["files"]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    fi = flashinfer_moe.load_flashinfer()
    assert fake_flashinfer_package["loads"] == [("fused_moe", "90", "1"), ("routing", "default", "1")]
    assert "FLASHINFER_DISABLE_JIT" not in os.environ
    assert callable(fi.cutlass_fused_moe) and callable(fi.fused_topk_deepseek)

    flashinfer_moe.load_flashinfer.cache_clear()
    fake_flashinfer_package["fail"] = "JIT compilation is disabled via FLASHINFER_DISABLE_JIT"
    with pytest.raises(flashinfer_moe.LibraryUnavailableError, match="do not load: JIT compilation is disabled") as e:
        flashinfer_moe.load_flashinfer()
    assert "\n" not in str(e.value)
    assert "FLASHINFER_DISABLE_JIT" not in os.environ


def test_an_other_release_is_refused_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    flashinfer_moe.load_flashinfer.cache_clear()
    monkeypatch.setattr(flashinfer_moe.importlib.metadata, "version", lambda name: "0.6.4")
    try:
        with pytest.raises(flashinfer_moe.LibraryUnavailableError, match="needs 0.7.2.post1"):
            flashinfer_moe.load_flashinfer()
    finally:
        flashinfer_moe.load_flashinfer.cache_clear()


def test_the_side_is_registered_with_its_pin_and_its_prepare_step() -> None:
    side = next(lib for lib in MOE.libraries if lib.name == "flashinfer_moe")
    assert side.entry == "flashinfer_moe.py::run" and side.prepare == "prepare"
    assert side.package == f"{flashinfer_moe.FLASHINFER_DISTRIBUTION}=={flashinfer_moe.FLASHINFER_VERSION}"
    assert (MOE.adapters_dir / "flashinfer_moe.py").is_file()
    assert side.timed_call


def _flashinfer_or_skip() -> None:
    try:
        flashinfer_moe.load_flashinfer()
    except flashinfer_moe.LibraryUnavailableError as error:
        pytest.skip(str(error))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("num_tokens", "offset"), [(1, 0), (7, 192), (80, 32), (901, 224), (14107, 96)])
def test_flashinfer_against_our_reference_on_gpu(num_tokens: int, offset: int) -> None:
    _flashinfer_or_skip()
    inputs = moe_inputs(num_tokens, offset, seed=num_tokens, hidden=7168, intermediate=2048, device="cuda")
    expected = reference.run(*inputs.values())
    output = torch.full_like(expected, float("nan"))
    flashinfer_moe.run(*flashinfer_moe.prepare(*inputs.values()).values(), output)
    torch.cuda.synchronize()
    stats = compare_output(CONTEST_RULE, output, expected)
    assert stats.passed, stats.reason
    assert stats.nan_count == 0
    assert stats.relative_l2 is not None and stats.relative_l2 < 5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flashinfers_routing_is_our_references_routing_on_gpu() -> None:
    _flashinfer_or_skip()
    inputs = moe_inputs(901, 0, seed=8, hidden=7168, intermediate=2048, device="cuda")
    args = inputs["routing_logits"], inputs["routing_bias"], 2.5
    experts, weights = flashinfer_moe.route(flashinfer_moe.load_flashinfer(), *args)
    ref_experts, ref_weights = reference._route(*args)
    same = (experts.long().sort(dim=1).values == ref_experts.sort(dim=1).values).all(dim=1)
    assert same.float().mean() > 0.99  # near-ties may differ
    order = experts.long().argsort(dim=1)
    ref_order = ref_experts.argsort(dim=1)
    torch.testing.assert_close(weights.gather(1, order)[same], ref_weights.gather(1, ref_order)[same], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens", [7, 901])
def test_flashinfer_call_replays_from_a_cuda_graph(num_tokens: int) -> None:
    """One call captured after an eager warm-up (which NVRTC-compiles the GEMMs); the replay equals the eager
    output bit for bit, and follows new inputs written in place."""
    _flashinfer_or_skip()
    raw = moe_inputs(num_tokens, 96, seed=3, hidden=7168, intermediate=2048, device="cuda")
    inputs = flashinfer_moe.prepare(*raw.values())
    eager = torch.empty(num_tokens, 7168, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flashinfer_moe.run(*inputs.values(), eager)
    torch.cuda.current_stream().wait_stream(side)
    flashinfer_moe.run(*inputs.values(), eager)
    torch.cuda.synchronize()

    replayed = torch.full_like(eager, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flashinfer_moe.run(*inputs.values(), replayed)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)

    raw = moe_inputs(num_tokens, 96, seed=4, hidden=7168, intermediate=2048, device="cuda")
    for name, value in flashinfer_moe.prepare(*raw.values()).items():
        if isinstance(value, torch.Tensor):
            inputs[name].copy_(value)
    graph.replay()
    flashinfer_moe.run(*inputs.values(), eager)
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)
    stats = compare_output(CONTEST_RULE, replayed, reference.run(*raw.values()))
    assert stats.passed, stats.reason


def test_the_side_is_registered_as_the_moe_flashinfer_baseline() -> None:
    assert MOE.flashinfer_baseline == "flashinfer_moe"
    (side,) = [lib for lib in MOE.libraries if lib.name == "flashinfer_moe"]
    assert side.package == f"flashinfer-python=={flashinfer_moe.FLASHINFER_VERSION}"
