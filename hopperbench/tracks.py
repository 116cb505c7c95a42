"""The track registry: the single place that names each benchmark track.

A track is one contest definition. Its entry says which definition it is, how an
output is accepted, where its workload list lives, where our kernel and our
reference live, which `human_best/` manifest entry holds the contest winner, and
which public Hopper libraries stand beside them as extra reference sides.
Everything else in the project looks tracks up here; nothing else hard-codes a
definition name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from hopperbench.paths import PACKAGE_DIR, REPO_ROOT


@dataclass(frozen=True)
class AcceptanceRule:
    """The contest's per-output acceptance rule for one track.

    An element fails only when both its absolute and its relative error exceed
    their tolerances; an output passes when the share of passing elements is at
    least `required_matched_ratio` in every trial. `outputs` lists the outputs
    that are compared (all of the definition's outputs on every track).
    """

    atol: float
    rtol: float
    required_matched_ratio: float
    outputs: tuple[str, ...]
    # Extra bound beyond the contest rule; None = not checked. The contest rule alone judges the
    # human and library sides; a stricter bound is ours to meet (see Track.ours_max_relative_l2).
    max_relative_l2: float | None = None


@dataclass(frozen=True)
class TimingDefaults:
    """Per-track overrides of the runner's timing protocol for the reference side.

    The definitions' Python references can be slow (the GDN reference steps through
    every token), so the reference side may be timed with fewer iterations than the
    kernels. `None` means: the same as the kernels.
    """

    reference_warmup: int | None = None
    reference_iterations: int | None = None
    # Seconds of warm-up and timed calls per trial of the reference: a slower call gets fewer
    # (at least one timed call), so that its cheap workloads keep the full counts.
    reference_time_budget_s: float | None = None


@dataclass(frozen=True)
class LibrarySide:
    """A public Hopper library timed as an extra reference side.

    `entry` is `<file under hopperbench/adapters>::<function>`; the adapter maps the
    definition's inputs to the library's call, in destination-passing style.
    `submodule` names the `third_party/` path that pins the library's source, if any;
    `package` the optional dependency that provides it, if any.
    """

    name: str
    entry: str
    description: str
    submodule: str | None = None
    package: str | None = None
    # What one timed call contains, in a sentence (README's library table shows it).
    timed_call: str = ""
    # `<function in the adapter file>` run once per trial, untimed, on the definition's inputs: it
    # returns the arguments `entry` takes, the inputs stored as the library keeps them (a serving
    # engine's cache layout). None: `entry` takes the definition's inputs as they are.
    prepare: str | None = None


CANDIDATE_PREFIX = "cand_"


@dataclass(frozen=True)
class CandidateSide:
    """A candidate of ours for the next version of a track's kernel, timed beside `ours` only when
    asked for (`--sides ours,cand_...`), so that a promotion is decided in one run.

    `entry` is `<file in the track's kernel folder>::<function>`; the candidate is judged by the
    same rule as `ours`. Its name starts with CANDIDATE_PREFIX, which is how results tell it from
    the reference sides.
    """

    name: str
    entry: str
    description: str

    def __post_init__(self) -> None:
        if not self.name.startswith(CANDIDATE_PREFIX):
            raise ValueError(f"candidate side {self.name!r} must be named {CANDIDATE_PREFIX}...")


def is_candidate_side(name: str) -> bool:
    return name.startswith(CANDIDATE_PREFIX)


@dataclass(frozen=True)
class Track:
    name: str
    definition_name: str
    op_type: str
    acceptance: AcceptanceRule
    # Our embedded workload list (uuid + axes), relative to hopperbench/workload_lists/.
    workload_list: str
    # Our kernel, `<path relative to the repository root>::<function>`.
    kernel_entry: str
    # Our reference module, relative to hopperbench/references/.
    reference_module: str
    # Key of this track in human_best/manifest.toml.
    human_key: str
    timing: TimingDefaults = field(default_factory=TimingDefaults)
    libraries: tuple[LibrarySide, ...] = ()
    candidates: tuple[CandidateSide, ...] = ()
    # A bound our kernel must meet beyond the contest rule (the MoE kernel issue: no skipped experts
    # or tokens can hide under the loose 90 % rule). Other sides are judged by the contest rule.
    ours_max_relative_l2: float | None = None

    def acceptance_for(self, side_kind: str) -> AcceptanceRule:
        """The rule a side is judged by: the contest's, plus our own stricter bound for `ours` and
        its candidates."""
        if side_kind in ("ours", "candidate") and self.ours_max_relative_l2 is not None:
            return replace(self.acceptance, max_relative_l2=self.ours_max_relative_l2)
        return self.acceptance

    @property
    def kernel_path(self) -> Path:
        return REPO_ROOT / self.kernel_entry.split("::")[0]

    @property
    def kernel_function(self) -> str:
        return self.kernel_entry.split("::")[1]

    @property
    def reference_path(self) -> Path:
        return PACKAGE_DIR / "references" / self.reference_module

    @property
    def definition_path(self) -> Path:
        return PACKAGE_DIR / "definitions" / f"{self.definition_name}.json"

    @property
    def workload_list_path(self) -> Path:
        return PACKAGE_DIR / "workload_lists" / self.workload_list


GDN_PREFILL = Track(
    name="gdn_prefill",
    definition_name="gdn_prefill_qk4_v8_d128_k_last",
    op_type="gdn",
    acceptance=AcceptanceRule(atol=1e-2, rtol=1e-2, required_matched_ratio=1.0, outputs=("output", "new_state")),
    workload_list="gdn_prefill.tsv",
    kernel_entry="kernels/gdn_prefill/kernel.py::run",
    reference_module="gdn_prefill.py",
    human_key="gdn_prefill",
    # The reference steps through every token in Python: 0.2-1.1 s per call on the 8192-token
    # workloads, 2-35 ms on the short ones. Its latency is a side column, in no headline ratio: a
    # budget of 0.2 s per trial gives the short workloads 5-50 timed calls and the long ones one,
    # where a fixed single call left their medians +-34 % apart between two runs.
    timing=TimingDefaults(reference_time_budget_s=0.2),
    libraries=(
        LibrarySide(
            name="flashinfer_gdn",
            entry="flashinfer_gdn.py::run",
            description="FlashInfer SM90 chunk_gated_delta_rule, CuTe-DSL fused / context-parallel kernels (flashinfer-python 0.7.2.post1)",
            package="flashinfer-python==0.7.2.post1",
            timed_call=(
                "the gates g and beta computed from A_log, a, dt_bias and b (torch, fp32), then FlashInfer's "
                "SM90 kernels (use_cp='auto'), writing output and new_state"
            ),
        ),
        LibrarySide(
            name="fla_chunk",
            entry="fla_gdn.py::run",
            description="flash-linear-attention chunk_gated_delta_rule, Triton chunk pipeline (fla-core 0.6.0)",
            package="fla-core==0.6.0",
            timed_call=(
                "fla's Triton pipeline (gate, chunk-local WY, state recurrence, output kernels) with its chunk "
                "indices memoised per cu_seqlens tensor, then output and new_state copied into the destinations"
            ),
        ),
    ),
    candidates=(
        CandidateSide(
            name="cand_wy_prepass_everywhere",
            entry="wy_prepass.py::run",
            description="kernel.py's WY-prepass path at every T (no 512-token threshold): the other side of the A/B and sweep that place the threshold for few sequences",
        ),
    ),
)

MOE = Track(
    name="moe",
    definition_name="moe_fp8_block_scale_ds_routing_topk8_ng8_kg4_e32_h7168_i2048",
    op_type="moe",
    acceptance=AcceptanceRule(atol=1.0, rtol=0.3, required_matched_ratio=0.9, outputs=("output",)),
    ours_max_relative_l2=1e-2,
    workload_list="moe.tsv",
    kernel_entry="kernels/moe/kernel.py::run",
    reference_module="moe.py",
    human_key="moe",
    # The reference takes 1.7-44 ms per call (Python loops over the local experts).
    timing=TimingDefaults(reference_time_budget_s=0.2),
    libraries=(
        LibrarySide(
            name="deepgemm_grouped",
            entry="deepgemm_moe.py::run",
            description=(
                "DeepGEMM SM90 FP8 grouped GEMM (masked layout, a row budget of T per expert, no host "
                "sync), torch routing/permutation/SwiGLU-requant/combine (deep_gemm 2.6.1@54e2261)"
            ),
            submodule="third_party/DeepGEMM",
            package="deep_gemm==2.6.1+54e2261",
            timed_call=(
                "routing and the permutation into the masked layout in torch (~32 kernels), DeepGEMM's two "
                "masked grouped FP8 GEMMs, SwiGLU with FP8 requantisation and the weighted combine in torch "
                "(~20 kernels); no host sync"
            ),
        ),
    ),
    candidates=(
        CandidateSide(
            name="cand_wide_from_193",
            entry="candidate_wide_from_193.py::run",
            description="kernel.py with its 64-token GEMM1 tiles (LARGE_T) from 193 tokens instead of above 1024: the threshold's other side",
        ),
    ),
)


DSA_ATTENTION = Track(
    name="dsa_attention",
    definition_name="dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64",
    op_type="dsa_paged",
    acceptance=AcceptanceRule(atol=1e-2, rtol=1e-2, required_matched_ratio=1.0, outputs=("output", "lse")),
    workload_list="dsa_attention.tsv",
    kernel_entry="kernels/dsa_attention/kernel.py::run",
    reference_module="dsa_attention.py",
    human_key="dsa_attention",
    libraries=(
        LibrarySide(
            name="flashmla_sparse",
            entry="flashmla_dsa.py::run",
            description=(
                "FlashMLA flash_mla_sparse_fwd, SM90 sparse prefill on a bf16 cache stored in its "
                "packed 576-wide layout (16 heads padded to 64), deepseek-ai/FlashMLA@9241ae3"
            ),
            submodule="third_party/FlashMLA",
            package="flash_mla==1.0.0+9241ae3",
            prepare="prepare",
            timed_call=(
                "q padded to 64 heads (one torch copy), FlashMLA's sparse prefill kernel on the cache "
                "stored once, untimed, in its packed ckv|kpe layout, then the 16 heads' output and lse "
                "(base 2) copied out (3 torch kernels)"
            ),
        ),
    ),
)

TRACKS: dict[str, Track] = {t.name: t for t in (GDN_PREFILL, MOE, DSA_ATTENTION)}


class UnknownTrackError(ValueError):
    pass


def get_track(name: str) -> Track:
    try:
        return TRACKS[name]
    except KeyError:
        raise UnknownTrackError(f"unknown track {name!r}; choose from {', '.join(TRACKS)}") from None


def parse_track_list(spec: str) -> list[Track]:
    """`all`, one track name, or a comma list of names -> tracks in registry order."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise UnknownTrackError("no track given; use --track all or a comma list of " + ", ".join(TRACKS))
    if "all" in names:
        return list(TRACKS.values())
    wanted = {get_track(n).name for n in names}
    return [t for t in TRACKS.values() if t.name in wanted]
