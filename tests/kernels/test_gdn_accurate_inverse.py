"""kernels/gdn_prefill/accurate_inverse.py: the key side's fp32 inverse in chunks that barely decay, kept as hi / lo
fp16 pairs, and the WGMMA chain's pair products (`wgmma_value_side.py`).

CPU: a transcription of the kernel's thread loops (its packed A blocks, its three steps with their thread-to-entry
maps, the zeroed T) gives (I + A)^-1 to fp32 accuracy for A as the Gram epilogue makes it, repeated keys included,
and T_hi + T_lo carries it to ~2^-22; the fp32 views fit the storage they reuse; no chunk
of the check cases' mamba2 gates is slow, every chunk of their slow-decay gates is. GPU: kernel.py, the WGMMA chain and context parallel pass the long repeated-key
case with slow decay (test_gdn_prefill_kernel.py's long tests, HOPPERBENCH_LONG_TESTS=1), which the paths without
the pairs still fail.
"""

from __future__ import annotations

import torch

from hopperbench.devcheck import load_folder_module, load_module_by_path
from hopperbench.paths import REPO_ROOT

accurate_inverse = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "accurate_inverse")
cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
chunked_model = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/chunked_model.py", "gdn_chunked_model_for_cp")
BLOCK, CHUNK, HALF = accurate_inverse.BLOCK, accurate_inverse.CHUNK, accurate_inverse.HALF
THREADS = accurate_inverse.NUM_THREADS


def _gram_a(keys: torch.Tensor, log_g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """A = beta_i exp(G_i - G_j) k_i . k_j strictly below the diagonal, fp32, as the Gram epilogue computes it."""
    G = torch.cumsum(log_g, 0)
    decay = torch.exp(torch.clamp(G[:, None] - G[None, :], max=0.0))
    return torch.tril(beta[:, None] * decay * (keys @ keys.T), diagonal=-1).float()


def _packed(a: torch.Tensor) -> torch.Tensor:
    """The Gram epilogue's a32: strictly lower block (r, c) at r (r - 1) / 2 + c."""
    blocks = torch.zeros(accurate_inverse.OFF_DIAGONAL_BLOCKS, BLOCK, BLOCK)
    for r in range(1, CHUNK // BLOCK):
        for c in range(r):
            blocks[r * (r - 1) // 2 + c] = a[r * BLOCK : (r + 1) * BLOCK, c * BLOCK : (c + 1) * BLOCK]
    return blocks


def _kernel_inverse(a: torch.Tensor) -> torch.Tensor:
    """`AccurateInverse.accurate_inverse`'s T, thread loop by thread loop (fp32)."""
    a32, t32 = _packed(a), torch.zeros(CHUNK, CHUNK)
    x32 = torch.full((HALF, HALF), float("nan"))  # written before it is read
    for tidx in range(CHUNK):  # 1. diagonal blocks
        base, col = tidx // BLOCK * BLOCK, tidx % BLOCK
        column = torch.zeros(BLOCK)
        column[col] = 1.0
        for j in range(BLOCK):
            for r in range(j + 1, BLOCK):
                column[r] = column[r] - a[base + r, base + j] * column[j]
        t32[base : base + BLOCK, base + col] = column
    for step in ("x", "t"):  # 2. T_hl = -(T_hh A_hl) T_ll
        updates = []
        for tidx in range(THREADS):
            pair = tidx // (THREADS // 2)
            hi, lo = (2 * pair + 1) * BLOCK, 2 * pair * BLOCK
            row, col0 = (tidx % (THREADS // 2)) // 4, (tidx % 4) * 4
            for c in range(4):
                if step == "x":
                    value = sum(t32[hi + row, hi + m] * a32[5 * pair, m, col0 + c] for m in range(BLOCK))
                    updates.append((x32, pair * BLOCK + row, col0 + c, value))
                else:
                    value = sum(x32[pair * BLOCK + row, m] * t32[lo + m, lo + col0 + c] for m in range(BLOCK))
                    updates.append((t32, hi + row, lo + col0 + c, -value))
        for target, i, j, value in updates:  # the barrier: every read of a step before its writes land
            target[i, j] = value
    for step in ("x", "t"):  # 3. T[32:, :32] = -(T[32:, 32:] A[32:, :32]) T[:32, :32]
        updates = []
        for tidx in range(THREADS):
            row = tidx // 4
            for half in range(2):
                col0 = (tidx % 4) * 8 + 4 * half
                for c in range(4):
                    if step == "x":
                        value = sum(
                            t32[HALF + row, HALF + m] * a32[1 + 2 * (m // BLOCK) + col0 // BLOCK, m % BLOCK, (col0 + c) % BLOCK]
                            for m in range(HALF)
                        )
                        updates.append((x32, row, col0 + c, value))
                    else:
                        value = sum(x32[row, m] * t32[m, col0 + c] for m in range(HALF))
                        updates.append((t32, HALF + row, col0 + c, -value))
        for target, i, j, value in updates:
            target[i, j] = value
    return t32


def _inputs(repeated: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(CHUNK, 128, generator=generator)
    if repeated:  # one key over the chunk: A's entries all ~ beta, the case the pairs are for
        keys = keys[:1].expand(CHUNK, 128)
    keys = (keys / keys.norm(dim=1, keepdim=True)).half().float()  # the fp16 operand keys
    log_g = -torch.rand(CHUNK, generator=generator) * 1e-3  # exp(G_last) > 0.9: a slow chunk
    beta = torch.full((CHUNK,), 0.95) if repeated else torch.rand(CHUNK, generator=generator)
    return keys, log_g, beta


def test_the_transcribed_inverse_is_the_exact_inverse_to_fp32_accuracy():
    for repeated in (False, True):
        for seed in (0, 1):
            a = _gram_a(*_inputs(repeated, seed))
            exact = torch.linalg.inv(torch.eye(CHUNK, dtype=torch.float64) + a.double())
            t32 = _kernel_inverse(a)
            assert torch.equal(t32, torch.tril(t32))
            assert (t32.double() - exact).abs().max().item() <= 1e-5 * exact.abs().max().item()
            # the pair carries T to ~2^-22 relative; a single fp16 rounding leaves ~2^-11
            high = t32.half()
            low = (t32 - high.float()).half()
            assert (high.double() + low.double() - t32.double()).abs().max().item() <= 2**-22 * t32.abs().max().item()
            assert (high.double() - t32.double()).abs().max().item() > 2**-16 * t32.abs().max().item()


def test_a_chunk_is_slow_when_its_decay_exceeds_the_threshold():
    assert accurate_inverse.SLOW_CHUNK_DECAY == 0.9
    _, log_g, _ = _inputs(False, 0)
    assert torch.exp(log_g.sum()).item() > accurate_inverse.SLOW_CHUNK_DECAY  # the inputs above are a slow chunk
    # The check cases' gates: no 64-token chunk of the mamba2 gates is that slow (the official workloads' kind, which
    # so keep the fp16 path), every one of the slow-decay gates is.
    for regime, slow in (("mamba2", False), ("slow_decay", True)):
        case = cases.CheckCase(regime, (8192,), True, 0.0, regime)
        for seed in (0, 1):
            x = cases.make_inputs(case, "cpu", seed=seed)
            log_g, _ = chunked_model.gates(x["A_log"], x["a"], x["dt_bias"], x["b"])
            slow_chunks = torch.exp(log_g.view(-1, CHUNK, log_g.shape[-1]).sum(dim=1)) > accurate_inverse.SLOW_CHUNK_DECAY
            assert bool(slow_chunks.all()) if slow else not bool(slow_chunks.any())


def test_the_fp32_views_fit_the_storage_they_reuse():
    chunked = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "chunked")
    a16_bytes = CHUNK * chunked.NARROW_STRIDE * 2
    kq_bytes = chunked.KQ_ROWS * chunked.WIDE_STRIDE * 2
    a32_bytes = accurate_inverse.OFF_DIAGONAL_BLOCKS * BLOCK * accurate_inverse.PADDED * 4
    t32_x32_bytes = (CHUNK * accurate_inverse.T32_STRIDE + HALF * accurate_inverse.X32_STRIDE) * 4
    assert a32_bytes <= a16_bytes
    assert max(t32_x32_bytes, accurate_inverse.ZEROED_WORDS * 4) <= kq_bytes
    assert accurate_inverse.ZEROED_WORDS % THREADS == 0 and accurate_inverse.ZEROED_WORDS >= CHUNK * accurate_inverse.T32_STRIDE
