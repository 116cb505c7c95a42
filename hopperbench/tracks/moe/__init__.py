"""The moe track: MoE (DeepSeek-V3 FP8 block-scale experts with no-aux routing, 32 local experts).

This folder is the whole track: the spec below, `definition.json` (with `reference.py` embedded),
`reference.py`, `workloads.tsv`, `synth.py` (inputs), `floor.py` (roofline model) and
`adapters/` (library sides).
"""

from __future__ import annotations

from hopperbench.tracks.model import AcceptanceRule, LibrarySide, SizeClasses, TimingDefaults, Track

MOE = Track(
    name="moe",
    package=__name__,
    definition_name="moe_fp8_block_scale_ds_routing_topk8_ng8_kg4_e32_h7168_i2048",
    op_type="moe",
    acceptance=AcceptanceRule(atol=1.0, rtol=0.3, required_matched_ratio=0.9, outputs=("output",)),
    ours_max_relative_l2=1e-2,
    kernel_entry="kernels/moe/kernel.py::run",
    kernel_start_up="warm_up",  # the L2 partition map of MEDIUM_T's GEMM1 walk
    human_key="moe",
    # Decode-like rows (weight streaming), small batches, prefill sizes (compute-bound).
    size_classes=SizeClasses("seq_len", (100, 1000)),
    flashinfer_baseline="flashinfer_moe",
    # The reference takes 1.7-44 ms per call (Python loops over the local experts): timed like
    # the GDN reference.
    timing=TimingDefaults(reference_iterations=10, reference_time_budget_s=0.2),
    libraries=(
        LibrarySide(
            name="deepgemm_grouped",
            entry="deepgemm_moe.py::run",
            description=(
                "DeepGEMM SM90 FP8 grouped GEMMs, by phase as serving engines run them: masked layout up to "
                "1024 tokens (no host sync), contiguous layout above (one host sync, not capturable); torch "
                "routing/permutation/SwiGLU-requant/combine (deep_gemm 2.6.1@54e2261)"
            ),
            submodule="third_party/DeepGEMM",
            package="deep_gemm==2.6.1+54e2261",
            timed_call=(
                "up to 1024 tokens: routing and the permutation into the masked layout in torch (~32 kernels), "
                "DeepGEMM's two masked grouped FP8 GEMMs, SwiGLU with FP8 requantisation and the weighted combine "
                "in torch (~20 kernels), no host sync; above 1024 tokens: routing and the per-expert counts in "
                "torch (~39 kernels), one host sync reading the row count, the permutation into the contiguous "
                "layout (~14 kernels), DeepGEMM's two contiguous grouped FP8 GEMMs, SwiGLU with FP8 "
                "requantisation and the combine over the local pairs in torch (~14 kernels); not capturable "
                "in a CUDA graph there"
            ),
        ),
        LibrarySide(
            name="flashinfer_moe",
            entry="flashinfer_moe.py::run",
            description=(
                "FlashInfer SM90 cutlass_fused_moe with DeepSeek FP8 block scales (TRT-LLM's CUTLASS MoE runner, "
                "DeepGEMM-derived grouped FP8 GEMMs) after its fused_topk_deepseek routing, from prebuilt "
                "modules (flashinfer-python 0.7.2.post1)"
            ),
            package="flashinfer-python==0.7.2.post1",
            prepare="prepare",
            timed_call=(
                "FlashInfer's fused DeepSeek-V3 routing kernel, then cutlass_fused_moe on bf16 activations "
                "(dequantised from the definition's fp8 once, untimed, as an engine's previous layer hands "
                "them over): their FP8 quantisation, permutation, the two grouped FP8 GEMMs, SwiGLU, and the "
                "weighted un-permuting combine into the output; no host sync in our code, a kept workspace; "
                "weights and scales as the definition stores them"
            ),
        ),
    ),
)

TRACK = MOE
