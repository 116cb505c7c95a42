"""The per-expert counters that `kernel.py`'s calls keep at zero between calls, one buffer per
(device, stream).

Why: a call that allocates its counters must zero them in its first launch. That launch is tiny
(0.6 us), so the host is still issuing the routing launch when it ends, and the gap (5-9 us measured
at 52-80 tokens) lands inside the call's span. A call (`host.MoeHostSm90`) starts
with the routing on a buffer that the previous call on the same stream left at zero, and its last
kernel (the combine, once GEMM2 has completed) zeroes it again.

Safety:
- Calls on one stream run in order, and the next call's first kernel is launched plainly (not as a
  programmatic dependent), so it starts only after the previous call's last kernel has zeroed the
  buffer.
- Streams never share a buffer.
- During a CUDA-graph capture no buffer is kept: the call gets a fresh one, zeroed by a launch
  that is captured with it. Replays then zero, use and re-zero that buffer. A buffer allocated from
  the capture's private pool must not outlive the graph's use of it.
- A new buffer is zeroed once by our own kernel (`routing.ZeroCountsKernel`), not by a PyTorch op.
"""

from __future__ import annotations

from typing import Callable

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from .chain import NO_CHAIN
from .routing import ZeroCountsKernel
from .shapes import NUM_LOCAL_EXPERTS
from .l2_partitions import device_index, measured_partition_ranks
from .streaming_gemm import RANKS_WRITTEN, WALK_SLOT_WORDS

__all__ = ["kept_counts", "kept_routed", "kept_walk_slots", "rank_kept_walk_buffers"]

_KEPT: dict[tuple[int, int, str], torch.Tensor] = {}
_ZERO: dict[tuple[str, int], Callable] = {}


class _ZeroCounts:
    """Host function of the one zeroing launch of a new buffer."""

    @cute.jit
    def __call__(self, counts: cute.Tensor, stream):
        ZeroCountsKernel(NO_CHAIN).launch(counts, stream)


def compiled_zero(arch: str, words: int = NUM_LOCAL_EXPERTS) -> Callable:
    """The zeroing launch of a new buffer of `words` int32 for `arch` (compiled once per size; needs no GPU)."""
    key = (arch, words)
    fn = _ZERO.get(key)
    if fn is None:
        counts = make_fake_compact_tensor(cutlass.Int32, (words,), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fn = _ZERO[key] = cute.compile(_ZeroCounts(), counts, stream, options=f"--enable-tvm-ffi --gpu-arch {arch}")
    return fn


def _zeroed(device: torch.device, arch: str, words: int = NUM_LOCAL_EXPERTS) -> torch.Tensor:
    counts = torch.empty(words, dtype=torch.int32, device=device)
    compiled_zero(arch, words)(counts)  # on the current stream, before the call that uses it
    return counts


def kept_counts(device: torch.device, arch: str) -> torch.Tensor:
    """The zeroed counter buffer of the current stream of `device` (a fresh one inside a capture)."""
    return _kept(device, arch, "counts")


def kept_routed(device: torch.device, arch: str) -> torch.Tensor:
    """The zeroed buffer whose first element counts the routed tokens when the routing runs inside GEMM1
    (`routing.route_then_meet`); kept and zeroed like the counts. Word `fused_gemms.ITEM_CLAIMS_WORD` is the
    claim counter of the fused GEMMs' GEMM2 phase, which that kernel itself leaves at zero."""
    return _kept(device, arch, "routed")


WALK_SLOTS = "walk_slots_ranked"


def kept_walk_slots(device: torch.device, arch: str) -> torch.Tensor:
    """The walk buffer of GEMM1's walk by partition rank (`wgmma_gemm1.Gemm1Feed.PRODUCER_WARP`): WALK_SLOT_WORDS
    per-SM slot counters (`streaming_gemm.take_walk_slot`), zeroed once when created and never again, since a call's
    draws give every slot once whatever a word holds; then word WALK_SLOT_WORDS + s holding SM s's rank in
    `l2_partitions.partition_ranks` and the last word RANKS_WRITTEN, copied from the host once the ranks are measured
    (`kernel.warm_up`): when the buffer is created, or by `rank_kept_walk_buffers`. Until then, and in a buffer made
    inside a capture, the last word stays zero and GEMM1 walks by `%smid`."""
    return _kept(device, arch, WALK_SLOTS, 2 * WALK_SLOT_WORDS, _write_measured_ranks)


def rank_kept_walk_buffers(device: torch.device) -> None:
    """Write the measured partition ranks into every kept walk buffer of `device` made before they were measured."""
    index = device_index(device)
    for (buffer_index, _, purpose), buffer in _KEPT.items():
        if buffer_index == index and purpose == WALK_SLOTS:
            _write_measured_ranks(buffer)


def _write_measured_ranks(buffer: torch.Tensor) -> None:
    write_ranks(buffer, measured_partition_ranks(buffer.device))


def write_ranks(buffer: torch.Tensor, ranks: list[int] | None) -> None:
    """Ranks and RANKS_WRITTEN into the walk buffer's second half (a host-to-device copy on the current stream); no
    ranks (not measured yet): nothing, so the buffer keeps walking by `%smid`."""
    if ranks is None:
        return
    words = torch.zeros(WALK_SLOT_WORDS, dtype=torch.int32)
    words[: len(ranks)] = torch.tensor(ranks, dtype=torch.int32)
    words[-1] = RANKS_WRITTEN
    buffer[WALK_SLOT_WORDS:].copy_(words)


def _kept(
    device: torch.device,
    arch: str,
    purpose: str,
    words: int = NUM_LOCAL_EXPERTS,
    initialise: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The kept buffer of `purpose` for the current stream of `device`, zeroed (then `initialise`d) when created; a
    fresh zeroed one inside a capture."""
    if torch.cuda.is_current_stream_capturing():
        return _zeroed(device, arch, words)
    index = device_index(device)
    key = (index, torch.cuda.current_stream(index).cuda_stream, purpose)
    buffer = _KEPT.get(key)
    if buffer is None:
        buffer = _zeroed(device, arch, words)
        if initialise is not None:
            initialise(buffer)
        _KEPT[key] = buffer
    return buffer
