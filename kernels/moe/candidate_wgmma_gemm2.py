"""MoE candidate v2.1 ("WGMMA GEMM2"): `kernel.py` v1.6 with GEMM2 of its MEDIUM_T variant (193-2048
tokens) on bf16 warpgroup MMA with the e4m3 weights converted in registers (`wgmma_gemm2.py`), in
32-token row tiles with 3 stages (96 KB, two CTAs per SM), and GEMM1 writing C in the column order that
GEMM2 reads (`intermediate_order.py`). Three entries: `run` converts, multiplies and promotes each
128-K block in turn (the SM's other CTA fills the gaps); `run_overlapped` converts a stage's second block
while the first one's MMAs run and promotes the first while the second's run (two register sets);
`run_overlapped_from_33` also moves GEMM2 of the 33-192-token variants (FEW_TOKENS, SMALL_T, whose
GEMM1 is already on WGMMA) to the overlapped WGMMA GEMM2, with their own token tiles and stages, and
streams every T above 2048 as MEDIUM_T_OVERLAPPED instead of taking v0's grouped pipeline (beside
candidate v1.8, which streams them with `kernel.py`'s MEDIUM_T).

Why (session 9, NOTES.md "Design v2.1"): at T = 901 GEMM1 streams W13 at ~3.06 TB/s, GEMM2 W2 at
~1.5 TB/s: ~300 of the 611 us. Its `mma.sync` warps spend 80 % of their instructions on conversions in
one dependent chain, and each W2 is converted once per 16-token row tile.

Prediction: GEMM2 at T = 901 ~300 -> ~150-250 us, T = 901 ~611 -> ~460-560 us (1.1-1.3x), the
overlapped entry at the faster end if the conversions bound the plain one; other workloads unchanged
(kernel.py's variants). At 33-192 tokens GEMM2 streams one or a few tokens per expert and is bound by
the bytes in flight, not by instructions: `run_overlapped_from_33` ~1.00-1.02x there (64-row items
halve the CTAs per expert's W2 but each moves twice the bytes per stage). Outputs: the same products and the same per-128-K
promotion, summed in another order inside a block (the tensor core's), so equal to kernel.py's up to
fp32 rounding (the GPU tests bound the difference against the reference).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = [
    "FEW_TOKENS_OVERLAPPED",
    "MEDIUM_T",
    "MEDIUM_T_OVERLAPPED",
    "MoeShapeError",
    "SMALL_T_OVERLAPPED",
    "VARIANTS",
    "compile_only",
    "run",
    "run_overlapped",
    "run_overlapped_from_33",
    "variant_for",
    "variant_for_overlapped",
    "variant_for_overlapped_from_33",
]

MEDIUM_T = dataclasses.replace(kernel.MEDIUM_T, gemm2_block_tokens=32, gemm2_num_stages=3, wgmma_gemm2=True)
MEDIUM_T_OVERLAPPED = dataclasses.replace(MEDIUM_T, gemm2_overlapped=True)
FEW_TOKENS_OVERLAPPED = dataclasses.replace(kernel.FEW_TOKENS, wgmma_gemm2=True, gemm2_overlapped=True)
SMALL_T_OVERLAPPED = dataclasses.replace(kernel.SMALL_T, wgmma_gemm2=True, gemm2_overlapped=True)


def _chooser(replacements: dict[StreamingVariant, StreamingVariant]) -> Callable[[int], StreamingVariant | None]:
    """`kernel.py`'s choice of variant, with `replacements` of some of its variants."""

    def choose(num_tokens: int) -> StreamingVariant | None:
        chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
        return replacements.get(chosen, chosen)

    return choose


variant_for = _chooser({kernel.MEDIUM_T: MEDIUM_T})
variant_for_overlapped = _chooser({kernel.MEDIUM_T: MEDIUM_T_OVERLAPPED})
variant_for_overlapped_from_33 = _chooser(
    {
        kernel.FEW_TOKENS: FEW_TOKENS_OVERLAPPED,
        kernel.SMALL_T: SMALL_T_OVERLAPPED,
        kernel.MEDIUM_T: MEDIUM_T_OVERLAPPED,
        None: MEDIUM_T_OVERLAPPED,  # above 2048 tokens too, instead of v0's grouped pipeline
    }
)
VARIANTS = (MEDIUM_T, MEDIUM_T_OVERLAPPED, FEW_TOKENS_OVERLAPPED, SMALL_T_OVERLAPPED)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the candidate's variants and `kernel.py`'s configurations for `arch` without a GPU."""
    return (*(kernel.compiled_for(variant, arch) for variant in VARIANTS), *kernel.compile_only(arch))


# `kernel.py`'s contract, with this candidate's variants.
run = kernel.make_run(variant_for)
run_overlapped = kernel.make_run(variant_for_overlapped)
run_overlapped_from_33 = kernel.make_run(variant_for_overlapped_from_33)
