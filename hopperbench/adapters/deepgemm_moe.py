"""DeepGEMM's SM90 FP8 grouped GEMM (deepseek-ai/DeepGEMM 2.6.1 @ 54e2261) as a moe side.

Definition `moe_fp8_block_scale_ds_routing_topk8_ng8_kg4_e32_h7168_i2048` -> a DeepGEMM MoE
pipeline as a user of the library builds it around its two grouped GEMMs. Paths below are
deepseek-ai/DeepGEMM@54e22612409371d6364144b69086735beb54e98b:<path>:<line>.

Per call, on the stream, with torch ops except the two GEMMs:

1. Routing (DeepSeek-V3 no-aux, 8 groups, top-4 groups, top-8 experts), the same torch ops
   in the same order as our reference, so the same experts and fp32 weights come out.
2. Permutation into DeepGEMM's M-grouped *contiguous* layout: the (token, expert) pairs of the
   32 local experts are sorted by expert; expert e owns rows
   [start_e, start_e + align(n_e, alignment)), alignment = `get_mk_alignment_for_contiguous_layout()`
   (128 on SM90: csrc/jit_kernels/heuristics/runtime.hpp:10,15, and it is the only block M the SM90
   heuristic tries for this layout: csrc/jit_kernels/heuristics/sm90.hpp:31-33; README.md:80).
   `m_indices[row]` (int32, one per row) is the row's local expert, -1 on padding rows; the kernel
   takes a block's expert from its first row and skips 64-row halves that start with -1
   (deep_gemm/include/deep_gemm/scheduler/gemm.cuh:160-162,314-315).
   **One host sync:** the buffers' row count sum_e align(n_e, 128) is read to the host (with the
   pair count, in one transfer). Without it every buffer and every torch op after the routing
   would have to be sized for the worst case, 8*T + 32*127 rows (about 8x the real rows at large
   T); the masked layout (`m_grouped_fp8_gemm_nt_masked`, gemm.hpp:250-297) would need
   [32, T, K] buffers, 32x. The span timer counts the gap between the routing kernels and the
   first kernel launched after the read.
3. GEMM1 `m_grouped_fp8_gemm_nt_contiguous((x, sfx), (W13, sW13), d1, m_indices)`
   (csrc/apis/gemm.hpp:166-232, alias at 715; Python export deep_gemm/__init__.py:47): FP8 x FP8,
   fp32 accumulation with per-128-K-block scale promotion, **bf16 output** (gemm.hpp:193).
   Scale layouts on SM90 (README.md:67-69, csrc/apis/layout.hpp:40-46): activations fp32 with
   recipe (1, 128), which DeepGEMM wants MN-major and TMA-aligned (stride 1 along M, the K-block
   stride a multiple of 4 floats: csrc/utils/math.hpp:23-27); weights fp32 (128, 128), contiguous
   [G, N/128, K/128] as the definition stores them (csrc/utils/layout.hpp:109-115), used as is.
   The gathered activation scales are built directly in that layout, as `[K/128, M]`
   contiguous viewed transposed, so DeepGEMM's own transpose kernel
   (`get_mn_major_tma_aligned_tensor`, csrc/jit_kernels/impls/smxx_layout.hpp:120-125) returns it
   untouched. Default recipe (1, 128, 128) on SM90 (csrc/utils/layout.hpp:64-70); A and B K-major.
4. SwiGLU `silu(d1[:, I:]) * d1[:, :I]` (the second half is the gate) in fp32, then
   **requantisation** to e4m3 with 1x128 per-row block scales amax/448 (the recipe of
   `deep_gemm.utils.per_token_cast_to_fp8`, deep_gemm/utils/math.py:26-38, written out here so
   the scales land MN-major at once).
5. GEMM2 the same call with (W2, sW2), bf16 output [M, 7168].
6. Combine: each pair's row times its routing weight, summed per token in fp32
   (`index_add_`), cast to bf16 into `output`; tokens with no local expert get zero rows.

Accuracy against our fp32 reference. DeepGEMM itself accumulates in fp32, but the pipeline
rounds twice where the reference does not: GEMM1's output to bf16 (relative 2^-9, negligible)
and the SwiGLU output to e4m3 (3 mantissa bits). The second dominates: per element about 2-3 %
RMS relative error, and since GEMM2 sums 2048 such independent errors, the output's relative L2
error is about the same, **~2.3-2.6 %** (measured on CPU with random SwiGLU inputs and with the
fake-GEMM test of this adapter). Under the contest rule (abs <= 1 or rel <= 0.3, 90 %) that
leaves ~5 % of elements bad, those near zero; it does **not** meet our extra
`max_relative_l2 = 1e-2` bound. Production DeepGEMM MoE pipelines (SGLang, vLLM) requantise
the same way.

Build and run time (third_party/README.md, section DeepGEMM): `deep_gemm._C` is a torch C++
extension (setup.py:102-111); the GEMM kernels are compiled by NVCC at the first call of each
configuration (csrc/jit/compiler.hpp:196-222), found as `$CUDA_HOME/bin/nvcc` or
`DG_JIT_NVCC_COMPILER`, with the CUTLASS `cute`/`cutlass` headers that the wheel carries
(setup.py:45-48,149-165) and the cache in `DG_JIT_CACHE_DIR` (default `~/.deep_gemm`,
compiler.hpp:49-51). The first call per (GEMM, tile configuration) therefore takes seconds; it
has to happen in the untimed warm-up.
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
REQUIRED_FUNCTIONS = ("m_grouped_fp8_gemm_nt_contiguous", "get_mk_alignment_for_contiguous_layout")

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

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# A block whose largest magnitude is below this gets the scale of this value (DeepGEMM's floor),
# so an all-zero block quantises to zeros instead of 0/0.
AMAX_FLOOR = 1e-4


class LibraryUnavailableError(RuntimeError):
    """The library this adapter calls is missing or is not the build it was written for."""


class AdapterInputError(ValueError):
    """The arguments do not describe a moe call."""


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


@dataclass(frozen=True)
class ContiguousLayout:
    """Where each local (token, expert) pair sits in DeepGEMM's M-grouped contiguous layout.

    Rows [0, num_rows) hold the experts' segments in expert order, each padded to the
    alignment. Pairs are listed in row order.
    """

    num_rows: int
    m_indices: torch.Tensor  # [num_rows] int32: the row's local expert, -1 on padding rows
    row_token: torch.Tensor  # [num_rows] int64: the token a row reads (padding rows read token 0)
    pair_rows: torch.Tensor  # [pairs] int64
    pair_tokens: torch.Tensor  # [pairs] int64
    pair_weights: torch.Tensor  # [pairs] fp32


def contiguous_layout(
    experts: torch.Tensor, weights: torch.Tensor, local_expert_offset: int, num_local: int, alignment: int
) -> ContiguousLayout | None:
    """The grouped layout of this rank's pairs, or None when no token routes to a local expert.

    Reads the row and pair counts to the host: the call's one synchronisation.
    """
    device = experts.device
    local = experts.flatten() - local_expert_offset
    # Pairs of other ranks' experts go to the extra bucket `num_local`, which sorts last.
    bucket = torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, num_local))
    order = torch.argsort(bucket, stable=True)
    # scatter_add_ rather than bincount: bincount reads its maximum to the host on CUDA.
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    counts = counts[:num_local]
    padded = (counts + alignment - 1) // alignment * alignment
    segment_start = torch.cumsum(padded, 0) - padded
    first_pair = torch.cumsum(counts, 0) - counts
    num_rows, num_pairs = torch.stack([padded.sum(), counts.sum()]).tolist()
    if num_pairs == 0:
        return None

    pairs = order[:num_pairs]
    pair_expert = bucket[pairs]
    rank_in_expert = torch.arange(num_pairs, device=device) - first_pair[pair_expert]
    pair_rows = segment_start[pair_expert] + rank_in_expert
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


def gather_activations(
    hidden_states: torch.Tensor, hidden_states_scale: torch.Tensor, row_token: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout's rows of x (fp8 [M, H]) and their scales ([M, H/128], MN-major, TMA-aligned)."""
    # Moving fp8 rows as int64 words copies 8 bytes per element instead of 1.
    words = hidden_states.contiguous().view(torch.int64)
    rows = words.index_select(0, row_token).view(FP8)
    scales = hidden_states_scale.float().index_select(1, row_token)  # [H/128, M], contiguous
    return rows, scales.T


def swiglu_requantize(gemm1_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up in fp32, back to e4m3 with 1x128 block scales: (fp8 [M, I], scales [M, I/128] MN-major)."""
    num_rows, gemm1_size = gemm1_out.shape
    intermediate = gemm1_size // 2
    up, gate = gemm1_out[:, :intermediate].float(), gemm1_out[:, intermediate:].float()
    activated = (F.silu(gate) * up).view(num_rows, intermediate // BLOCK, BLOCK)
    scales = activated.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / FP8_MAX  # [M, I/128]
    quantized = (activated / scales[:, :, None]).to(FP8).view(num_rows, intermediate)
    return quantized, scales.T.contiguous().T


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

    `run` pins the definition's sizes; the routing constants hold here too.
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

    # Scalars arrive as Python numbers from the harness; a tensor costs a host read.
    experts, weights = route(routing_logits, routing_bias, float(routed_scaling_factor))
    alignment = int(deep_gemm.get_mk_alignment_for_contiguous_layout())
    layout = contiguous_layout(experts, weights, int(local_expert_offset), num_local, alignment)
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
    activated, activated_scales = swiglu_requantize(gemm1_out)
    del gemm1_out
    gemm2_out = torch.empty(layout.num_rows, hidden, dtype=torch.bfloat16, device=device)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
        (activated, activated_scales),
        (gemm2_weights, gemm2_weights_scale.float()),
        gemm2_out,
        layout.m_indices,
    )

    combined = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
    weighted = gemm2_out.index_select(0, layout.pair_rows).float().mul_(layout.pair_weights[:, None])
    combined.index_add_(0, layout.pair_tokens, weighted)
    output.copy_(combined)


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
