"""MoE candidate v2.0 ("WGMMA GEMM1"): `kernel.py` v1.4 with GEMM1 + SwiGLU of every streaming
variant (T <= 2048) on Hopper's FP8 warpgroup MMA (`wgmma_gemm1.py`) instead of `mma.sync` with
in-register e4m3 -> f16 conversions. Items are twice as tall (64 weight rows), so a row tile has half
as many of them: at T <= 16, where one or a few experts are active, fewer CTAs stream.

Why (session 8): at T = 901 `kernel.py`'s GEMM1 takes 553 us and is bound by instruction issue
(153 M warp instructions, one warp per scheduler, DRAM at 17 %). FP8 `mma.sync` is no way out on
sm_90a: ptxas turns it into the same conversions. Here a warpgroup issues 8 `QGMMA.64x32x32` per
256-wide K stage of a 64-row x 32-token item, plus the promotion's 32 FMAs per thread. The
`mma.sync` path needs ~2,000 instructions per warp for the same work.

Prediction: GEMM1 at T = 901 553 -> ~200-300 us (about 940 MB of W13, streamed once: ~310 us at
3 TB/s is the floor if all 32 experts are active), so T = 901 ~1.03 ms -> ~0.75-0.8 ms (~1.3x).
At 52-192 tokens (GEMM1 memory-bound at ~2.9 TB/s) ~1.00-1.03x; at T <= 16 slower (half the
streaming CTAs for one or two experts). The A/B places the range where it wins. Outputs: the same
products up to the tensor core's FP8 accumulation inside a 128-K block (promoted every 128 K,
DeepGEMM's interval).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["MoeShapeError", "VARIANTS", "compile_only", "run", "variant_for"]

# Four stages of (16 + 8 or 4) KB: ~85-105 KB of shared memory, two CTAs per SM.
VARIANTS = tuple(dataclasses.replace(variant, wgmma_gemm1=True) for variant in kernel.VARIANTS)


def variant_for(num_tokens: int) -> StreamingVariant | None:
    """`kernel.py`'s choice, with the WGMMA GEMM1 (None: the grouped pipeline, unchanged)."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return None if chosen is None else dataclasses.replace(chosen, wgmma_gemm1=True)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the candidate's variant and `kernel.py`'s others for `arch` without a GPU."""
    return (*(kernel.compiled_for(variant, arch) for variant in VARIANTS), *kernel.compile_only(arch))


# `kernel.py`'s contract, with this candidate's variants.
run = kernel.make_run(variant_for)
