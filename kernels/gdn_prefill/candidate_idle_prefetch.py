"""GDN prefill candidate v1.3 ("idle-warp prefetch"): `chunked.py` (v1.2) with one change, the
copy of the next chunk's q rows in P2 is issued by warps 2 and 3 only.

Why: v1.2 moved that copy from P1 to P2 (the q half of kq is dead only after P1) and was 3-4 %
slower than v1 on the workloads with one CTA per SM (1-3 sequences; the A/B run of session 4,
kernels/gdn_prefill/NOTES.md). In P2 only threads 0-63 (warps 0 and 1) work, on the forward
substitution of the diagonal blocks, which is on the chunk's critical path; in v1.2 they first
issue 8 cp.async each. Warps 2 and 3 are idle in P2 and can issue all of them (16 each).
Prediction: v1's latency on the few-sequence workloads (the 3-4 % back), v1.2's on the others.
If it is not, the loss has another cause (the carveout's smaller L1, or the in-place conversion).

Same math, buffers, barriers and entry contract as `chunked.py`; only `prefetch_next_q` differs.
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute

from . import chunked
from .chunked import CHUNK, NUM_THREADS, GdnShapeError, resolve_scale

__all__ = ["GdnShapeError", "compile_only", "resolve_scale", "run"]

# The threads that issue the copy: warps 2 and 3, idle in P2 (the forward substitution runs on
# threads 0 .. CHUNK - 1).
PREFETCH_FIRST_THREAD = CHUNK
PREFETCH_THREADS = NUM_THREADS - CHUNK
assert PREFETCH_THREADS > 0 and CHUNK * chunked.PIECES_PER_ROW % PREFETCH_THREADS == 0


class _IdleWarpPrefetch(chunked._Chunked):
    @cute.jit
    def prefetch_next_q(
        self,
        g2s: cute.CopyAtom,
        q: cute.Tensor,
        kq_raw: cute.Tensor,
        start: cutlass.Int32,
        length: cutlass.Int32,
        chunk: cutlass.Int32,
        head: cutlass.Int32,
        tidx: cutlass.Int32,
    ):
        if tidx >= PREFETCH_FIRST_THREAD:
            self.load_q(g2s, q, kq_raw, start, length, chunk, head, tidx - PREFETCH_FIRST_THREAD, PREFETCH_THREADS)


def compile_only(arch: str = chunked.GPU_ARCH) -> Callable:
    """Compile the candidate for `arch` without touching a GPU (for CI and warm-up)."""
    return chunked.compiled_for(arch, _IdleWarpPrefetch)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`chunked.run`'s contract, with this candidate's kernel."""
    chunked.run_kernel(_IdleWarpPrefetch, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
