"""MoE candidate v1.1 ("deep stream"): `kernel.py` with more GEMM2 weight bytes in flight per SM for
T <= 192.

Why: at T = 1 (session 4 breakdown) GEMM1 streams its 59 MB at 2.65 TB/s and GEMM2 its 29 MB at
only 1.46 TB/s. Their configurations differ in what each SM keeps in flight: GEMM1 (16-token tiles,
4 stages, 108 KB of shared memory) runs two CTAs per SM, i.e. 8 stages of 16 KB of weights; GEMM2
stages its activations in bf16, so the same tiles and stages take 141 KB, one CTA per SM, 4 stages of
weights in flight: half of GEMM1's, and about half of its bandwidth. With few tokens per expert,
streaming is bound by bytes in flight over latency, so GEMM2 gets configurations that fit two CTAs
per SM:

- T <= 64 (tokens per active expert mostly <= 8 with the contest's routing): GEMM2 tiles of 8 tokens
  with 4 stages (103 KB: two CTAs, 8 weight stages in flight per SM, 2x today);
- 64 < T <= 192: GEMM2 tiles of 16 tokens with 3 stages (108 KB: two CTAs, 6 stages, 1.5x);
- GEMM1, and every T above 192, as `kernel.py`.

An expert with more tokens than a tile streams its weights once per row tile, so 8-token tiles cost
a second pass over an expert that gets 9-16 tokens. The kernels and the packed rows are `kernel.py`'s
(the tiles are only how the persistent CTAs split the work).

Prediction: GEMM2 at T = 1 from 20 us to ~11-13 us, so the whole call from 60 us to ~50 us
(~1.8 TB/s); at T = 7-80, where GEMM2 is about a third of the call, 8-15 % faster.
"""

from __future__ import annotations

from typing import Callable

from . import kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["FEW_TOKENS_MAX", "MoeShapeError", "choose_with", "compile_only", "run", "variant_for"]

FEW_TOKENS_MAX = 64
FEW_TOKENS = StreamingVariant(block_tokens=16, num_stages=4, gemm2_block_tokens=8, gemm2_num_stages=4)
SMALL_T = StreamingVariant(block_tokens=16, num_stages=4, gemm2_block_tokens=16, gemm2_num_stages=3)
VARIANTS = (FEW_TOKENS, SMALL_T)


def choose_with(few_tokens: StreamingVariant) -> Callable[[int], StreamingVariant | None]:
    """This candidate's choice of variant with `few_tokens` for T <= FEW_TOKENS_MAX (a later candidate
    deepens that one only)."""

    def variant_for(num_tokens: int) -> StreamingVariant | None:
        """The candidate's streaming variant for `num_tokens` tokens (None: the grouped pipeline)."""
        chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
        if chosen is kernel.SMALL_T:
            return few_tokens if num_tokens <= FEW_TOKENS_MAX else SMALL_T
        return chosen

    return variant_for


variant_for = choose_with(FEW_TOKENS)


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the candidate's two variants and `kernel.py`'s others for `arch` without a GPU."""
    return (*(kernel.compiled_for(variant, arch) for variant in VARIANTS), *kernel.compile_only(arch))


# `kernel.py`'s contract, with this candidate's variants.
run = kernel.make_run(variant_for)
