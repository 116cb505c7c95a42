"""MoE candidate v2.22 (NOTES.md): candidate v2.21 (`candidate_early_w2.py`: `kernel.py` with the early W2 up to
EARLY_W2_MAX_TOKENS) without the release kernel. GEMM1's CTA 0 copies the call's final counts out (as the release
kernel did) when it builds its schedule; the combine reads them there and its CTA (0, 0) zeroes the kept counters
(and the kept count of routed tokens) after its programmatic wait, when GEMM2, their last reader, has completed. The
call is one launch shorter: three up to 1024 tokens, four above.

Why (NOTES.md, session 12's timeline): the release kernel ends ~0.5 us after the combine in every call, the
programmatic hand-over of a one-CTA grid. Outputs: the same arithmetic, bit for bit `kernel.py`'s (GPU tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import candidate_early_w2, kernel
from .kernel import MoeShapeError, StreamingVariant

__all__ = ["RELEASED", "MoeShapeError", "compile_only", "run", "variant_for"]


# The release-in-combine form of each variant candidate v2.21 can choose.
RELEASED = {
    variant: dataclasses.replace(variant, release_in_combine=True)
    for variant in (candidate_early_w2.TINY_T_EARLY_W2, *kernel.VARIANTS)
}


def variant_for(num_tokens: int) -> StreamingVariant:
    """Candidate v2.21's variant for `num_tokens`, with the counters released in the combine."""
    return RELEASED[candidate_early_w2.variant_for(num_tokens)]


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """This entry's configurations (and the counters' zeroing) for `arch` without a GPU."""
    compiled = tuple(kernel.compiled_for(variant, arch) for variant in RELEASED.values())
    return (*compiled, kernel.counters.compiled_zero(arch))


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
