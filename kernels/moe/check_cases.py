"""Correctness cases for the MoE kernel, shared by the GPU tests and kernels/moe/probes/device_check_moe.py.

Each case names a batch size, a local expert offset and a routing pattern. `make_inputs` draws the
inputs with `hopperbench.synth` (the distributions of our benchmark, for a synthesized workload of
that seq_len and offset) and then reshapes the routing logits for the pattern; `compare` applies the
MoE track's acceptance rule (the contest rule atol 1, rtol 0.3 on >= 90 % of elements, plus relative
L2 <= 1e-2; NaN anywhere fails). Not imported by kernel.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:  # only for annotations: importing this module needs nothing but torch
    from hopperbench.acceptance import OutputStats

NUM_LOCAL_EXPERTS = 32
HIDDEN = 7168
TOP_K = 8
ROUTED_SCALING_FACTOR = 2.5  # the contest workloads' value
WEIGHT_BYTES_PER_EXPERT = 44_040_192  # e4m3 W13 + W2 of one expert

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE_PATH = REPO_ROOT / "hopperbench" / "tracks" / "moe" / "reference.py"
KERNEL_PATH = REPO_ROOT / "kernels" / "moe" / "kernel.py"

# Routing patterns (see `apply_routing_pattern`).
PATTERNS = ("random", "one_expert", "no_local", "all_local", "eight_local", "zipf")
# Logit that makes an expert win every selection (sigmoid ~ 1 against ~0.5 for randn logits).
DOMINANT_LOGIT = 12.0
# Logit that makes an expert lose every selection (sigmoid ~ 6e-9; only its bias is left).
SUPPRESSED_LOGIT = -19.0
# Shift that weakens the other ranks' experts in "one_expert" (sigmoid(randn - 2) is mostly < 0.5),
# so that the local group always is among the top-4 groups.
REMOTE_DAMPING = 2.0
# Shift of the local experts in "all_local" (sigmoid(randn + 6) > 0.95 for all but extreme draws).
LOCAL_BOOST = 6.0
SKEWED_LOCAL_EXPERT = 5  # the local expert that every token picks in "one_expert"
EIGHT_LOCAL_EXPERTS = range(8)  # the local experts that every token picks, and only them, in "eight_local"
ZIPF_RANKS_SEED = 7  # the generator that deals "zipf"'s popularity ranks (with the offset: one dealing per case)


@dataclass(frozen=True)
class CheckCase:
    name: str
    num_tokens: int
    local_expert_offset: int
    pattern: str = "random"

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ValueError(f"unknown routing pattern {self.pattern!r}; choose from {', '.join(PATTERNS)}")
        if self.local_expert_offset % NUM_LOCAL_EXPERTS or not 0 <= self.local_expert_offset <= 224:
            raise ValueError(
                f"local_expert_offset must be a multiple of 32 in [0, 224], got {self.local_expert_offset}"
            )


CASES: tuple[CheckCase, ...] = (
    CheckCase("t1_off0", 1, 0),
    CheckCase("t1_off224", 1, 224),
    CheckCase("t7_off96", 7, 96),
    CheckCase("t7_off224", 7, 224),
    CheckCase("t80_off96", 80, 96),
    CheckCase("t80_off0", 80, 0),
    CheckCase("t901_off96", 901, 96),
    CheckCase("t901_off224", 901, 224),
    CheckCase("t80_off0_one_expert", 80, 0, "one_expert"),
    CheckCase("t901_off224_one_expert", 901, 224, "one_expert"),  # 15 row tiles of one expert
    CheckCase("t901_off96_all_local", 901, 96, "all_local"),  # 8 T assignments: full workspaces
    CheckCase("t80_off96_no_local", 80, 96, "no_local"),
    CheckCase("t1_off0_no_local", 1, 0, "no_local"),
    CheckCase("t14107_off32", 14107, 32),
)
SLOW_CASES = frozenset({"t14107_off32"})
# The compute-bound sizes, where `kernel.py` runs GROUPED_T above MEDIUM_T_MAX_TOKENS (its GPU tests force it on all
# of them; kernels/moe/probes/grouped_check.py checks it and times it against MEDIUM_T): the official large rows,
# uniform routing from 1025 to 32768 (MAX_TOKENS) tokens, every token on the same 8 local experts (8 experts of T
# rows), Zipf-skewed popularity, one expert holding every token, all 8 T choices local, and no local expert.
LARGE_CASES: tuple[CheckCase, ...] = (
    CheckCase("t1025_off0", 1025, 0),
    CheckCase("t1536_off128", 1536, 128),
    CheckCase("t2048_off96", 2048, 96),
    CheckCase("t4096_off0", 4096, 0),
    CheckCase("t8192_off224", 8192, 224),
    CheckCase("t11948_off128", 11948, 128),
    CheckCase("t14107_off32", 14107, 32),
    CheckCase("t16384_off64", 16384, 64),
    CheckCase("t32768_off160", 32768, 160),  # MAX_TOKENS
    CheckCase("t2048_off32_eight_local", 2048, 32, "eight_local"),
    CheckCase("t4096_off160_eight_local", 4096, 160, "eight_local"),
    CheckCase("t8192_off96_eight_local", 8192, 96, "eight_local"),
    CheckCase("t11948_off0_eight_local", 11948, 0, "eight_local"),
    CheckCase("t14107_off224_eight_local", 14107, 224, "eight_local"),
    CheckCase("t2048_off224_zipf", 2048, 224, "zipf"),
    CheckCase("t8192_off32_zipf", 8192, 32, "zipf"),
    CheckCase("t12000_off96_one_expert", 12000, 96, "one_expert"),
    CheckCase("t16384_off128_all_local", 16384, 128, "all_local"),
    CheckCase("t6000_off192_no_local", 6000, 192, "no_local"),
)


def grouped_counts(kind: str, tokens: int, gen: torch.Generator) -> list[int]:
    """Rows per local expert of T tokens' local assignments, for the grouped GEMMs timed alone
    (`probes/grouped_gemm*_timing.py`): "uniform" ~T x 8 / 256 per expert (+-25 %), "skewed" every token on
    8 local experts (8 experts of T rows)."""
    if kind == "skewed":
        return [tokens] * TOP_K + [0] * (NUM_LOCAL_EXPERTS - TOP_K)
    jitter = torch.rand(NUM_LOCAL_EXPERTS, generator=gen) * 0.5 + 0.75
    return [int(tokens * TOP_K / 256 * j) for j in jitter.tolist()]


def load_kernel() -> ModuleType:
    """kernel.py as the harness sees it: a module of a package made of this folder, so that its
    relative imports (routing, streaming_gemm, combine, shapes) resolve."""
    from hopperbench.devcheck import load_folder_module  # lazily: this folder is packed without hopperbench

    return load_folder_module(KERNEL_PATH.parent, "moe_solution", "kernel")


def load_reference() -> ModuleType:
    from hopperbench.devcheck import load_module_by_path  # lazily: this folder is packed without hopperbench

    return load_module_by_path(REFERENCE_PATH, "moe_reference")


def apply_routing_pattern(routing_logits: torch.Tensor, local_expert_offset: int, pattern: str) -> None:
    """Reshape [T, 256] logits in place so that routing follows `pattern`.

    The local experts [offset, offset + 32) are exactly one routing group, so:
    - one_expert: local expert 5 dominates (logit 12) and the other ranks' experts are damped, so
      every token picks expert 5 (the 7 other choices stay random);
    - no_local: the local experts' scores are ~0 (only their bias is left), so the local group is
      never among the top-4 groups;
    - all_local: the local experts' scores are ~1 and the others' ~0, so all 8 choices of every
      token are local (8 T assignments: the workspaces' worst case);
    - eight_local: local experts 0-7 score ~1 and every other expert ~0 (only its bias is left), so every token
      picks exactly those 8 (8 experts of T tokens: the most skewed routing with every choice local);
    - zipf: the logits plus the log of a Zipf popularity over the 256 experts, the local group holding the hottest
      rank of every 8 (the benchmark's off-list `zipf` recipe, `hopperbench.tracks.moe.synth`): a few hot local
      experts, many cold or idle ones, still random per token.
    """
    local = torch.zeros(routing_logits.shape[1], dtype=torch.bool, device=routing_logits.device)
    local[local_expert_offset : local_expert_offset + NUM_LOCAL_EXPERTS] = True
    if pattern == "one_expert":
        routing_logits[:, ~local] -= REMOTE_DAMPING
        routing_logits[:, local_expert_offset + SKEWED_LOCAL_EXPERT] = DOMINANT_LOGIT
    elif pattern == "no_local":
        routing_logits[:, local] = SUPPRESSED_LOGIT
    elif pattern == "all_local":
        routing_logits[:, local] += LOCAL_BOOST
        routing_logits[:, ~local] = SUPPRESSED_LOGIT
    elif pattern == "eight_local":
        chosen = torch.zeros_like(local)
        chosen[[local_expert_offset + e for e in EIGHT_LOCAL_EXPERTS]] = True
        routing_logits[:, chosen] = DOMINANT_LOGIT
        routing_logits[:, ~chosen] = SUPPRESSED_LOGIT
    elif pattern == "zipf":
        from hopperbench.tracks.moe.synth import stratified_zipf_log_popularity  # lazily: see load_kernel

        ranks = torch.Generator().manual_seed(ZIPF_RANKS_SEED + local_expert_offset)
        routing_logits += stratified_zipf_log_popularity(local_expert_offset, ranks).to(routing_logits.device)
    elif pattern != "random":
        raise ValueError(f"unknown routing pattern {pattern!r}")


def make_inputs(case: CheckCase, device: torch.device | str, seed: int = 0) -> dict[str, torch.Tensor | int | float]:
    """Fresh inputs in definition order (synthesized like a benchmark workload of this shape)."""
    from hopperbench.synth import make_inputs as synthesize
    from hopperbench.workloads import WorkloadSpec

    workload = WorkloadSpec(
        track="moe",
        index=0,
        uuid=f"moe-check-{case.name}",
        axes={"seq_len": case.num_tokens},
        scalars={"local_expert_offset": case.local_expert_offset, "routed_scaling_factor": ROUTED_SCALING_FACTOR},
        data_source="synthesized",
    )
    inputs = synthesize("moe", workload, seed=seed, trial=0, device=device)
    apply_routing_pattern(inputs["routing_logits"], case.local_expert_offset, case.pattern)
    return inputs


def poisoned_output(num_tokens: int, device: torch.device | str) -> torch.Tensor:
    """A destination filled with NaN, so any row the kernel leaves unwritten shows up."""
    return torch.full((num_tokens, HIDDEN), math.nan, dtype=torch.bfloat16, device=device)


def local_assignments(reference: ModuleType, inputs: dict) -> tuple[int, int]:
    """(token-expert assignments to local experts, active local experts) under the reference routing."""
    experts, _ = reference._route(
        inputs["routing_logits"], inputs["routing_bias"], float(inputs["routed_scaling_factor"])
    )
    local = experts - int(inputs["local_expert_offset"])
    local = local[(local >= 0) & (local < NUM_LOCAL_EXPERTS)]
    return int(local.numel()), int(local.unique().numel())


def compare(output: torch.Tensor, ref_output: torch.Tensor) -> OutputStats:
    """The MoE track's acceptance rule on one output (hopperbench.acceptance.OutputStats)."""
    from hopperbench.acceptance import compare_output
    from hopperbench.tracks import get_track

    return compare_output(get_track("moe").acceptance_for("ours"), output, ref_output)


def reference_run(reference: ModuleType) -> Callable:
    return reference.run
