"""DSA sparse attention candidate v1.2 ("programmatic launch"): `kernel.py` with the combine kernel
launched as a programmatic dependent of the split kernel (Hopper's PDL).

Why: the session-4 breakdown has a 1.0 us gap between the split and the combine kernel at every T,
and the combine kernel's own launch and ramp in front of its first load. With PDL the split kernel
triggers its dependents as it starts (`griddepcontrol.launch_dependents`), so the combine grid is
launched while the split kernel runs; its CTAs sit in `griddepcontrol.wait`, which returns once
every split CTA has finished and its workspace writes are visible. Correctness does not depend on
where the trigger is: the wait covers the whole primary grid. The combine's CTAs are small (128
threads, no shared memory), so they fit beside the split kernel's one CTA per SM.

Prediction: ~1-1.5 us off every call: T = 1 from ~9.5 to ~8.2 us, T = 6-8 from ~14.5 to ~13.3 us;
latency / floor from ~4.1 to ~3.7.
"""

from __future__ import annotations

from typing import Callable

from . import kernel
from .kernel import DsaShapeError

__all__ = ["DsaShapeError", "compile_only", "run"]


class _TriggeringSplit(kernel._SplitKernel):
    PROGRAMMATIC = True


class _DependentCombine(kernel._CombineKernel):
    PROGRAMMATIC = True


def compile_only(arch: str = kernel.GPU_ARCH) -> Callable:
    """Compile the candidate for `arch` without touching a GPU (for CI and warm-up)."""
    return kernel.compiled_for(arch, _DependentCombine, _TriggeringSplit)


def run(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse) -> None:
    """`kernel.run`'s contract, with the combine launched as a programmatic dependent."""
    kernel.run_with_splits(
        q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale, output, lse, None,
        combine=_DependentCombine, split=_TriggeringSplit,
    )  # fmt: skip
