"""Reference for moe_fp8_block_scale_ds_routing_topk8_ng8_kg4_e32_h7168_i2048.

DeepSeek-V3 no-aux routing over 256 experts, then the 32 local experts
[local_expert_offset, local_expert_offset + 32) of this rank, all in fp32:

  routing  s = sigmoid(logits); selection uses s + bias: the 8 groups of 32 experts
           are scored by the sum of their top-2, the top-4 groups are kept, and the
           top-8 experts among them are chosen. Each chosen expert weighs
           s / (sum of the chosen s + 1e-20) * routed_scaling_factor (unbiased s).
  dequant  x = fp8 * scale with 1x128 blocks for activations (scales stored
           transposed, [hidden/128, T]) and 128x128 blocks for weights.
  expert   G = x W13^T; C = silu(G[:, I:]) * G[:, :I]; y = C W2^T.
  output   sum over the token's local chosen experts of weight * y, cast to bf16;
           a token with no local expert gets a zero row.

Only experts that received tokens are dequantised, one at a time, so peak memory
stays a few GB even at T = 14107.
"""

import torch
import torch.nn.functional as F

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


@torch.no_grad()
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
):
    t = routing_logits.shape[0]
    e, h, i = NUM_LOCAL_EXPERTS, HIDDEN_SIZE, INTERMEDIATE_SIZE
    _check_shape("routing_logits", routing_logits, (t, NUM_EXPERTS))
    _check_shape("hidden_states", hidden_states, (t, h))
    _check_shape("gemm1_weights", gemm1_weights, (e, 2 * i, h))
    _check_shape("gemm2_weights", gemm2_weights, (e, h, i))
    return _moe_forward(
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


def _moe_forward(
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
):
    """The computation for any hidden/intermediate sizes (multiples of 128) and local expert count.

    `run` pins the definition's sizes; the routing constants (256 experts, 8 groups,
    top-4 groups, top-8 experts) hold here too.
    """
    num_tokens, hidden = hidden_states.shape
    num_local, gemm1_out, _ = gemm1_weights.shape
    intermediate = gemm1_out // 2
    _check_shape("routing_logits", routing_logits, (num_tokens, NUM_EXPERTS))
    _check_shape("routing_bias", routing_bias, (NUM_EXPERTS,))
    _check_shape("hidden_states_scale", hidden_states_scale, (hidden // BLOCK, num_tokens))
    _check_shape("gemm1_weights", gemm1_weights, (num_local, 2 * intermediate, hidden))
    _check_shape("gemm1_weights_scale", gemm1_weights_scale, (num_local, gemm1_out // BLOCK, hidden // BLOCK))
    _check_shape("gemm2_weights", gemm2_weights, (num_local, hidden, intermediate))
    _check_shape("gemm2_weights_scale", gemm2_weights_scale, (num_local, hidden // BLOCK, intermediate // BLOCK))
    device = hidden_states.device

    experts, weights = _route(routing_logits, routing_bias, float(routed_scaling_factor))  # [T, 8] each

    # Group the (token, slot) pairs by local expert; slots of other ranks' experts go to bucket `num_local`.
    local = experts - int(local_expert_offset)
    local = torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, num_local)).flatten()
    pair_order = torch.argsort(local, stable=True)
    pair_tokens = pair_order // TOP_K
    pair_weights = weights.flatten()[pair_order]
    tokens_per_expert = torch.bincount(local, minlength=num_local + 1)[:num_local].tolist()  # the one host sync

    x = _dequantize_activations(hidden_states, hidden_states_scale)  # [T, H]
    output = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
    first = 0
    for expert, count in enumerate(tokens_per_expert):
        if count == 0:
            continue
        tokens = pair_tokens[first : first + count]
        token_weights = pair_weights[first : first + count]
        first += count

        w13 = _dequantize_weight(gemm1_weights[expert], gemm1_weights_scale[expert])  # [2I, H]
        projected = x[tokens] @ w13.T
        del w13
        up, gate = projected[:, :intermediate], projected[:, intermediate:]
        activated = F.silu(gate) * up
        w2 = _dequantize_weight(gemm2_weights[expert], gemm2_weights_scale[expert])  # [H, I]
        expert_out = activated @ w2.T
        del w2
        output.index_add_(0, tokens, expert_out * token_weights[:, None])
    return output.to(torch.bfloat16)


def _route(routing_logits, routing_bias, routed_scaling_factor):
    """DeepSeek-V3 no-aux top-k: (expert ids [T, 8], combination weights [T, 8])."""
    num_tokens = routing_logits.shape[0]
    scores = torch.sigmoid(routing_logits.float())
    biased = scores + routing_bias.float()[None, :]

    group_size = NUM_EXPERTS // NUM_GROUPS
    grouped = biased.view(num_tokens, NUM_GROUPS, group_size)
    group_scores = grouped.topk(TOP_IN_GROUP, dim=-1).values.sum(dim=-1)  # [T, 8]
    kept_groups = group_scores.topk(TOP_K_GROUPS, dim=-1).indices  # [T, 4]
    group_kept = torch.zeros(num_tokens, NUM_GROUPS, dtype=torch.bool, device=scores.device)
    group_kept.scatter_(1, kept_groups, True)
    expert_kept = group_kept.repeat_interleave(group_size, dim=1)  # [T, 256]

    candidates = biased.masked_fill(~expert_kept, float("-inf"))
    experts = candidates.topk(TOP_K, dim=-1).indices  # [T, 8]
    chosen = scores.gather(1, experts)
    weights = chosen / (chosen.sum(dim=-1, keepdim=True) + NORMALISATION_EPS) * routed_scaling_factor
    return experts, weights


def _dequantize_activations(values, scales_transposed):
    """fp8 [T, H] with per-token 1x128 scales stored as [H/128, T] -> fp32 [T, H]."""
    num_tokens, hidden = values.shape
    blocks = values.float().view(num_tokens, hidden // BLOCK, BLOCK)
    return (blocks * scales_transposed.float().T[:, :, None]).view(num_tokens, hidden)


def _dequantize_weight(values, scales):
    """fp8 [R, C] with 128x128 block scales [R/128, C/128] -> fp32 [R, C]."""
    rows, cols = values.shape
    blocks = values.float().view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    return (blocks * scales.float()[:, None, :, None]).view(rows, cols)


def _check_shape(name, tensor, expected):
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(tensor.shape)}")
