"""Obviously-correct float64 formulations of the three definitions, for testing our references.

Written independently of the tracks' `reference.py` files: plain loops, one token (and one
head or expert) at a time, no vectorisation tricks. Slow; use small shapes.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def gdn_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor | None,
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule, token by token per sequence and v-head, state as [K, V] per head."""
    total, num_qk_heads, dim = q.shape
    num_v_heads = v.shape[1]
    num_seqs = len(cu_seqlens) - 1
    if not scale:
        scale = 1.0 / math.sqrt(dim)
    output = torch.zeros(total, num_v_heads, dim, dtype=F64)
    new_state = torch.zeros(num_seqs, num_v_heads, dim, dim, dtype=F64)
    for seq in range(num_seqs):
        start, end = int(cu_seqlens[seq]), int(cu_seqlens[seq + 1])
        if end == start:
            continue  # the contest definition leaves an empty sequence's state at zero
        for head in range(num_v_heads):
            qk_head = head * num_qk_heads // num_v_heads
            # Stored k-last as [V, K]; the recurrence is written on S[K, V].
            S = torch.zeros(dim, dim, dtype=F64) if state is None else state[seq, head].to(F64).T.clone()
            for t in range(start, end):
                x = float(a[t, head]) + float(dt_bias[head])
                softplus = max(x, 0.0) + math.log1p(math.exp(-abs(x)))
                g = math.exp(-math.exp(float(A_log[head])) * softplus)
                beta = 1.0 / (1.0 + math.exp(-float(b[t, head])))
                q_t = q[t, qk_head].to(F64)
                k_t = k[t, qk_head].to(F64)
                v_t = v[t, head].to(F64)
                S = g * S
                S = S + torch.outer(k_t, beta * (v_t - k_t @ S))
                output[t, head] = scale * (q_t @ S)
            new_state[seq, head] = S.T
    return output, new_state


def dsa_sparse_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    sparse_indices: torch.Tensor,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention over each token's gathered rows; lse in base 2."""
    num_tokens, num_heads, dim_ckv = q_nope.shape
    page_size = ckv_cache.shape[1]
    output = torch.zeros(num_tokens, num_heads, dim_ckv, dtype=F64)
    lse = torch.full((num_tokens, num_heads), -math.inf, dtype=F64)
    for t in range(num_tokens):
        rows = [int(i) for i in sparse_indices[t] if int(i) != -1]
        if not rows:
            continue
        keys_ckv = torch.stack([ckv_cache[r // page_size, r % page_size] for r in rows]).to(F64)
        keys_kpe = torch.stack([kpe_cache[r // page_size, r % page_size] for r in rows]).to(F64)
        for head in range(num_heads):
            logits = (keys_ckv @ q_nope[t, head].to(F64) + keys_kpe @ q_pe[t, head].to(F64)) * sm_scale
            exps = torch.exp(logits - logits.max())
            total = exps.sum()
            output[t, head] = (exps / total) @ keys_ckv
            lse[t, head] = (math.log(float(total)) + float(logits.max())) / math.log(2.0)
    return output, lse


def deepseek_route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    routed_scaling_factor: float,
    num_groups: int = 8,
    top_groups: int = 4,
    top_k: int = 8,
) -> dict[int, float]:
    """One token's no-aux routing: {global expert id: combination weight}."""
    scores = [1.0 / (1.0 + math.exp(-float(x))) for x in logits]
    biased = [s + float(bb) for s, bb in zip(scores, bias)]
    group_size = len(scores) // num_groups
    group_score = {}
    for group in range(num_groups):
        members = sorted(biased[group * group_size : (group + 1) * group_size], reverse=True)
        group_score[group] = members[0] + members[1]
    kept = sorted(group_score, key=lambda gr: group_score[gr], reverse=True)[:top_groups]
    candidates = [e for gr in kept for e in range(gr * group_size, (gr + 1) * group_size)]
    chosen = sorted(candidates, key=lambda e: biased[e], reverse=True)[:top_k]
    total = sum(scores[e] for e in chosen) + 1e-20
    return {e: scores[e] / total * routed_scaling_factor for e in chosen}


def _block_dequantize(values: torch.Tensor, scales: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """Element [r, c] times scales[r // block_rows, c // block_cols], in float64."""
    expanded = scales.to(F64).repeat_interleave(block_rows, dim=0).repeat_interleave(block_cols, dim=1)
    return values.to(F64) * expanded


def moe_fp8_block_scale(
    routing_logits: torch.Tensor,
    routing_bias: torch.Tensor,
    hidden_states: torch.Tensor,
    hidden_states_scale: torch.Tensor,
    gemm1_weights: torch.Tensor,
    gemm1_weights_scale: torch.Tensor,
    gemm2_weights: torch.Tensor,
    gemm2_weights_scale: torch.Tensor,
    local_expert_offset: int,
    routed_scaling_factor: float,
) -> torch.Tensor:
    """Per token, per routed expert: dequantise, GEMM1, SwiGLU, GEMM2, weighted sum."""
    num_tokens, hidden = hidden_states.shape
    num_local, gemm1_out, _ = gemm1_weights.shape
    intermediate = gemm1_out // 2
    # Scales are [hidden/128, T]: token t's 1x128 scales are column t.
    x_all = _block_dequantize(hidden_states, hidden_states_scale.T, 1, 128)
    output = torch.zeros(num_tokens, hidden, dtype=F64)
    for t in range(num_tokens):
        routes = deepseek_route(routing_logits[t], routing_bias, routed_scaling_factor)
        for expert, weight in routes.items():
            local = expert - local_expert_offset
            if not 0 <= local < num_local:
                continue
            w13 = _block_dequantize(gemm1_weights[local], gemm1_weights_scale[local], 128, 128)
            w2 = _block_dequantize(gemm2_weights[local], gemm2_weights_scale[local], 128, 128)
            projected = w13 @ x_all[t]
            up, gate = projected[:intermediate], projected[intermediate:]
            activated = gate / (1.0 + torch.exp(-gate)) * up
            output[t] += weight * (w2 @ activated)
    return output
