"""MoE candidate v2.0 ("WGMMA GEMM1"): `kernel.py` v1.4 with GEMM1 + SwiGLU of its 32-token variant
(T = 193-2048) on Hopper's FP8 warpgroup MMA (`wgmma_gemm1.py`) instead of `mma.sync` with
in-register e4m3 -> f16 conversions.

Why (session 8): at T = 901 `kernel.py`'s GEMM1 takes 553 us and is bound by instruction issue
(153 M warp instructions, one warp per scheduler, DRAM at 17 %). FP8 `mma.sync` is no way out on
sm_90a: ptxas turns it into the same conversions. Here a warpgroup issues 8 `QGMMA.64x32x32` per
256-wide K stage of a 64-row x 32-token item, plus the promotion's 32 FMAs per thread. The
`mma.sync` path needs ~2,000 instructions per warp for the same work.

Prediction: GEMM1 at T = 901 553 -> ~200-300 us (about 940 MB of W13, streamed once: ~310 us at
3 TB/s is the floor if all 32 experts are active), so T = 901 ~1.03 ms -> ~0.75-0.8 ms (~1.3x). The
other workloads are not on this variant. Outputs: the same products, exact in fp32 within a 128-K
block up to the tensor core's FP8 accumulation (promoted every 128 K, DeepGEMM's interval), so
within ~1e-5 relative of v1.4's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "VARIANTS", "WGMMA_MEDIUM_T", "compile_only", "run", "variant_for"]

# Four stages of (16 + 8) KB: ~105 KB of shared memory, two CTAs per SM.
WGMMA_MEDIUM_T = dataclasses.replace(kernel.MEDIUM_T, wgmma_gemm1=True)
VARIANTS = (WGMMA_MEDIUM_T,)


def variant_for(num_tokens: int) -> StreamingVariant | None:
    """`kernel.py`'s choice, with the WGMMA GEMM1 on its 32-token variant."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return WGMMA_MEDIUM_T if chosen == kernel.MEDIUM_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the candidate's variant and `kernel.py`'s others for `arch` without a GPU."""
    return (*(kernel.compiled_for(variant, arch) for variant in VARIANTS), *kernel.compile_only(arch))


# `kernel.py`'s contract, with this candidate's variants.
run = kernel.make_run(variant_for)
