"""DeepGEMM's SM90 FP8 grouped GEMMs (deepseek-ai/DeepGEMM 2.6.1 @ 54e2261) as a moe side.

Definition `moe_fp8_block_scale_ds_routing_topk8_ng8_kg4_e32_h7168_i2048` -> a DeepGEMM MoE
pipeline around its two grouped GEMMs, in the layout a serving engine feeds them by phase (DeepEP's
low-latency decode mode the masked layout, its normal prefill mode the contiguous one):

- **T <= PREFILL_TOKENS (1024): the masked layout**, the one DeepGEMM provides for CUDA graphs,
  "when the CPU is unaware of the number of tokens each expert receives" (README.md:84-88). No host
  sync; the call can be captured in a CUDA graph.
- **T > PREFILL_TOKENS: the contiguous layout**, DeepGEMM's for "inference prefilling, where each
  expert may process a varying number of tokens" (README.md:80). One host read per call sizes its
  buffers, so the call cannot be captured: inside a capture it raises `HostSyncInCapture` before
  the read (the harness records NOT_CAPTURABLE), and its eager span is the one to compare.

Both paths share the routing (step 1), the pairs' slots within their experts (step 3), the SwiGLU
with requantisation (step 5) and the combine's gather and weighting (step 7); they differ in where
the pairs' rows sit, and so in the GEMM calls and the combine's sum. Paths below are
deepseek-ai/DeepGEMM@54e22612409371d6364144b69086735beb54e98b:<path>:<line>.

Masked layout (T <= 1024). One call is a fixed sequence of 55 kernel launches on the current stream
(53 torch kernels and the two GEMMs; a new workspace adds one memset), no data-dependent shape:
every shape derives from T (the token count) and the weights' shapes. Torch ops except the two GEMMs:

1. Routing (DeepSeek-V3 no-aux, 8 groups, top-4 groups, top-8 experts), the same torch ops in the
   same order as our reference, so the same experts and fp32 weights come out (17 kernels).
2. Row budget: each of the G = 32 local experts owns `M_max = align(T, 128)` rows. T is the exact
   worst case (a token picks an expert at most once: `topk` indices are distinct); 128 is the
   largest block M the SM90 heuristic tries for this layout (csrc/jit_kernels/heuristics/sm90.hpp:34-35),
   and it must divide `M_max`: A and D are addressed as 2-D [G * M_max, K] / [G * M_max, N] tensor
   maps (csrc/jit_kernels/impls/runtime_utils.hpp:190-208,230-245), a block's rows start at
   `group * M_max + m_block * BLOCK_M` (deep_gemm/include/deep_gemm/scheduler/gemm.cuh:163-165) and
   the epilogue TMA-stores whole BLOCK_M-row tiles
   (deep_gemm/include/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh:426-441), so with an unaligned
   `M_max` a group's last tile would overwrite the next group's first rows. DeepGEMM's own test uses
   max_m = 4096 (tests/generators.py:174-187). `expected_m`, a host int that only steers the tile
   heuristic (its wave estimate, heuristics/sm90.hpp:201-208; must be > 0, csrc/apis/gemm.hpp:274),
   is 1.2 x the uniform share T * 8 / 256 as DeepGEMM's test passes `int(expected_m_per_group * 1.2)`
   (tests/test_fp8_fp4.py:162), from T alone: no device read.
3. Permutation, 16 small kernels: for each (token, slot) pair with a local expert e, its row in e's
   segment is the number of earlier tokens that chose e (a [33, T] hit matrix, `cumsum` over tokens,
   `gather`); `masked_m` (int32 [32]) is the last prefix row. x's rows (moved as int64 words) and
   their 1x128 scales are scattered with `index_put_` into `[G + 1, M_max, H]` fp8 and
   `[G + 1, H/128, M_max]` fp32; pairs of other ranks' experts write their token's row of the extra
   group G, which no GEMM reads (a static-shape scatter cannot skip them).
4. GEMM1 `m_grouped_fp8_gemm_nt_masked((x, sfx), (W13, sW13), d1, masked_m, expected_m)`
   (csrc/apis/gemm.hpp:250-297, alias at 717; Python export deep_gemm/__init__.py:49): A [G, M_max, K]
   and B [G, N, K] fp8 K-major, D [G, M_max, N] bf16 N-major, all with stride(0) = rows x cols
   (gemm.hpp:260-279, csrc/utils/layout.hpp:13-30), `masked_m` int32 contiguous with G elements
   (gemm.hpp:264,271,276). FP8 x FP8, fp32 accumulation with per-128-K-block scale promotion, bf16
   output. Scales on SM90 with the default recipe (1, 128, 128) (csrc/utils/layout.hpp:64-70):
   activations fp32 per 1x128, MN-major and TMA-aligned, [G, M_max, K/128] with strides
   (K/128 * M_max, 1, M_max) (csrc/utils/layout.hpp:100-107, csrc/utils/math.hpp:23-27); the buffer is
   `[G, K/128, M_max]` contiguous viewed transposed, so `get_mn_major_tma_aligned_tensor` returns it
   untouched (csrc/apis/layout.hpp:40-42, csrc/jit_kernels/impls/smxx_layout.hpp:120-125) and no
   transpose kernel runs; weights fp32 (128, 128) contiguous [G, N/128, K/128], used as the
   definition stores them (csrc/apis/layout.hpp:44-46, csrc/utils/layout.hpp:109-115).
   The kernel reads `masked_m[g]` on the device and schedules ceil(masked_m[g] / BLOCK_M) row blocks
   per group (scheduler/gemm.cuh:200-210), skipping 64-row halves that start past it
   (gemm.cuh:316-317, sm90_fp8_gemm_1d2d.cuh:273-274): **the padding costs memory and permutation
   work, not MMA work**. Rows of a group's last tile beyond `masked_m` are computed from whatever
   the buffers hold there and stored (garbage, possibly NaN, or zeros for a skipped half); rows are
   independent in the MMA and its per-row scale promotion, and nothing downstream reads them.
5. SwiGLU `silu(d1[..., I:]) * d1[..., :I]` (the second half is the gate) in fp32, then
   **requantisation** to e4m3 with 1x128 per-row block scales amax/448 (the recipe of
   `deep_gemm.utils.per_token_cast_to_fp8`, deep_gemm/utils/math.py:26-38), on the 8T pair rows
   gathered from d1 (not on the whole [G, M_max] buffer, which is >= 4x more rows), scattered like
   x into `[G + 1, M_max, I]` fp8 and `[G + 1, I/128, M_max]` fp32 (15 kernels with the row indices).
6. GEMM2 the same call with (W2, sW2): bf16 [G, M_max, 7168].
7. Combine: each pair gathers its row of GEMM2's output (pairs of other experts gather a row kept at
   zero, after the G * M_max rows DeepGEMM writes), times its routing weight in fp32, summed over
   the token's 8 slots in fp32, cast to bf16 into `output`; a token with no local expert gets a zero
   row. Only rows < masked_m are ever gathered (5 kernels).

What the static shapes cost: the torch stages between the GEMMs run over all 8T (token, slot) pairs,
about 8x the local ones at uniform routing (T of them), against one pair row each in a fused serving
kernel: ~0.9 GB of elementwise traffic for the SwiGLU/requantisation and as much for the combine at
T = 1024 (~12 GB each at T = 14107, which this path no longer serves). At T <= ~100 the call is
launch-bound.

Buffers (`Workspace`, the preallocated workspace a serving engine keeps): x rows
[G + 1, M_max, H] fp8 and scales [G + 1, H/128, M_max] fp32, d1 [G, M_max, 2I] bf16, activated rows
[G + 1, M_max, I] fp8 and scales [G + 1, I/128, M_max] fp32, d2 [G * M_max + 1, H] bf16 (last row
zero): at T = 1024 0.24 + 0.27 + 0.07 + 0.47 GB plus 10 MB of scales; the per-call temporaries
(pair rows, SwiGLU, combine) add ~0.4 GB. Outside a capture it is kept per (device, stream) for the
last sizes and reused: calls on one stream are ordered, so reuse is safe. Inside a CUDA-graph
capture the call allocates a fresh one through the caching allocator, which serves it from the
capture's private pool; the graph then owns it and no module state refers to it (so no later call
can free or reuse memory that a replay writes). Nothing reads a buffer's uninitialised part
(step 4), so a fresh buffer needs no clearing except the zero row of d2.

Contiguous layout (T > 1024). Step 1 and the slots of step 3 as above, then:

- Permutation: the local pairs' slots within their experts come from the masked layout's
  computation (step 3, a [T, 33] int32 matrix); expert e owns rows
  [start_e, start_e + align(n_e, A)) of one [M, K] buffer, in expert order,
  A = `get_mk_alignment_for_contiguous_layout()` (128 on SM90:
  csrc/jit_kernels/heuristics/runtime.hpp:10,15, the only block M the SM90 heuristic tries for this
  layout: heuristics/sm90.hpp:31-33). `m_indices` (int32 [M]) holds each row's local expert, -1 on
  padding rows; the kernel takes a block's expert from its first row and skips 64-row halves that
  start with -1 (scheduler/gemm.cuh:160-162,314-315). **The one host sync:** M = sum_e align(n_e, 128)
  and the local pair count are read to the host in one transfer (`read_sizes`); the eager span holds
  the wait for it and the launch gap after it. A token's x row and its scales are gathered into the
  buffer (padding rows read token 0's, never read back); scales as `[K/128, M]` contiguous viewed
  transposed, MN-major and TMA-aligned (M is a multiple of 128), which DeepGEMM takes untouched as
  in step 4.
- GEMM1 `m_grouped_fp8_gemm_nt_contiguous((x, sfx), (W13, sW13), d1, m_indices)`
  (csrc/apis/gemm.hpp:166-232, alias at 715; Python export deep_gemm/__init__.py:47): A [M, K] fp8
  K-major, D [M, N] bf16 N-major (gemm.hpp:193,207), `m_indices` int32 contiguous with M elements
  (gemm.hpp:184,194,201-202).
- SwiGLU and requantisation (step 5) on all M rows of d1 (at most 32 x 127 more than the local
  pairs), the scales made MN-major (one transpose copy); GEMM2 the same call with (W2, sW2).
- Combine: the local pairs' rows of d2 times their routing weights in fp32, added into a per-token
  fp32 sum (`index_add_`: local pairs only, about T rows at uniform routing rather than 8T slots;
  fp32 atomics on the GPU, so the order of a token's additions may vary), cast to bf16 into
  `output`; tokens with no local expert get zero rows. No local pair at all: zeros, no GEMM.
  Buffers are per-call allocations from torch's caching allocator (M rows each; about 1 GB in all
  at T = 14107 with uniform routing).

PREFILL_TOKENS is not tuned: it separates the official workloads' decode rows (<= 901 tokens) from
their prefill rows (11948, 14107) as an engine's phase would; where between them is immaterial.

Accuracy against our fp32 reference. DeepGEMM itself accumulates in fp32, but the pipeline
rounds twice where the reference does not: GEMM1's output to bf16 (relative 2^-9, negligible)
and the SwiGLU output to e4m3 (3 mantissa bits). The second dominates: per element about 2-3 %
RMS relative error, and since GEMM2 sums 2048 such independent errors, the output's relative L2
error is about the same, **~2.3-2.6 %** (measured on CPU with random SwiGLU inputs and with the
fake-GEMM test of this adapter). Under the contest rule (abs <= 1 or rel <= 0.3, 90 %) that
leaves ~5 % of elements bad, those near zero: it passes; it does **not** meet our extra
`max_relative_l2 = 1e-2` bound. Production DeepGEMM MoE pipelines (SGLang, vLLM) requantise
the same way.

Build and run time (third_party/README.md, section DeepGEMM): `deep_gemm._C` is a torch C++
extension (setup.py:102-111); the GEMM kernels are compiled by NVCC at the first call of each
configuration (csrc/jit/compiler.hpp:196-222), found as `$CUDA_HOME/bin/nvcc` or
`DG_JIT_NVCC_COMPILER`, with the CUTLASS `cute`/`cutlass` headers that the wheel carries
(setup.py:45-48,149-165) and the cache in `DG_JIT_CACHE_DIR` (default `~/.deep_gemm`,
compiler.hpp:49-51). The first call per (GEMM, tile configuration) therefore takes seconds; it
has to happen in the untimed warm-up, before any capture. Kernels launch on torch's current
stream (csrc/jit/kernel_runtime.hpp:139-141), which is what a capture records.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

DEEP_GEMM_DISTRIBUTION = "deep_gemm"
# setup.py:54-73: public version from deep_gemm/__init__.py:127, plus the short commit of the
# clean git checkout it was built from.
DEEP_GEMM_VERSION = "2.6.1+54e2261"
REQUIRED_FUNCTIONS = (
    "m_grouped_fp8_gemm_nt_masked",
    "m_grouped_fp8_gemm_nt_contiguous",
    "get_mk_alignment_for_contiguous_layout",
)

NUM_EXPERTS = 256
NUM_LOCAL_EXPERTS = 32
HIDDEN_SIZE = 7168
INTERMEDIATE_SIZE = 2048
BLOCK = 128
TOP_K = 8
NUM_GROUPS = 8
TOP_K_GROUPS = 4
TOP_IN_GROUP = 2
NORMALISATION_EPS = 1e-20

# Serving engines pick the layout by phase: prefill batches go through DeepEP's normal mode into the
# contiguous layout (one host sync), decode batches through its low-latency mode into the masked
# layout (CUDA graphs). Every official workload has either <= 901 tokens or >= 11948, so this split
# decides only the two prefill rows (contiguous) against the rest (masked); the value is not tuned.
PREFILL_TOKENS = 1024

# The largest block M of the SM90 masked heuristic (heuristics/sm90.hpp:34-35): a group's row budget
# is a multiple of it, so no tile of one group reaches into the next.
ROW_ALIGNMENT = 128

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# A block whose largest magnitude is below this gets the scale of this value (DeepGEMM's floor),
# so an all-zero block quantises to zeros instead of 0/0.
AMAX_FLOOR = 1e-4


class LibraryUnavailableError(RuntimeError):
    """The library this adapter calls is missing or is not the build it was written for."""


class AdapterInputError(ValueError):
    """The arguments do not describe a moe call."""


class HostSyncInCapture(RuntimeError):
    """The contiguous layout's host read was reached inside a CUDA-graph capture, which cannot record it."""


@functools.cache
def load_deep_gemm() -> ModuleType:
    """The `deep_gemm` module, after checking that the installed build is the pinned one."""
    try:
        installed = importlib.metadata.version(DEEP_GEMM_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise LibraryUnavailableError(
            f"{DEEP_GEMM_DISTRIBUTION} is not installed (build it from third_party/DeepGEMM, see third_party/README.md)"
        ) from None
    if installed != DEEP_GEMM_VERSION:
        raise LibraryUnavailableError(
            f"{DEEP_GEMM_DISTRIBUTION} {installed} is installed; this adapter targets {DEEP_GEMM_VERSION}"
        )
    try:
        deep_gemm = importlib.import_module("deep_gemm")
    except ImportError as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise LibraryUnavailableError(f"deep_gemm {installed} does not import: {first_line}") from None
    missing = [name for name in REQUIRED_FUNCTIONS if not hasattr(deep_gemm, name)]
    if missing:
        raise LibraryUnavailableError(f"deep_gemm {installed} lacks {', '.join(missing)} (built without FP8 support?)")
    return deep_gemm


def route(
    routing_logits: torch.Tensor, routing_bias: torch.Tensor, routed_scaling_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 no-aux top-k: (expert ids [T, 8] int64, combination weights [T, 8] fp32).

    Selection uses sigmoid(logits) + bias: groups are scored by the sum of their top-2, the
    top-4 groups are kept, the top-8 experts among them chosen; weights are the unbiased
    sigmoid scores normalised over the chosen 8, times `routed_scaling_factor`.
    """
    num_tokens = routing_logits.shape[0]
    scores = torch.sigmoid(routing_logits.float())
    biased = scores + routing_bias.float()[None, :]

    group_size = NUM_EXPERTS // NUM_GROUPS
    grouped = biased.view(num_tokens, NUM_GROUPS, group_size)
    group_scores = grouped.topk(TOP_IN_GROUP, dim=-1).values.sum(dim=-1)
    kept_groups = group_scores.topk(TOP_K_GROUPS, dim=-1).indices
    group_kept = torch.zeros(num_tokens, NUM_GROUPS, dtype=torch.bool, device=scores.device)
    group_kept.scatter_(1, kept_groups, True)
    expert_kept = group_kept.repeat_interleave(group_size, dim=1)

    candidates = biased.masked_fill(~expert_kept, float("-inf"))
    experts = candidates.topk(TOP_K, dim=-1).indices
    chosen = scores.gather(1, experts)
    weights = chosen / (chosen.sum(dim=-1, keepdim=True) + NORMALISATION_EPS) * routed_scaling_factor
    return experts, weights


def row_budget(num_tokens: int) -> int:
    """Rows per expert in the masked layout: T (a token picks an expert at most once), aligned."""
    return max(1, -(-num_tokens // ROW_ALIGNMENT)) * ROW_ALIGNMENT


def expected_rows(num_tokens: int) -> int:
    """DeepGEMM's `expected_m` hint: 1.2 x the uniform share T * 8 / 256, at least 1, at most the budget.

    Host arithmetic on T only. 1.2 as in DeepGEMM's test (tests/test_fp8_fp4.py:162).
    """
    share = -(-num_tokens * TOP_K * 6 // (NUM_EXPERTS * 5))
    return min(max(1, share), row_budget(num_tokens))


@dataclass(frozen=True)
class MaskedLayout:
    """Where each (token, slot) pair of the routing sits in the masked layout; all shapes from T.

    Pairs of a local expert e sit at row `slot` of group e, slots 0, 1, ... in token order;
    the others at row `token` of the extra group `num_local`, which no GEMM reads.
    """

    masked_m: torch.Tensor  # [num_local] int32: rows used per expert
    group: torch.Tensor  # [T, 8] int64: the pair's group (num_local for other ranks' experts)
    row: torch.Tensor  # [T, 8] int64: the pair's row in its group
    is_local: torch.Tensor  # [T, 8] bool


def local_groups(experts: torch.Tensor, local_expert_offset: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(group, is_local) of each (token, slot) pair: its local expert, or `num_local` for other ranks' experts."""
    local = experts - local_expert_offset
    is_local = (local >= 0) & (local < num_local)
    return torch.where(is_local, local, num_local), is_local


def masked_layout(experts: torch.Tensor, local_expert_offset: int, num_local: int) -> MaskedLayout:
    """The masked layout of the routing's pairs, on the device, without a host read."""
    num_tokens = experts.shape[0]
    group, is_local = local_groups(experts, local_expert_offset, num_local)
    # hits[e, t] = 1 if token t chose local expert e (row num_local collects the other pairs). Expert-major, so
    # that the running count over tokens is an innermost scan, which torch runs in parallel; over an outer
    # dimension it runs one thread per column serially over T (2.6 ms at 14107 tokens).
    hits = torch.zeros(num_local + 1, num_tokens, dtype=torch.int32, device=experts.device)
    hits.scatter_(0, group.t(), 1)
    taken = hits.cumsum(1, dtype=torch.int32)  # taken[e, t]: tokens <= t that chose e
    slot = taken.gather(0, group.t()).t() - 1  # exclusive count for a local pair
    token = torch.arange(num_tokens, device=experts.device)[:, None]
    row = torch.where(is_local, slot, token)
    return MaskedLayout(masked_m=taken[:num_local, -1].contiguous(), group=group, row=row, is_local=is_local)


@dataclass(frozen=True)
class ContiguousLayout:
    """Where each local (token, slot) pair sits in DeepGEMM's M-grouped contiguous layout.

    Rows [0, num_rows) hold the local experts' segments in expert order, each padded to the
    alignment; pairs are listed by expert, then token.
    """

    num_rows: int
    m_indices: torch.Tensor  # [num_rows] int32: the row's local expert, -1 on padding rows
    row_token: torch.Tensor  # [num_rows] int64: the token whose x a row holds (padding rows: token 0)
    pair_rows: torch.Tensor  # [pairs] int64
    pair_tokens: torch.Tensor  # [pairs] int64
    pair_weights: torch.Tensor  # [pairs] fp32


def capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def read_sizes(sizes: torch.Tensor) -> list[int]:
    """The contiguous path's one host read (one transfer); refused inside a CUDA-graph capture."""
    if capturing(sizes.device):
        raise HostSyncInCapture(
            f"deepgemm_grouped above {PREFILL_TOKENS} tokens runs DeepGEMM's contiguous layout, which reads "
            "its row count to the host once per call (a host sync): not capturable in a CUDA graph"
        )
    return sizes.tolist()


def contiguous_layout(
    experts: torch.Tensor, weights: torch.Tensor, local_expert_offset: int, num_local: int, alignment: int
) -> ContiguousLayout | None:
    """The contiguous layout of this rank's pairs, or None when no pair has a local expert.

    A pair's row within its expert is its masked-layout slot (token order); segments start at the
    aligned prefix sums of the experts' counts. Reads the row and pair counts to the host: the call's
    one synchronisation.
    """
    device = experts.device
    slots = masked_layout(experts, local_expert_offset, num_local)
    counts = slots.masked_m.long()
    padded = (counts + alignment - 1) // alignment * alignment
    segment_start = torch.cumsum(padded, 0) - padded
    num_rows, num_pairs = read_sizes(torch.stack([padded.sum(), counts.sum()]))
    if num_pairs == 0:
        return None

    # Other ranks' pairs are in group `num_local`, which sorts last.
    group = slots.group.flatten()
    pairs = torch.argsort(group, stable=True)[:num_pairs]
    pair_expert = group[pairs]
    pair_rows = segment_start[pair_expert] + slots.row.flatten()[pairs]
    pair_tokens = pairs // TOP_K
    m_indices = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
    m_indices[pair_rows] = pair_expert.to(torch.int32)
    row_token = torch.zeros(num_rows, dtype=torch.int64, device=device)
    row_token[pair_rows] = pair_tokens
    return ContiguousLayout(
        num_rows=num_rows,
        m_indices=m_indices,
        row_token=row_token,
        pair_rows=pair_rows,
        pair_tokens=pair_tokens,
        pair_weights=weights.flatten()[pairs].float(),
    )


@dataclass(frozen=True)
class Workspace:
    """The call's buffers in the masked layout; sizes from T and the weights' shapes only.

    The `*_rows` buffers are int64 words (8 fp8 values each), so a row moves as 8-byte words.
    """

    x_rows: torch.Tensor  # [G + 1, M_max, H / 8] int64 (fp8 x)
    x_scales: torch.Tensor  # [G + 1, H / 128, M_max] fp32
    gemm1_out: torch.Tensor  # [G, M_max, 2I] bf16
    act_rows: torch.Tensor  # [G + 1, M_max, I / 8] int64 (fp8 SwiGLU output)
    act_scales: torch.Tensor  # [G + 1, I / 128, M_max] fp32
    gemm2_out: torch.Tensor  # [G * M_max + 1, H] bf16, the last row zero

    @staticmethod
    def allocate(
        num_local: int, rows: int, hidden: int, intermediate: int, device: torch.device
    ) -> Workspace:
        def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device)

        gemm2_out = empty(num_local * rows + 1, hidden, dtype=torch.bfloat16)
        gemm2_out[-1].zero_()
        return Workspace(
            x_rows=empty(num_local + 1, rows, hidden // 8, dtype=torch.int64),
            x_scales=empty(num_local + 1, hidden // BLOCK, rows, dtype=torch.float32),
            gemm1_out=empty(num_local, rows, 2 * intermediate, dtype=torch.bfloat16),
            act_rows=empty(num_local + 1, rows, intermediate // 8, dtype=torch.int64),
            act_scales=empty(num_local + 1, intermediate // BLOCK, rows, dtype=torch.float32),
            gemm2_out=gemm2_out,
        )


# (device, stream) -> (sizes, workspace) of the last eager call there; see the module docstring.
_KEPT: dict[tuple[str, int], tuple[tuple[int, int, int, int], Workspace]] = {}


def workspace(num_local: int, rows: int, hidden: int, intermediate: int, device: torch.device) -> Workspace:
    """The kept workspace of this (device, stream), or a fresh one inside a CUDA-graph capture."""
    sizes = (num_local, rows, hidden, intermediate)
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return Workspace.allocate(*sizes, device)
        key = (str(device), torch.cuda.current_stream(device).cuda_stream)
    else:
        key = (str(device), 0)
    kept = _KEPT.get(key)
    if kept is None or kept[0] != sizes:
        _KEPT.pop(key, None)  # free the old one before allocating its successor
        kept = _KEPT[key] = (sizes, Workspace.allocate(*sizes, device))
    return kept[1]


def release_workspaces() -> None:
    """Drop the kept workspaces (their memory returns to torch's caching allocator)."""
    _KEPT.clear()


def scatter_rows(
    rows: torch.Tensor, scales: torch.Tensor, layout: MaskedLayout, values: torch.Tensor, value_scales: torch.Tensor
) -> None:
    """Write each pair's fp8 row and its 1x128 scales into the masked buffers.

    `values` is [T, 1 or 8, W] int64 words and `value_scales` [T, 1 or 8, C / 128] fp32
    (broadcast over the 8 slots when 1).
    """
    rows.index_put_((layout.group, layout.row), values)
    blocks = torch.arange(scales.shape[1], device=scales.device)
    scales.index_put_((layout.group[:, :, None], blocks, layout.row[:, :, None]), value_scales)


def swiglu_requantize(gemm1_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up in fp32, back to e4m3 with 1x128 block scales: (fp8 [M, I], scales [M, I/128] fp32)."""
    num_rows, gemm1_size = gemm1_rows.shape
    intermediate = gemm1_size // 2
    activated = F.silu(gemm1_rows[:, intermediate:].float(), inplace=True)
    activated.mul_(gemm1_rows[:, :intermediate])  # bf16 `up`, promoted: the product is fp32
    blocks = activated.view(num_rows, intermediate // BLOCK, BLOCK)
    scales = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=-1)  # the blocks' amax, one pass
    scales = scales.clamp_min_(AMAX_FLOOR).div_(FP8_MAX)  # [M, I/128]
    quantized = blocks.div_(scales[:, :, None]).to(FP8).view(num_rows, intermediate)
    return quantized, scales


def mn_major(scales: torch.Tensor) -> torch.Tensor:
    """[M, K/128] scales as DeepGEMM's SM90 activation scales: MN-major (TMA-aligned when 4 divides M)."""
    return scales.T.contiguous().T


def gather_activations(
    hidden_states: torch.Tensor, hidden_states_scale: torch.Tensor, row_token: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contiguous layout's rows of x (fp8 [M, H], moved as int64 words) and their scales ([M, H/128], MN-major)."""
    words = hidden_states.contiguous().view(torch.int64)
    rows = words.index_select(0, row_token).view(FP8)
    scales = hidden_states_scale.float().index_select(1, row_token)  # [H/128, M], contiguous
    return rows, scales.T


def weighted_rows(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`rows[index]` times `weights` in fp32: [*index.shape, H] (bf16 x fp32 promotes in one kernel)."""
    gathered = rows.index_select(0, index.flatten()).view(*index.shape, rows.shape[1])
    return torch.mul(gathered, weights.float()[..., None])


def combine_slots(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, output: torch.Tensor) -> None:
    """output[t] = sum_k weights[t, k] * rows[index[t, k]] over all 8 slots, in fp32 (masked layout: a
    fixed shape; other ranks' slots index a zero row)."""
    output.copy_(weighted_rows(rows, index, weights).sum(dim=1))


def combine_pairs(
    rows: torch.Tensor, index: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor, output: torch.Tensor
) -> None:
    """output[t] = sum of weights[p] * rows[index[p]] over the listed pairs p of token t, in fp32 (contiguous
    layout: the local pairs only); a token with no pair gets zeros."""
    combined = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
    combined.index_add_(0, tokens, weighted_rows(rows, index, weights))
    output.copy_(combined)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AdapterInputError(message)


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    _check(tuple(tensor.shape) == expected, f"{name} must have shape {expected}, got {tuple(tensor.shape)}")


def moe_pipeline(
    deep_gemm: ModuleType,
    routing_logits: torch.Tensor,
    routing_bias: torch.Tensor,
    hidden_states: torch.Tensor,
    hidden_states_scale: torch.Tensor,
    gemm1_weights: torch.Tensor,
    gemm1_weights_scale: torch.Tensor,
    gemm2_weights: torch.Tensor,
    gemm2_weights_scale: torch.Tensor,
    local_expert_offset: int | torch.Tensor,
    routed_scaling_factor: float | torch.Tensor,
    output: torch.Tensor,
) -> None:
    """The DeepGEMM MoE for any hidden/intermediate sizes (multiples of 128) and local expert count.

    `run` pins the definition's sizes; the routing constants hold here too. Up to PREFILL_TOKENS tokens the
    masked layout (no host sync), above it the contiguous layout (one host read).
    """
    num_tokens, hidden = hidden_states.shape
    num_local, gemm1_size, _ = gemm1_weights.shape
    intermediate = gemm1_size // 2
    _check(hidden % BLOCK == 0 and intermediate % BLOCK == 0, "hidden and intermediate sizes must be multiples of 128")
    _check(hidden_states.dtype == FP8, f"hidden_states must be float8_e4m3fn, got {hidden_states.dtype}")
    _check_shape("routing_logits", routing_logits, (num_tokens, NUM_EXPERTS))
    _check_shape("routing_bias", routing_bias, (NUM_EXPERTS,))
    _check_shape("hidden_states_scale", hidden_states_scale, (hidden // BLOCK, num_tokens))
    _check_shape("gemm1_weights", gemm1_weights, (num_local, 2 * intermediate, hidden))
    _check_shape("gemm1_weights_scale", gemm1_weights_scale, (num_local, gemm1_size // BLOCK, hidden // BLOCK))
    _check_shape("gemm2_weights", gemm2_weights, (num_local, hidden, intermediate))
    _check_shape("gemm2_weights_scale", gemm2_weights_scale, (num_local, hidden // BLOCK, intermediate // BLOCK))
    _check_shape("output", output, (num_tokens, hidden))
    _check(output.dtype == torch.bfloat16, f"output must be bfloat16, got {output.dtype}")
    if num_tokens == 0:
        return

    # Scalars arrive as Python numbers from the harness; a tensor here costs a host read (not in a
    # capture: the harness passes numbers).
    experts, weights = route(routing_logits, routing_bias, float(routed_scaling_factor))
    layout_moe = masked_moe if num_tokens <= PREFILL_TOKENS else contiguous_moe
    layout_moe(
        deep_gemm,
        experts,
        weights,
        int(local_expert_offset),
        hidden_states,
        hidden_states_scale,
        gemm1_weights,
        gemm1_weights_scale,
        gemm2_weights,
        gemm2_weights_scale,
        output,
    )


def masked_moe(
    deep_gemm: ModuleType,
    experts: torch.Tensor,
    weights: torch.Tensor,
    local_expert_offset: int,
    hidden_states: torch.Tensor,
    hidden_states_scale: torch.Tensor,
    gemm1_weights: torch.Tensor,
    gemm1_weights_scale: torch.Tensor,
    gemm2_weights: torch.Tensor,
    gemm2_weights_scale: torch.Tensor,
    output: torch.Tensor,
) -> None:
    """Steps 2-7 in the masked layout, from the routing: static shapes, no host sync."""
    num_tokens, hidden = hidden_states.shape
    num_local, gemm1_size, _ = gemm1_weights.shape
    intermediate = gemm1_size // 2
    layout = masked_layout(experts, local_expert_offset, num_local)
    rows = row_budget(num_tokens)
    expected_m = expected_rows(num_tokens)
    ws = workspace(num_local, rows, hidden, intermediate, hidden_states.device)

    # x: every slot of token t gets x[t]; the values broadcast over the 8 slots.
    x_words = hidden_states.contiguous().view(torch.int64)[:, None, :]
    x_scales = hidden_states_scale.float().T[:, None, :]
    scatter_rows(ws.x_rows, ws.x_scales, layout, x_words, x_scales)
    deep_gemm.m_grouped_fp8_gemm_nt_masked(
        (ws.x_rows[:num_local].view(FP8), ws.x_scales[:num_local].transpose(1, 2)),
        (gemm1_weights, gemm1_weights_scale.float()),
        ws.gemm1_out,
        layout.masked_m,
        expected_m,
    )

    # The pairs' rows of GEMM1's output: local pairs read theirs, the others row 0 of group 0 (any
    # row; their results go to the unread extra group).
    flat_rows = layout.group * rows + layout.row
    pair_rows = torch.where(layout.is_local, flat_rows, 0).flatten()
    activated, activated_scales = swiglu_requantize(ws.gemm1_out.view(-1, gemm1_size).index_select(0, pair_rows))
    scatter_rows(
        ws.act_rows,
        ws.act_scales,
        layout,
        activated.view(torch.int64).view(num_tokens, TOP_K, -1),
        activated_scales.view(num_tokens, TOP_K, -1),
    )
    del activated, activated_scales
    gemm2_out = ws.gemm2_out[: num_local * rows].view(num_local, rows, hidden)
    deep_gemm.m_grouped_fp8_gemm_nt_masked(
        (ws.act_rows[:num_local].view(FP8), ws.act_scales[:num_local].transpose(1, 2)),
        (gemm2_weights, gemm2_weights_scale.float()),
        gemm2_out,
        layout.masked_m,
        expected_m,
    )

    # Other ranks' pairs read the zero row after the G * M_max rows of GEMM2's output.
    combine_slots(ws.gemm2_out, torch.where(layout.is_local, flat_rows, num_local * rows), weights, output)


def contiguous_moe(
    deep_gemm: ModuleType,
    experts: torch.Tensor,
    weights: torch.Tensor,
    local_expert_offset: int,
    hidden_states: torch.Tensor,
    hidden_states_scale: torch.Tensor,
    gemm1_weights: torch.Tensor,
    gemm1_weights_scale: torch.Tensor,
    gemm2_weights: torch.Tensor,
    gemm2_weights_scale: torch.Tensor,
    output: torch.Tensor,
) -> None:
    """The contiguous layout's pipeline, from the routing: one host read sizes its buffers."""
    hidden = hidden_states.shape[1]
    num_local, gemm1_size, _ = gemm1_weights.shape
    alignment = int(deep_gemm.get_mk_alignment_for_contiguous_layout())
    layout = contiguous_layout(experts, weights, local_expert_offset, num_local, alignment)
    if layout is None:
        output.zero_()
        return

    device = hidden_states.device
    x, x_scales = gather_activations(hidden_states, hidden_states_scale, layout.row_token)
    gemm1_out = torch.empty(layout.num_rows, gemm1_size, dtype=torch.bfloat16, device=device)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
        (x, x_scales),
        (gemm1_weights, gemm1_weights_scale.float()),
        gemm1_out,
        layout.m_indices,
    )
    del x, x_scales
    activated, activated_scales = swiglu_requantize(gemm1_out)
    del gemm1_out
    gemm2_out = torch.empty(layout.num_rows, hidden, dtype=torch.bfloat16, device=device)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
        (activated, mn_major(activated_scales)),
        (gemm2_weights, gemm2_weights_scale.float()),
        gemm2_out,
        layout.m_indices,
    )
    del activated, activated_scales
    combine_pairs(gemm2_out, layout.pair_rows, layout.pair_tokens, layout.pair_weights, output)


@torch.no_grad()
def run(
    routing_logits: torch.Tensor,
    routing_bias: torch.Tensor,
    hidden_states: torch.Tensor,
    hidden_states_scale: torch.Tensor,
    gemm1_weights: torch.Tensor,
    gemm1_weights_scale: torch.Tensor,
    gemm2_weights: torch.Tensor,
    gemm2_weights_scale: torch.Tensor,
    local_expert_offset: int | torch.Tensor,
    routed_scaling_factor: float | torch.Tensor,
    output: torch.Tensor,
) -> None:
    """moe_fp8_block_scale_ds_routing_topk8_ng8_kg4_e32_h7168_i2048 in destination-passing style through DeepGEMM."""
    num_tokens = hidden_states.shape[0]
    _check_shape("hidden_states", hidden_states, (num_tokens, HIDDEN_SIZE))
    _check_shape("gemm1_weights", gemm1_weights, (NUM_LOCAL_EXPERTS, 2 * INTERMEDIATE_SIZE, HIDDEN_SIZE))
    _check_shape("gemm2_weights", gemm2_weights, (NUM_LOCAL_EXPERTS, HIDDEN_SIZE, INTERMEDIATE_SIZE))
    moe_pipeline(
        load_deep_gemm(),
        routing_logits,
        routing_bias,
        hidden_states,
        hidden_states_scale,
        gemm1_weights,
        gemm1_weights_scale,
        gemm2_weights,
        gemm2_weights_scale,
        local_expert_offset,
        routed_scaling_factor,
        output,
    )
