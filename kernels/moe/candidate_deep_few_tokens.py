"""MoE candidate v2.3 ("deep few tokens"): `kernel.py` v2.1 with five pipeline stages instead of four in both
WGMMA GEMMs of its 33-64-token variant (FEW_TOKENS), and that variant up to 192 tokens instead of SMALL_T.

Why (NOTES.md, sessions 7, 9 and 10): at few tokens per expert the weight streams are bound by the bytes in
flight per SM, not by DRAM or by instructions (ncu, session 9: ~2.4 TB/s at 12 % occupancy). Four stages of
16 KB of weights per CTA, two CTAs per SM, is what v2.1 has there; five stages still fit two CTAs per SM
(GEMM1 16 x 5: 106 KB, GEMM2 8 x 5: 101 KB), i.e. 25 % more weight bytes in flight. v1.3 tried the same on
the `mma.sync` GEMM1 and lost (0.95x), because its 8-token tiles doubled the MMA and conversion work; here
the tiles stay and the WGMMA GEMMs do not convert weights in their issue chain (GEMM1) or overlap them
(GEMM2). And at 65-192 tokens v2.1 kept SMALL_T's `mma.sync` GEMM2 (16 x 3) because the WGMMA GEMM2 in
16 x 3 tiles was 0.93x at 80 tokens: three stages of weights where FEW_TOKENS' 8-token tiles keep four.

Two entries, one A/B:
- `run_few_to_192`: FEW_TOKENS (WGMMA GEMM2 8 x 4) at 65-192 tokens instead of SMALL_T; below 65 and
  above 192 `kernel.py`;
- `run_deep_few`: FEW_TOKENS with 5 stages in both GEMMs, at 33-192 tokens.
Prediction: `run_few_to_192` 0.98-1.04x at 80 tokens (the only official row at 65-192); `run_deep_few`
1.02-1.08x at 52-62 tokens and over `run_few_to_192` at 80, if the stages in flight bound the stream.
Outputs: the same kernels' arithmetic per token (depth and tiles do not change a product or a sum), so
equal to `kernel.py`'s bit for bit at 33-64 tokens (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["DEEP_FEW_TOKENS", "MoeShapeError", "VARIANTS", "compile_only", "run", "run_deep_few", "run_few_to_192"]

DEEP_FEW_TOKENS = dataclasses.replace(kernel.FEW_TOKENS, num_stages=5, gemm2_num_stages=5)
VARIANTS = (DEEP_FEW_TOKENS,)


def _replacing(replacements: dict[StreamingVariant, StreamingVariant]) -> Callable[[int], StreamingVariant]:
    """`kernel.py`'s choice of variant, with `replacements` of some of its variants."""

    def choose(num_tokens: int) -> StreamingVariant:
        chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
        return replacements.get(chosen, chosen)

    return choose


variant_for_few_to_192 = _replacing({kernel.SMALL_T: kernel.FEW_TOKENS})
variant_for_deep_few = _replacing({kernel.FEW_TOKENS: DEEP_FEW_TOKENS, kernel.SMALL_T: DEEP_FEW_TOKENS})


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the candidate's variant and `kernel.py`'s configurations for `arch` without a GPU."""
    return (*(kernel.compiled_for(variant, arch) for variant in VARIANTS), *kernel.compile_only(arch))


# `kernel.py`'s contract, with this candidate's variants.
run_few_to_192 = kernel.make_run(variant_for_few_to_192)
run_deep_few = kernel.make_run(variant_for_deep_few)
# The entry test_moe_kernel.py's end-to-end checks run: the new variant at 33-192 tokens.
run = run_deep_few
