"""Build and compile one kernel side of ours before the jobs that time it.

The worker fork server (`hopperbench.worker_pool`) runs `prebuild_kernel_side(track, side)`
as a warm call, once per device: it builds the side exactly as a worker does
(`side.build(definition)`, through flashinfer-bench's `BuilderRegistry`, which caches the
Runnable per solution hash in the process) and then compiles its CuTe-DSL kernels with the
module's `compile_only()`. Every job forked afterwards inherits both, so its own
`side.build(definition)` returns the cached, compiled Runnable instead of importing and
compiling again. A job whose side hashes differently (a kernel file edited since the server
started) misses the cache and builds and compiles for itself, as without a prebuild.

Only our kernel and our candidates are prebuilt: they are the sides whose compile we own and
know to be deterministic and free of CUDA calls (given CUTE_DSL_ARCH, see `WORKER_ENV`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from hopperbench.sides import Side, SideContext, SideKind, sides_for
from hopperbench.tracks import Track, get_track

if TYPE_CHECKING:
    from flashinfer_bench.compile import Runnable

# What the runner names as the fork server's warm call (`hopperbench.worker_pool.WarmCall`).
PREBUILD_TARGET = "hopperbench.prebuild:prebuild_kernel_side"
PREBUILT_KINDS = (SideKind.OURS, SideKind.CANDIDATE)

# The architecture all our kernels compile for (each kernel's GPU_ARCH). Without CUTE_DSL_ARCH in
# the environment when cutlass is imported, CuTe-DSL detects the architecture on its first compile
# with cuInit, which would keep every compile out of the fork server (a process that called cuInit
# cannot fork CUDA-capable children). On an H200 the detected value is this one.
HOPPER_ARCH = "sm_90a"
WORKER_ENV = {"CUTE_DSL_ARCH": HOPPER_ARCH}

# torch.cuda.is_available() initialises the CUDA driver unless this is "1"; then it asks NVML.
_NVML_CUDA_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


class PrebuildError(ValueError):
    """The side cannot be prebuilt (unknown, not a kernel of ours, or unavailable); one line."""


def kernel_side(track: Track, side_name: str, ctx: SideContext | None = None) -> Side:
    """The available side `side_name` of `track`, resolved as the runner resolves it."""
    side = next((s for s in sides_for(track, ctx) if s.name == side_name), None)
    if side is None:
        raise PrebuildError(f"track {track.name} has no side {side_name!r}")
    if side.kind not in PREBUILT_KINDS:
        kinds = " and ".join(str(k) for k in PREBUILT_KINDS)
        raise PrebuildError(f"side {side_name} of {track.name} is a {side.kind} side; only {kinds} sides are prebuilt")
    if not side.available:
        raise PrebuildError(f"side {side_name} of {track.name} is unavailable: {side.reason}")
    return side


@contextlib.contextmanager
def _nvml_cuda_check() -> Iterator[None]:
    previous = os.environ.get(_NVML_CUDA_CHECK)
    os.environ[_NVML_CUDA_CHECK] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_NVML_CUDA_CHECK, None)
        else:
            os.environ[_NVML_CUDA_CHECK] = previous


def _builder_registry() -> Any:
    """flashinfer-bench's registry singleton, created without initialising the CUDA driver.

    On first use the registry asks each builder whether it can run here, and its torch builder
    asks torch.cuda.is_available(), which by default calls cuInit. NVML gives the same answer
    without it; the singleton made here is the one the jobs inherit and use.
    """
    from flashinfer_bench.compile import BuilderRegistry

    with _nvml_cuda_check():
        return BuilderRegistry.get_instance()


def prebuild(side: Side, definition: Any) -> Runnable:
    """Build `side` as the worker does and compile its kernels if its module has `compile_only()`."""
    _builder_registry()
    runnable = side.build(definition)
    module = sys.modules[runnable.metadata.misc["module_name"]]
    compile_only = getattr(module, "compile_only", None)
    if callable(compile_only):
        compile_only()  # its own default architecture, the one its run() compiles for
    return runnable


def prebuild_kernel_side(track: str, side: str) -> None:
    """The fork server's warm call: build and compile `side` (ours or a candidate) of `track`."""
    from hopperbench.definitions import load_definition

    resolved = get_track(track)
    prebuild(kernel_side(resolved, side), load_definition(resolved))
