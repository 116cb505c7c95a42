"""The definition's activation between the two expert GEMMs, shared by every GEMM1 epilogue of this
folder (`streaming_gemm.py`, `wgmma_gemm1.py`)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def swiglu_bf16(gate: cutlass.Float32, up: cutlass.Float32) -> cutlass.BFloat16:
    """silu(gate) * up in fp32 (exact exp: no fast-math), rounded once to bf16 (C is kept bf16)."""
    silu = gate / (cutlass.Float32(1.0) + cute.math.exp(-gate, fastmath=False))
    return (silu * up).to(cutlass.BFloat16)
