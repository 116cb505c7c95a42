"""GDN candidate v3.3 ("WGMMA chunks"): every sequence in one CTA per (sequence, v-head) stepping its 64-token
chunks on warpgroup MMA, the 128 x 128 state an fp32 register accumulator of two warpgroups
(`wgmma_chunked.py`; design v3 of NOTES.md, steps 1-4). Every T takes it (no token-serial path).

Session 11: v3.0 was correct on its first GPU run at a chunk step of 12.2 us (v1.9: 5.6); v3.1 (the next
chunk's rows copied by cp.async, G by a warp scan, the value side's decays once per token) 11.8 us; v3.2 (the
inverse's doubling products in register tiles) 10.9 us. v3.3 (written after that lease, not yet run) zeroes T
once per CTA, writes its fp16 copy block by block and rounds A's off-diagonal blocks once. Still a prototype on
the way to `kernel.py`; NOTES.md has the profile and what comes next.
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
