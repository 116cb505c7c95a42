"""Reference for dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64: sparse MLA over a paged cache.

Each token attends, with all 16 heads, to the cache rows named in its sparse_indices
row: flat row ids `page * 64 + offset` into the paged caches, -1 meaning padding
(any number of them, anywhere). In fp32:

    logits = (q_nope Kc^T + q_pe Kp^T) * sm_scale      # over the valid rows only
    output = softmax(logits) Kc                          # values are the 512-wide ckv rows
    lse    = logsumexp(logits) / ln 2                    # base 2

A token with no valid row gets output 0 and lse -inf. Tokens are processed in
chunks so the gathered fp32 rows stay bounded (~0.6 GB per chunk).
"""

import math

import torch

NUM_HEADS = 16
HEAD_DIM_CKV = 512
HEAD_DIM_KPE = 64
PAGE_SIZE = 64
TOPK = 2048
PADDING = -1
# 128 tokens x 2048 rows x 576 dims x 4 B = 0.6 GB of gathered fp32 keys per chunk.
TOKENS_PER_CHUNK = 128


@torch.no_grad()
def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale):
    num_tokens = q_nope.shape[0]
    num_pages = ckv_cache.shape[0]
    _check_shape("q_nope", q_nope, (num_tokens, NUM_HEADS, HEAD_DIM_CKV))
    _check_shape("q_pe", q_pe, (num_tokens, NUM_HEADS, HEAD_DIM_KPE))
    _check_shape("ckv_cache", ckv_cache, (num_pages, PAGE_SIZE, HEAD_DIM_CKV))
    _check_shape("kpe_cache", kpe_cache, (num_pages, PAGE_SIZE, HEAD_DIM_KPE))
    _check_shape("sparse_indices", sparse_indices, (num_tokens, TOPK))
    return _sparse_attention(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, TOKENS_PER_CHUNK)


def _sparse_attention(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, tokens_per_chunk):
    """The computation for any head count, widths and top-k; `run` pins the definition's sizes."""
    num_tokens, num_heads, dim_ckv = q_nope.shape
    device = q_nope.device
    ckv_rows = ckv_cache.reshape(-1, dim_ckv)
    kpe_rows = kpe_cache.reshape(-1, kpe_cache.shape[-1])
    sm_scale = float(sm_scale)

    output = torch.empty(num_tokens, num_heads, dim_ckv, dtype=torch.bfloat16, device=device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device)
    for start in range(0, num_tokens, tokens_per_chunk):
        stop = min(start + tokens_per_chunk, num_tokens)
        indices = sparse_indices[start:stop].long()
        valid = indices != PADDING
        rows = torch.where(valid, indices, torch.zeros_like(indices))  # padding reads row 0, masked below
        keys_ckv = ckv_rows[rows].float()  # [t, topk, 512]
        keys_kpe = kpe_rows[rows].float()  # [t, topk, 64]

        logits = torch.bmm(q_nope[start:stop].float(), keys_ckv.transpose(1, 2))
        logits += torch.bmm(q_pe[start:stop].float(), keys_kpe.transpose(1, 2))
        logits *= sm_scale
        logits.masked_fill_(~valid[:, None, :], -math.inf)  # [t, heads, topk]

        # A row without valid keys has max -inf; shift it by 0 instead so it yields exp(-inf) = 0.
        row_max = logits.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        weights = torch.exp(logits - row_max)
        total = weights.sum(dim=-1, keepdim=True)
        probs = weights / total.clamp_min(torch.finfo(torch.float32).tiny)  # all-zero rows stay 0

        output[start:stop] = torch.bmm(probs, keys_ckv).to(torch.bfloat16)
        lse[start:stop] = ((torch.log(total) + row_max) / math.log(2.0)).squeeze(-1)
    return output, lse


def _check_shape(name, tensor, expected):
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(tensor.shape)}")
