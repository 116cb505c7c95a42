"""Correctness cases for the GDN prefill kernel, shared by the GPU tests and the device check.

Each case names its sequence lengths, whether an initial state is given, the scale argument and the
gate regime; `make_inputs` builds fresh random inputs for it and `compare` applies the track's
acceptance rule through hopperbench.acceptance (atol = rtol = 1e-2 on every element: an element fails
only when both its absolute and its relative error exceed the tolerance; NaN anywhere fails) on
`output` and `new_state`.

Input distributions follow hopperbench/tracks/gdn_prefill/synth.py: q and k randn, L2-normalised per head
in fp32, then bf16 (unnormalised keys make the recurrence blow up); v, a, b randn bf16;
A_log = log(U[1, 16]); state N(0, 0.2^2). Gate regimes:
- "mamba2": dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] (dt_bias in about [-6.9, -2.3]):
  long memory, so ignoring or transposing the initial state fails;
- "fast_decay": dt_bias ~ U[-0.1, 0.1]: the state is forgotten within a few tokens;
- "slow_decay": as "mamba2", but A_log in [-12, -8] (its draw mapped there): every per-token decay is within
  ~4e-4 of 1, so the state keeps most of its weight over thousands of tokens (65-97 % over this file's 6000-
  32768-token sequences): where a long chain, or a split of it, must neither lose nor grow the state.
Key patterns: "random" as above; "repeated": every 64-token run of a sequence (a chunk) shares one key and
beta = 0.95 (b = logit 0.95) on every token: A's strict lower triangle is all ~beta and I + A is ill-conditioned
(condition number ~74, against ~3 with random keys), the case on which the chunk form's fp16 roundings come
closest to the rule (NOTES.md, "Open directions").
Only torch and the standard library are imported at import time (hopperbench lazily, inside the
functions that need it), so the module loads by path anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Literal

import torch

if TYPE_CHECKING:  # only for annotations: importing this module needs nothing but torch
    from hopperbench.acceptance import Verdict

NUM_QK_HEADS = 4
NUM_V_HEADS = 8
HEAD_SIZE = 128
STATE_STD = 0.2

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE_PATH = REPO_ROOT / "hopperbench" / "tracks" / "gdn_prefill" / "reference.py"
# The package name kernel.py and its siblings are loaded under (tests and device checks).
SOLUTION_PACKAGE = "gdn_solution"
KERNEL_PATH = REPO_ROOT / "kernels" / "gdn_prefill" / "kernel.py"

GateRegime = Literal["mamba2", "fast_decay", "slow_decay"]
GATE_REGIMES = ("mamba2", "fast_decay", "slow_decay")
KeyPattern = Literal["random", "repeated"]
KEY_PATTERNS = ("random", "repeated")
# The modules whose chains keep a slow chunk's T and V'c as pairs (`accurate_inverse.py`): a case's known failure is the
# other paths'; these must pass it (the kernel tests and the device check hold them to it).
PAIRED_PATHS = ("kernel", "wgmma_value_side", "context_parallel")
REPEAT_TOKENS = 64  # "repeated": the run of tokens sharing a key (kernel chunks are 64 tokens)
REPEAT_BETA = 0.95
SLOW_A_LOG = (-12.0, -8.0)  # "slow_decay"'s range of A_log


@dataclass(frozen=True)
class CheckCase:
    name: str
    lengths: tuple[int, ...]
    with_state: bool
    scale: float  # the argument passed to run: 0.0 means 1/sqrt(128)
    gates: GateRegime
    long: bool = False  # minutes of reference time: behind a flag in the tests
    keys: KeyPattern = "random"
    # Why the chunk-form paths fail this case today (NOTES.md): the tests and the device check report it and go on.
    known_failure: str = ""

    def __post_init__(self) -> None:
        if not self.lengths or any(n < 0 for n in self.lengths):
            raise ValueError(f"case {self.name}: lengths must be a non-empty tuple of counts >= 0, got {self.lengths}")
        if self.gates not in GATE_REGIMES:
            raise ValueError(f"case {self.name}: unknown gate regime {self.gates!r}")
        if self.keys not in KEY_PATTERNS:
            raise ValueError(f"case {self.name}: unknown key pattern {self.keys!r}")

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)


def random_composition(total: int, parts: int, seed: int) -> tuple[int, ...]:
    """`parts` lengths >= 1 summing to `total` (distinct random cut points, like hopperbench.synth)."""
    generator = torch.Generator().manual_seed(seed)
    cuts = sorted((torch.randperm(total - 1, generator=generator)[: parts - 1] + 1).tolist())
    bounds = [0, *cuts, total]
    return tuple(hi - lo for lo, hi in zip(bounds[:-1], bounds[1:]))


MANY_SHORT = random_composition(1000, 57, seed=57)
# One long sequence among many short ones: the longest chain bounds the call while 40 others finish early.
LONG_PLUS_SHORT = (6000, *random_composition(600, 40, seed=40))
# More sequences than a CTA ranks by length (chunked.MAX_RANKED_SEQS = 128).
MANY_130 = random_composition(700, 130, seed=130)

CASES: tuple[CheckCase, ...] = (
    CheckCase("len1_state", (1,), True, 0.0, "mamba2"),
    CheckCase("len1_nostate", (1,), False, 0.05, "mamba2"),
    CheckCase("len6_state_scale05", (6,), True, 0.05, "mamba2"),
    CheckCase("len6_nostate", (6,), False, 0.0, "fast_decay"),
    CheckCase("len134_state", (134,), True, 0.0, "mamba2"),
    CheckCase("len134_state_fast", (134,), True, 0.05, "fast_decay"),
    CheckCase("len63_64_65_state", (63, 64, 65), True, 0.05, "mamba2"),
    CheckCase("len63_64_65_nostate", (63, 64, 65), False, 0.0, "mamba2"),
    CheckCase("chunk_edges_31_32_33_1", (31, 32, 33, 1), True, 0.0, "fast_decay"),
    CheckCase("zero_length_seqs", (5, 0, 3, 0), True, 0.0, "mamba2"),
    # Above the token-serial threshold: equal lengths and empty sequences in the chunked path.
    CheckCase("ties_and_empty_357", (70, 0, 70, 5, 0, 70, 1, 70, 0, 71), True, 0.0, "mamba2"),
    CheckCase("many_130_state", MANY_130, True, 0.05, "mamba2"),
    # The WY chain's 16-row grid past 132 CTAs (3-4 sequences): rows serve the sequences longest first.
    CheckCase("wy_ranked_450_380_966", (450, 380, 966), True, 0.0, "mamba2"),
    CheckCase("wy_ranked_ties_and_empty", (300, 0, 700, 300), False, 0.05, "slow_decay"),
    CheckCase("all_empty", (0, 0), True, 0.0, "mamba2"),
    CheckCase("many_short_57x1000_state", MANY_SHORT, True, 0.0, "mamba2"),
    CheckCase("many_short_57x1000_fast", MANY_SHORT, False, 0.05, "fast_decay"),
    CheckCase("long4096_state", (4096,), True, 0.0, "mamba2"),
    CheckCase("long4096_nostate_fast", (4096,), False, 0.0, "fast_decay"),
    CheckCase("long8192_state", (8192,), True, 0.0, "mamba2"),
    CheckCase("long8192_nostate_slow", (8192,), False, 0.0, "slow_decay"),
    CheckCase("long_plus_short_slow", LONG_PLUS_SHORT, True, 0.05, "slow_decay"),
    CheckCase("repeated_keys_120_state", (120,), True, 0.0, "slow_decay", keys="repeated"),
    CheckCase("repeated_keys4096_slow", (4096,), True, 0.0, "slow_decay", keys="repeated"),
    CheckCase(
        "repeated_keys_32x8192_slow", random_composition(8192, 32, seed=32), True, 0.0, "slow_decay", keys="repeated"
    ),
    CheckCase(
        "repeated_keys16384_slow", (16384,), True, 0.0, "slow_decay", long=True, keys="repeated",
        known_failure=(
            "paths without the slow-chunk pairs (the chunked path, the mma.sync WY chain): fp16 roundings of T and V'c "
            "accumulate over 256 chunks, state error 1.2-1.5e-2"
        ),
    ),
    CheckCase("long32768_slow", (32768,), True, 0.0, "slow_decay", long=True),
    CheckCase("long65536_state", (65536,), True, 0.0, "mamba2", long=True),
)


def load_kernel() -> ModuleType:
    """kernel.py as the harness sees it: a module of a package made of this folder, so that its
    relative imports (token_serial, chunked) resolve."""
    from hopperbench.devcheck import load_folder_module  # lazily: this folder is packed without hopperbench

    return load_folder_module(KERNEL_PATH.parent, SOLUTION_PACKAGE, "kernel")


def load_reference_run() -> Callable:
    from hopperbench.devcheck import load_module_by_path

    return load_module_by_path(REFERENCE_PATH, "gdn_prefill_reference").run


def make_inputs(case: CheckCase, device: torch.device | str, seed: int = 0) -> dict[str, torch.Tensor | float | None]:
    """Fresh inputs in definition order (q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale),
    drawn on the CPU and copied, so that they are identical on every device."""
    generator = torch.Generator().manual_seed(seed)
    t, n = case.num_tokens, case.num_seqs

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std

    def unit_rows(*shape: int) -> torch.Tensor:
        return torch.nn.functional.normalize(randn(*shape), dim=-1)

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.rand(NUM_V_HEADS, generator=generator) * (high - low) + low

    def a_log() -> torch.Tensor:
        """log(A), A ~ U[1, 16]; for "slow_decay" the same draw mapped onto SLOW_A_LOG (every case draws alike)."""
        a = uniform(1.0, 16.0)
        if case.gates != "slow_decay":
            return a.log()
        low, high = SLOW_A_LOG
        return low + (a - 1.0) / 15.0 * (high - low)

    if case.gates in ("mamba2", "slow_decay"):
        dt = uniform(math.log(1e-3), math.log(1e-1)).exp()
        dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
    else:
        dt_bias = uniform(-0.1, 0.1)
    bounds = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int64)
    bf16 = torch.bfloat16
    inputs: dict[str, torch.Tensor | float | None] = {
        "q": unit_rows(t, NUM_QK_HEADS, HEAD_SIZE).to(bf16),
        "k": unit_rows(t, NUM_QK_HEADS, HEAD_SIZE).to(bf16),
        "v": randn(t, NUM_V_HEADS, HEAD_SIZE).to(bf16),
        "state": randn(n, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE, std=STATE_STD) if case.with_state else None,
        "A_log": a_log(),
        "a": randn(t, NUM_V_HEADS).to(bf16),
        "dt_bias": dt_bias.float(),
        "b": randn(t, NUM_V_HEADS).to(bf16),
        "cu_seqlens": bounds,
        "scale": case.scale,
    }
    if case.keys == "repeated":  # after every draw, so that the other inputs are "random"'s
        inputs["k"] = inputs["k"][_run_leaders(case.lengths)]
        inputs["b"] = torch.full_like(inputs["b"], math.log(REPEAT_BETA / (1.0 - REPEAT_BETA)))
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}


def _run_leaders(lengths: Sequence[int]) -> torch.Tensor:
    """For every token, the index of the first token of its REPEAT_TOKENS-token run within its sequence."""
    leaders = [
        start + offset - offset % REPEAT_TOKENS
        for start, length in zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), lengths)
        for offset in range(length)
    ]
    return torch.tensor(leaders, dtype=torch.long)


def poisoned_outputs(case: CheckCase, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Destination tensors filled with NaN, so any element the kernel leaves unwritten shows up."""
    output = torch.full((case.num_tokens, NUM_V_HEADS, HEAD_SIZE), math.nan, dtype=torch.bfloat16, device=device)
    new_state = torch.full(
        (case.num_seqs, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE), math.nan, dtype=torch.float32, device=device
    )
    return output, new_state


def outputs_of_runs(
    case: CheckCase, runs: Sequence[Callable], device: torch.device | str, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output, new_state) of every `run` (the kernel's contract) on the same fresh inputs, each into
    NaN-poisoned outputs, in order."""
    inputs = make_inputs(case, device, seed=seed)
    results = []
    for run in runs:
        output, new_state = poisoned_outputs(case, device)
        run(*inputs.values(), output, new_state)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        results.append((output, new_state))
    return results


def bitwise_mismatch(case: CheckCase, runs: Sequence[Callable], device: torch.device | str, seed: int) -> str | None:
    """Runs every `run` (`outputs_of_runs`) and returns None when all outputs and new states are finite and
    equal bit for bit to the first run's, else what differs: how a kernel that should compute the same
    operations in the same order (another tiling of the same products) is checked."""
    (out0, state0), *others = outputs_of_runs(case, runs, device, seed)
    if not (torch.isfinite(out0).all() and torch.isfinite(state0).all()):
        return "the first run left a non-finite output or state"
    for index, (out, state) in enumerate(others, start=1):
        for name, ours, theirs in (("output", out, out0), ("new_state", state, state0)):
            if not torch.equal(ours, theirs):
                return f"run {index}: {name} differs from run 0's"
    return None


def compare(
    output: torch.Tensor, new_state: torch.Tensor, ref_output: torch.Tensor, ref_new_state: torch.Tensor
) -> Verdict:
    """The GDN track's acceptance rule on both outputs (a hopperbench.acceptance.Verdict): the
    benchmark's own gate, so a case passes here exactly when it would pass in the runner."""
    from hopperbench.acceptance import check_outputs
    from hopperbench.tracks import get_track

    return check_outputs(
        get_track("gdn_prefill").acceptance,
        {"output": output, "new_state": new_state},
        {"output": ref_output, "new_state": ref_new_state},
    )
