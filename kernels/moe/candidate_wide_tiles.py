"""MoE candidate v2.2 ("wide tiles"): `kernel.py` v2.1 with 64-token row tiles above 192 tokens (MEDIUM_T),
where its 32-token tiles read an expert's weights once per 32 tokens.

Why (NOTES.md, "Where T = 901 goes after v2.1"): at T = 901 the synthesized routing gives 20-27 experts
~1000 assignments, up to ~180 to one, i.e. 43-55 row tiles of 32 tokens (CPU draws). Every work item reads its 64
weight rows and its row tile's tokens through L2: GEMM1 moves ~1.9 GB through L2 (~6.2 TB/s) for ~0.74
GB of unique weights, GEMM2 ~1.2 GB. If the L2 bounds them, halving the weight re-reads is the lever:
64-token tiles give 30-36 row tiles at 901 (GEMM1 ~1.43 GB, -25 %; GEMM2 ~0.96 GB, -20 %) and half the
row tiles at 11948 and 14107 tokens, where WGMMA's N = 64 also does twice the MMA work per weight byte.

Cost: shared memory. GEMM1 at 64 x 4 stages takes 146 KB and GEMM2 at 64 x 3 144 KB, so each runs one
CTA (one warpgroup) per SM where v2.1 runs two; v1.6 found the second CTA worth 1.29x for the
`mma.sync` GEMM2 at 901, but there it hid a chain of conversions, and the WGMMA GEMMs are asynchronous.

Three entries, one A/B:
- `run_wide_gemm1`: GEMM1 in 64-token tiles (4 stages), GEMM2 as v2.1 (32 x 3, two CTAs per SM);
- `run_wide`: both GEMMs in 64-token tiles (GEMM2 3 stages);
- `run_wide_gemm1_two_ctas`: GEMM1 in 64-token tiles with 3 stages and its epilogue tile in the token
  stage the item has just consumed (`WgmmaGemm1Config.scratch_in_stage`: ~98 KB, two CTAs per SM),
  GEMM2 as v2.1.
Prediction: at 901 GEMM1 309 -> ~235-270 us if the L2 bounds it (the call ~502 -> ~430-470 us), no gain
if one CTA per SM loses more than the traffic saves; at 11948 / 14107 tokens 1.2-1.5x (3.68 / 6.47 ms);
`run_wide`'s GEMM2 a further ~20-40 us at 901; `run_wide_gemm1_two_ctas` the fastest of the three
unless a third stage matters more than a second CTA. Outputs: the same products and promotions per token as
v2.1 (tiles only regroup tokens), so equal to `kernel.py`'s bit for bit (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = [
    "MEDIUM_T_WIDE",
    "MEDIUM_T_WIDE_GEMM1",
    "MEDIUM_T_WIDE_GEMM1_TWO_CTAS",
    "MoeShapeError",
    "VARIANTS",
    "compile_only",
    "run",
    "run_wide",
    "run_wide_gemm1",
    "run_wide_gemm1_two_ctas",
]

MEDIUM_T_WIDE_GEMM1 = dataclasses.replace(kernel.MEDIUM_T, block_tokens=64, num_stages=4)
MEDIUM_T_WIDE = dataclasses.replace(MEDIUM_T_WIDE_GEMM1, gemm2_block_tokens=64, gemm2_num_stages=3)
MEDIUM_T_WIDE_GEMM1_TWO_CTAS = dataclasses.replace(kernel.MEDIUM_T, block_tokens=64, num_stages=3, gemm1_scratch_in_stage=True)
VARIANTS = (MEDIUM_T_WIDE_GEMM1, MEDIUM_T_WIDE, MEDIUM_T_WIDE_GEMM1_TWO_CTAS)


def _replacing_medium_t(wide: StreamingVariant) -> Callable[[int], StreamingVariant]:
    """`kernel.py`'s choice of variant with `wide` in place of MEDIUM_T."""

    def choose(num_tokens: int) -> StreamingVariant:
        chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
        return wide if chosen is kernel.MEDIUM_T else chosen

    return choose


variant_for_wide_gemm1 = _replacing_medium_t(MEDIUM_T_WIDE_GEMM1)
variant_for_wide = _replacing_medium_t(MEDIUM_T_WIDE)
variant_for_wide_gemm1_two_ctas = _replacing_medium_t(MEDIUM_T_WIDE_GEMM1_TWO_CTAS)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the candidate's variants and `kernel.py`'s configurations for `arch` without a GPU."""
    return (*(kernel.compiled_for(variant, arch) for variant in VARIANTS), *kernel.compile_only(arch))


# `kernel.py`'s contract, with this candidate's variants.
run_wide_gemm1 = kernel.make_run(variant_for_wide_gemm1)
run_wide = kernel.make_run(variant_for_wide)
run_wide_gemm1_two_ctas = kernel.make_run(variant_for_wide_gemm1_two_ctas)
# The entry test_moe_kernel.py's end-to-end checks run: both wide GEMMs (`run_wide_gemm1`'s GEMM1 is the
# same kernel, its GEMM2 v2.1's).
run = run_wide
