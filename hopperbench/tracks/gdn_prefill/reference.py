"""Reference for gdn_prefill_qk4_v8_d128_k_last: gated delta rule prefill over packed sequences.

Per v-head h (using q/k head h // 2) and per token of a sequence, in fp32, with the
state S kept in the stored k-last layout [V, K]:

    g    = exp(-exp(A_log) * softplus(a + dt_bias))
    beta = sigmoid(b)
    S    = g * S
    S    = S + (beta * (v - S k)) k^T      # = S_kv + k^T (beta (v - k S_kv)) in [K, V] terms
    o    = scale * S q

All sequences advance together: step i updates every sequence that has a token i,
so the cost is (longest sequence) steps of a few batched ops rather than a Python
loop per sequence and token. A missing state means zeros; a missing or zero scale
means 1/sqrt(128). As in the contest's definition, a zero-length sequence gets a
zero new_state. The input state is never modified.
"""

import math

import torch
import torch.nn.functional as F

NUM_QK_HEADS = 4
NUM_V_HEADS = 8
HEAD_SIZE = 128


@torch.no_grad()
def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale):
    total_seq_len = q.shape[0]
    num_seqs = cu_seqlens.shape[0] - 1
    _check_shape("q", q, (total_seq_len, NUM_QK_HEADS, HEAD_SIZE))
    _check_shape("k", k, (total_seq_len, NUM_QK_HEADS, HEAD_SIZE))
    _check_shape("v", v, (total_seq_len, NUM_V_HEADS, HEAD_SIZE))
    if state is not None:
        _check_shape("state", state, (num_seqs, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE))
    _check_shape("A_log", A_log, (NUM_V_HEADS,))
    _check_shape("a", a, (total_seq_len, NUM_V_HEADS))
    _check_shape("dt_bias", dt_bias, (NUM_V_HEADS,))
    _check_shape("b", b, (total_seq_len, NUM_V_HEADS))

    # One host read of the sequence bounds: the step count is the longest sequence.
    bounds = [int(x) for x in cu_seqlens.tolist()]
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    if any(n < 0 for n in lengths) or (bounds and (bounds[0] < 0 or bounds[-1] > total_seq_len)):
        raise ValueError(f"cu_seqlens must be non-decreasing within [0, {total_seq_len}], got {bounds}")

    device = q.device
    scale = 0.0 if scale is None else float(scale)
    if scale == 0.0:
        scale = 1.0 / math.sqrt(HEAD_SIZE)

    # Per-token operands, packed so each step needs a single gather: [T, 8, 3*128 + 2].
    # The scale is folded into q: scale * (S q) = S (scale * q).
    group = NUM_V_HEADS // NUM_QK_HEADS
    q_scaled = q.float().repeat_interleave(group, dim=1) * scale
    k_expanded = k.float().repeat_interleave(group, dim=1)
    gate = torch.exp(-torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float()))
    beta = torch.sigmoid(b.float())
    packed = torch.cat([q_scaled, k_expanded, v.float(), gate[..., None], beta[..., None]], dim=-1)

    # Longest sequence first, so the sequences still running at step i form a prefix.
    order = sorted(range(num_seqs), key=lambda n: -lengths[n])
    order_t = torch.tensor(order, dtype=torch.long, device=device)
    sorted_lengths = [lengths[n] for n in order]
    max_len = sorted_lengths[0] if num_seqs else 0
    active_at_step = []
    active = num_seqs
    for i in range(max_len):
        while sorted_lengths[active - 1] <= i:
            active -= 1
        active_at_step.append(active)
    starts = torch.tensor([bounds[n] for n in order], dtype=torch.long, device=device)
    token_at_step = starts[None, :] + torch.arange(max_len, dtype=torch.long, device=device)[:, None]

    if state is None:
        states = torch.zeros(num_seqs, NUM_V_HEADS, HEAD_SIZE, HEAD_SIZE, dtype=torch.float32, device=device)
    else:
        states = state.float().index_select(0, order_t)  # a copy: the input is left untouched
        # The contest definition leaves the state of an empty sequence at zero; they sort last.
        states[sum(1 for n in lengths if n > 0) :] = 0.0
    output = torch.zeros(total_seq_len, NUM_V_HEADS, HEAD_SIZE, dtype=torch.float32, device=device)

    d = HEAD_SIZE
    for i in range(max_len):
        active = active_at_step[i]
        tokens = token_at_step[i, :active]
        step = packed.index_select(0, tokens).reshape(active * NUM_V_HEADS, 3 * d + 2)
        q_i = step[:, 0:d, None]
        k_i = step[:, d : 2 * d, None]
        v_i = step[:, 2 * d : 3 * d, None]
        g_i = step[:, 3 * d, None, None]
        beta_i = step[:, 3 * d + 1, None, None]

        s = states[:active].view(active * NUM_V_HEADS, d, d)  # [V, K] per (sequence, head)
        s.mul_(g_i)
        delta = torch.baddbmm(v_i, s, k_i, alpha=-1.0).mul_(beta_i)  # beta * (v - S k): [V, 1]
        s.baddbmm_(delta, k_i.transpose(1, 2))  # S += delta k^T
        output[tokens] = torch.bmm(s, q_i).view(active, NUM_V_HEADS, d)

    new_state = torch.empty_like(states)
    new_state[order_t] = states
    return output.to(torch.bfloat16), new_state


def _check_shape(name, tensor, expected):
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(tensor.shape)}")
