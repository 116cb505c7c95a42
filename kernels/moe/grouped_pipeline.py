"""FP8 block-scale MoE for SM90 in CuTe-DSL, grouped-GEMM pipeline (v0): the path `kernel.py` takes
for T > 2048 tokens, where 64 x 128 tiles do more MMA work per weight byte than weight streaming.
It was the whole of `kernel.py` until the streaming path (v1) was promoted (see NOTES.md).

Five kernels, all launched by one TVM-FFI call with no host synchronisation and no data-dependent
host logic (grids are sized from T only):

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

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from .combine import CombineKernel
from .grouped_gemm import GroupedGemm
from .routing import RoutingKernel, ZeroCountsKernel
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
    TOP_K,
    max_row_tiles,
)

GPU_ARCH = "sm_90a"

__all__ = ["BLOCK_M", "GPU_ARCH", "MAX_TOKENS", "MoeShapeError", "compile_only", "compiled_for", "max_row_tiles", "run"]


class MoeShapeError(ValueError):
    """An input does not have the shape, dtype or layout of the definition."""


# ------------------------------------------------------------------------------------------------
# host function of all five kernels
# ------------------------------------------------------------------------------------------------


class MoeFp8BlockScaleSm90:
    """One compile serves every T (dynamic) and every offset / scaling factor (runtime scalars)."""

    @cute.jit
    def __call__(
        self,
        routing_logits: cute.Tensor,
        routing_bias: cute.Tensor,
        hidden_states: cute.Tensor,
        hidden_states_scale: cute.Tensor,
        gemm1_weights: cute.Tensor,
        gemm1_weights_scale: cute.Tensor,
        gemm2_weights: cute.Tensor,
        gemm2_weights_scale: cute.Tensor,
        local_expert_offset: cutlass.Int32,
        routed_scaling_factor: cutlass.Float32,
        output: cute.Tensor,
        counts: cute.Tensor,
        expert_tokens: cute.Tensor,
        slot_expert: cute.Tensor,
        slot_rank: cute.Tensor,
        slot_weight: cute.Tensor,
        intermediate: cute.Tensor,
        expert_out: cute.Tensor,
        num_row_tiles: cutlass.Int32,
        stream,
    ):
        ZeroCountsKernel().launch(counts, stream)
        RoutingKernel().launch(
            routing_logits,
            routing_bias,
            local_expert_offset,
            routed_scaling_factor,
            counts,
            expert_tokens,
            slot_expert,
            slot_rank,
            slot_weight,
            stream,
        )
        GroupedGemm(gemm1=True).launch(
            hidden_states,
            hidden_states_scale,
            gemm1_weights,
            gemm1_weights_scale,
            intermediate,
            counts,
            expert_tokens,
            num_row_tiles,
            stream,
        )
        GroupedGemm(gemm1=False).launch(
            intermediate,
            hidden_states_scale,
            gemm2_weights,
            gemm2_weights_scale,
            expert_out,
            counts,
            expert_tokens,
            num_row_tiles,
            stream,
        )
        CombineKernel().launch(counts, slot_expert, slot_rank, slot_weight, expert_out, output, stream)


# ------------------------------------------------------------------------------------------------
# Host side: compile once per architecture, then each call is one TVM-FFI launch.
# ------------------------------------------------------------------------------------------------

_COMPILED: dict[str, Callable] = {}


def fake_tensor_arguments() -> tuple:
    """Compile-time stand-ins (symbolic T and packed-row count) for the host launcher's arguments
    from `routing_logits` through the workspaces, in call order; each launcher appends its own
    trailing scalars and the stream. Shared by every MoE kernel of this folder."""
    num_tokens = cute.sym_int()
    num_rows = cute.sym_int()  # packed workspace rows (8 T)

    def rowmajor(dtype, shape):
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=16)

    f32, bf16, fp8, i32 = cutlass.Float32, cutlass.BFloat16, cutlass.Float8E4M3FN, cutlass.Int32
    return (
        rowmajor(f32, (num_tokens, NUM_EXPERTS)),
        rowmajor(bf16, (NUM_EXPERTS,)),
        rowmajor(fp8, (num_tokens, HIDDEN)),
        rowmajor(f32, (HIDDEN_BLOCKS, num_tokens)),
        rowmajor(fp8, (NUM_LOCAL_EXPERTS, GEMM1_OUT, HIDDEN)),
        rowmajor(f32, (NUM_LOCAL_EXPERTS, GEMM1_OUT // BLOCK, HIDDEN_BLOCKS)),
        rowmajor(fp8, (NUM_LOCAL_EXPERTS, HIDDEN, INTERMEDIATE)),
        rowmajor(f32, (NUM_LOCAL_EXPERTS, HIDDEN_BLOCKS, INTERMEDIATE_BLOCKS)),
        0,
        1.0,
        rowmajor(bf16, (num_tokens, HIDDEN)),
        rowmajor(i32, (NUM_LOCAL_EXPERTS,)),
        rowmajor(i32, (NUM_LOCAL_EXPERTS, num_tokens)),
        rowmajor(i32, (num_tokens, TOP_K)),
        rowmajor(i32, (num_tokens, TOP_K)),
        rowmajor(f32, (num_tokens, TOP_K)),
        rowmajor(bf16, (num_rows, INTERMEDIATE)),
        rowmajor(f32, (num_rows, HIDDEN)),
    )


def _compile(arch: str) -> Callable:
    args = (*fake_tensor_arguments(), 0, make_fake_stream(use_tvm_ffi_env_stream=True))
    return cute.compile(MoeFp8BlockScaleSm90(), *args, options=f"--enable-tvm-ffi --gpu-arch {arch}")


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
    _check_inputs(
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
    )
    num_tokens = routing_logits.shape[0]
    if num_tokens == 0:
        return
    device = routing_logits.device
    num_rows = TOP_K * num_tokens  # worst case: all 8 chosen experts are local
    counts = torch.empty(NUM_LOCAL_EXPERTS, dtype=torch.int32, device=device)  # zeroed by our kernel
    expert_tokens = torch.empty(NUM_LOCAL_EXPERTS, num_tokens, dtype=torch.int32, device=device)
    slot_expert = torch.empty(num_tokens, TOP_K, dtype=torch.int32, device=device)
    slot_rank = torch.empty(num_tokens, TOP_K, dtype=torch.int32, device=device)
    slot_weight = torch.empty(num_tokens, TOP_K, dtype=torch.float32, device=device)
    intermediate = torch.empty(num_rows, INTERMEDIATE, dtype=torch.bfloat16, device=device)
    expert_out = torch.empty(num_rows, HIDDEN, dtype=torch.float32, device=device)
    compiled_for()(
        routing_logits,
        routing_bias,
        hidden_states,
        hidden_states_scale,
        gemm1_weights,
        gemm1_weights_scale,
        gemm2_weights,
        gemm2_weights_scale,
        int(local_expert_offset),
        float(routed_scaling_factor),
        output,
        counts,
        expert_tokens,
        slot_expert,
        slot_rank,
        slot_weight,
        intermediate,
        expert_out,
        max_row_tiles(num_tokens),
    )
