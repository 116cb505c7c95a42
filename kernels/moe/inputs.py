"""The MoE definition's inputs as `kernel.py` accepts them: shapes, dtypes, layout and the largest T
(the packed workspaces use 32-bit offsets), checked on the host before anything is launched."""

from __future__ import annotations

import torch

from .shapes import (
    BLOCK,
    GEMM1_OUT,
    HIDDEN,
    HIDDEN_BLOCKS,
    INTERMEDIATE,
    INTERMEDIATE_BLOCKS,
    NUM_EXPERTS,
    NUM_LOCAL_EXPERTS,
    TOP_K,
)

__all__ = ["MAX_TOKENS", "MoeShapeError", "check_inputs"]

# The packed workspaces (8 T rows of 7168 fp32) are addressed with 32-bit element offsets.
MAX_TOKENS = 32768
assert TOP_K * MAX_TOKENS * HIDDEN < 2**31


class MoeShapeError(ValueError):
    """An input does not have the shape, dtype or layout of the definition."""


def check_inputs(
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
    """Raise MoeShapeError, naming the first tensor whose shape, dtype or layout is not the
    definition's for this T, or a T past MAX_TOKENS."""
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
