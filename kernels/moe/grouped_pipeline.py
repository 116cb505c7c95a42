"""FP8 block-scale MoE for SM90 in CuTe-DSL, grouped-GEMM pipeline (v0): the path `kernel.py` takes
for T > 2048 tokens, where 64 x 128 tiles do more MMA work per weight byte than weight streaming.
It was the whole of `kernel.py` until the streaming path (v1) was promoted (see NOTES.md).

Five kernels, all launched by one TVM-FFI call (`host.py`, shared with `kernel.py`'s streaming
path) with no host synchronisation and no data-dependent host logic (grids are sized from T only):

1. `routing.ZeroCountsKernel`: zeroes the 32 per-expert token counters (a workspace of this call).
2. `routing.RoutingKernel`, one warp per token: DeepSeek-V3 no-aux routing in fp32 (sigmoid, +bias, top-2
   sum per group of 32, top-4 groups, top-8 experts, weights from the unbiased scores). Lane l holds
   expert g*32 + l of every group g, so a group reduction is a warp reduction. For each chosen local
   expert it takes a rank in that expert's list with an atomic and writes the token there
   (`expert_tokens[e, rank]`); per slot (token, k) it records the local expert (-1 if not local),
   the rank and the weight.
3. `grouped_gemm.GroupedGemm(gemm1=True)`, grid (row tiles, 32 N tiles): a row tile is 64 tokens of one expert
   (tiles are numbered expert by expert; a CTA finds its expert from the counters and exits when it
   has none). It gathers the tokens' fp8 rows, computes [64 tokens] x [64 up + 64 gate columns]
   of G1 = A W13^T over K = 7168, and writes C = silu(gate) * up as bf16 into a packed workspace
   row `pos = offset[e] + rank` (offset = sum of the counts of the experts before e).
4. `grouped_gemm.GroupedGemm(gemm1=False)`, grid (row tiles, 56 N tiles): O = C W2^T for 64 rows x 128 output
   columns over K = 2048, written in fp32 to a packed workspace row `pos`.
5. `combine.CombineKernel`, grid (T, 7): output[t] = sum over the token's slots k = 0..7 (fixed order) of
   weight * O[pos(t, k)], in fp32, cast to bf16; a token without a local expert gets a zero row.

Numerics: both GEMMs run bf16 `mma.sync` m16n8k16 with fp32 accumulation. The e4m3 operands are
converted to bf16 in shared memory, which is exact (every e4m3 value is a bf16 value). Block scales
follow the DeepGEMM promotion: each 128-wide K block is accumulated on its own, then scaled by
(activation scale of the row) x (weight scale of the 128x128 block) and added into the fp32
accumulator. The intermediate C stays bf16 (never re-quantised to fp8). The output does not depend
on the order in which the atomics hand out ranks: every GEMM row is computed independently and the
combine sums each token's slots in slot order, so repeated calls are bitwise identical.

Layout of one GEMM CTA (128 threads, 4 warps as 2 x 2): per K block, cp.async brings the fp8
tiles (A: 64 x 128, B: 128 x 128) into a double-buffered staging area while the previous block is
converted to bf16 and multiplied.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import host
from .grouped_gemm import GroupedGemm
from .shapes import (
    BLOCK,
    BLOCK_M,
    GEMM1_OUT,
    HIDDEN,
    HIDDEN_BLOCKS,
    INTERMEDIATE,
    INTERMEDIATE_BLOCKS,
    MAX_TOKENS,
    NUM_EXPERTS,
    NUM_LOCAL_EXPERTS,
    max_row_tiles,
)

GPU_ARCH = "sm_90a"

__all__ = ["BLOCK_M", "GPU_ARCH", "MAX_TOKENS", "MoeShapeError", "compile_only", "compiled_for", "max_row_tiles", "run"]


class MoeShapeError(ValueError):
    """An input does not have the shape, dtype or layout of the definition."""


# ------------------------------------------------------------------------------------------------
# Host side (host.py: the five launches): compile once per architecture, then each call is one
# TVM-FFI launch.
# ------------------------------------------------------------------------------------------------

_COMPILED: dict[str, Callable] = {}


def _compile(arch: str) -> Callable:
    return host.compile_host(host.MoeHostSm90(GroupedGemm(gemm1=True), GroupedGemm(gemm1=False)), arch)


def compiled_for(arch: str = GPU_ARCH) -> Callable:
    """The compiled launcher for `arch` (compiled on first use; needs no GPU)."""
    fn = _COMPILED.get(arch)
    if fn is None:
        fn = _COMPILED[arch] = _compile(arch)
    return fn


def compile_only(arch: str = GPU_ARCH) -> Callable:
    """Compile all five kernels for `arch` without touching a GPU (for CI and warm-up)."""
    return compiled_for(arch)


def _check_inputs(
    routing_logits,
    routing_bias,
    hidden_states,
    hidden_states_scale,
    gemm1_weights,
    gemm1_weights_scale,
    gemm2_weights,
    gemm2_weights_scale,
    local_expert_offset,
    output,
) -> None:
    t = routing_logits.shape[0] if routing_logits.dim() == 2 else -1
    gemm1_scale_shape = (NUM_LOCAL_EXPERTS, GEMM1_OUT // BLOCK, HIDDEN_BLOCKS)
    gemm2_scale_shape = (NUM_LOCAL_EXPERTS, HIDDEN_BLOCKS, INTERMEDIATE_BLOCKS)
    expected = (
        ("routing_logits", routing_logits, (t, NUM_EXPERTS), torch.float32),
        ("routing_bias", routing_bias, (NUM_EXPERTS,), torch.bfloat16),
        ("hidden_states", hidden_states, (t, HIDDEN), torch.float8_e4m3fn),
        ("hidden_states_scale", hidden_states_scale, (HIDDEN_BLOCKS, t), torch.float32),
        ("gemm1_weights", gemm1_weights, (NUM_LOCAL_EXPERTS, GEMM1_OUT, HIDDEN), torch.float8_e4m3fn),
        ("gemm1_weights_scale", gemm1_weights_scale, gemm1_scale_shape, torch.float32),
        ("gemm2_weights", gemm2_weights, (NUM_LOCAL_EXPERTS, HIDDEN, INTERMEDIATE), torch.float8_e4m3fn),
        ("gemm2_weights_scale", gemm2_weights_scale, gemm2_scale_shape, torch.float32),
        ("output", output, (t, HIDDEN), torch.bfloat16),
    )
    for name, tensor, shape, dtype in expected:
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or not tensor.is_contiguous():
            raise MoeShapeError(
                f"{name} must be a contiguous {dtype} tensor of shape {shape}, "
                f"got {tensor.dtype} {tuple(tensor.shape)} (contiguous={tensor.is_contiguous()})"
            )
    if t > MAX_TOKENS:
        raise MoeShapeError(f"seq_len {t} exceeds {MAX_TOKENS} (the workspaces use 32-bit offsets)")
    try:
        int(local_expert_offset)
    except (TypeError, ValueError):
        raise MoeShapeError(f"local_expert_offset must be an integer, got {local_expert_offset!r}") from None


def run(
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
) -> None:
    """Destination-passing entry: fills `output` [T, 7168] bf16 (every row)."""
    inputs = (
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
    )
    _check_inputs(*inputs[:9], output)
    num_tokens = routing_logits.shape[0]
    if num_tokens == 0:
        return
    row_tiles = max_row_tiles(num_tokens)  # both GEMMs' grids
    host.launch(compiled_for(), inputs, output, host.Workspaces.allocate(num_tokens, routing_logits.device), row_tiles, row_tiles)
