"""The gdn_prefill track: GDN prefill (gated delta net, chunked prefill over packed sequences).

This folder is the whole track: the spec below, `definition.json` (with `reference.py` embedded),
`reference.py`, `workloads.tsv`, `synth.py` (inputs), `floor.py` (roofline model) and
`adapters/` (library sides).

The initial `state`: the headline gives every workload one (synthesized inputs always do; official
ones when their blob holds it), the case in which no side pays for a missing one. The no-state case
is a second table from the same run: the first 4 workloads by index in each size class (20 of the
100) run a second time with `state` None (`absent_input_sample`), their other inputs the same; on
official data only workloads whose blob holds a state are sampled (one without is already a
no-state row).
"""

from __future__ import annotations

from hopperbench.tracks.model import (
    AbsentInputSample,
    AcceptanceRule,
    CandidateSide,
    LibrarySide,
    SizeClasses,
    TimingDefaults,
    Track,
)

GDN_PREFILL = Track(
    name="gdn_prefill",
    package=__name__,
    definition_name="gdn_prefill_qk4_v8_d128_k_last",
    op_type="gdn",
    acceptance=AcceptanceRule(atol=1e-2, rtol=1e-2, required_matched_ratio=1.0, outputs=("output", "new_state")),
    kernel_entry="kernels/gdn_prefill/kernel.py::run",
    human_key="gdn_prefill",
    # The size classes of the GDN issue (total tokens): launch-bound, short, medium, long, 8192-token batches.
    size_classes=SizeClasses("total_seq_len", (40, 200, 1000, 4000)),
    # 4 per size class: 20 more rows, about 3 minutes of device time per full run.
    absent_input_sample=AbsentInputSample(input="state", per_size_class=4),
    flashinfer_baseline="flashinfer_gdn",
    # The reference steps through every token in Python: 0.2-1.1 s per call on the 8192-token workloads, each
    # call hundreds to thousands of launches. It runs untimed, once a trial for the outputs every side is gated
    # against: its time is in no ratio, and timing it took two more calls a trial, ~200 of a GDN run's ~780
    # device seconds.
    timing=TimingDefaults(reference_iterations=0),
    libraries=(
        LibrarySide(
            name="flashinfer_gdn",
            entry="flashinfer_gdn.py::run",
            description="FlashInfer SM90 chunk_gated_delta_rule, CuTe-DSL fused / context-parallel kernels (flashinfer-python 0.7.2.post1)",
            package="flashinfer-python==0.7.2.post1",
            timed_call=(
                "the gates g and beta computed from A_log, a, dt_bias and b in one fused Triton kernel (fp32, as "
                "serving engines compute them), then FlashInfer's SM90 kernels writing output and new_state: its "
                "context-parallel pipeline (use_cp='auto') for one or two sequences of a mean of 1000 tokens or more, "
                "else its fused kernel (use_cp=False): the faster of the two on each side of that line (measured on "
                "every official batch of at most 8 sequences from 341 tokens)"
            ),
        ),
        LibrarySide(
            name="fla_chunk",
            entry="fla_gdn.py::run",
            description="flash-linear-attention chunk_gated_delta_rule, Triton chunk pipeline (fla-core 0.6.0)",
            package="fla-core==0.6.0",
            timed_call=(
                "fla's Triton pipeline (gate, chunk-local WY, state recurrence, output kernels) with its chunk "
                "indices memoised per cu_seqlens tensor, then output and new_state copied into the destinations; "
                "each autotuned kernel at the configuration pinned for the GPU (fla_gdn.PINNED_CONFIGS, from "
                "tools/tune_fla.py), on a GPU without pins at what fla's autotuner picks in the warm-up call"
            ),
        ),
    ),
    candidates=(
        CandidateSide(
            name="cand_wy_prepass_everywhere",
            entry="wy_prepass.py::run",
            description="kernel.py's WY-prepass path at every T (kernel.py takes it above a mean of 500 tokens): the other side of an A/B that places that bound",
        ),
        CandidateSide(
            name="cand_warp_chain",
            entry="warp_chain.py::run",
            description=(
                "warp_chain.py at every T: each warp steps 16 state rows through 16-token chunks in mma.sync "
                "accumulators, no CTA barrier in the chain (against the token-serial path at <= 40 tokens and the "
                "chunked path above)"
            ),
        ),
    ),
)

TRACK = GDN_PREFILL
