"""GDN candidate v3.1 ("WGMMA chunks"): every sequence in one CTA per (sequence, v-head) stepping its 64-token
chunks on warpgroup MMA, the 128 x 128 state an fp32 register accumulator of two warpgroups
(`wgmma_chunked.py`; design v3 of NOTES.md, steps 1-4). Every T takes it (no token-serial path).

v3.0 (session 10) was correct on its first GPU run at a chunk step of ~12 us (v1.9: ~5.6). v3.1 copies the
next chunk's rows by cp.async while a chunk computes, scans G in a warp and computes the value side's decays
once per token; its prediction (~8-9 us per chunk) and bar are in NOTES.md. Still a prototype on the way to
`kernel.py` (a SIMT inverse, no overlap of one chunk's products with the next).
"""

from __future__ import annotations

from typing import Callable

from . import token_serial
from .token_serial import GPU_ARCH, GdnShapeError
from .wgmma_chunked import WgmmaChunked

__all__ = ["GdnShapeError", "compile_only", "run"]


def compile_only(arch: str = GPU_ARCH) -> Callable:
    """Compile the kernel for `arch` without touching a GPU (for CI and warm-up)."""
    return token_serial.compiled_for(arch, WgmmaChunked)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.py`'s contract: fills `output` [T,8,128] bf16 and `new_state` [N,8,128,128] fp32; `state`
    None means zeros; `scale` None or 0 means 1/sqrt(128). One launch on the current stream."""
    token_serial.run_kernel(WgmmaChunked, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
