"""The definition's activation between the two expert GEMMs, shared by every GEMM1 epilogue of this
folder (`streaming_gemm.py`, `wgmma_gemm1.py`, `grouped_wgmma.py`)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def swiglu_bf16(gate: cutlass.Float32, up: cutlass.Float32) -> cutlass.BFloat16:
    """silu(gate) * up in fp32 (exact exp: no fast-math), rounded once to bf16 (C is kept bf16)."""
    return silu_times_up(gate, up).to(cutlass.BFloat16)


@cute.jit
def silu_times_up(gate: cutlass.Float32, up: cutlass.Float32) -> cutlass.Float32:
    """silu(gate) * up in fp32 (exact exp), before its rounding to bf16."""
    return gate / (cutlass.Float32(1.0) + cute.math.exp(-gate, fastmath=False)) * up


@cute.jit
def swiglu_bf16x2(gate0: cutlass.Float32, up0: cutlass.Float32, gate1: cutlass.Float32, up1: cutlass.Float32):
    """Two adjacent columns' `swiglu_bf16` packed as one bf16x2 word (column 0 in the low half, as they lie in
    memory), rounded alike (`cvt.rn`), for one 4-byte store instead of two 2-byte ones."""
    low = silu_times_up(gate0, up0)
    high = silu_times_up(gate1, up1)
    return cute.arch.inline_ptx(
        "cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};",
        write_only_types=[cutlass.Int32],
        read_only_args=[high, low],
    )
