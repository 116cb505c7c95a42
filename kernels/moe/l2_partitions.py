"""Which SMs share an L2 partition, measured on the device: one SM's load latencies to lines another SM brought into L2.

Why (NOTES.md): the H200's L2 is two partitions that replicate lines; a line that CTAs of both partitions
read crosses the fabric between them once more than one read in a single partition, and that fabric bounds GEMM1 at
901 tokens. No PTX register names an SM's partition, and which SMs share one may differ from chip to chip (which
TPCs are fused off; one H200 measured, so not known), so a walk that keeps readers of a line in one partition
(MEDIUM_T's GEMM1) needs the map measured once per device: `kernel.warm_up`, before the first call, never inside one.

The measurement (`measure_latencies`): our own fill kernel writes a buffer larger than the L2 (evicting it), thread 0
of the first CTA that lands on the reference SM loads a set of 128-B lines, then the same on the probed SM, which times
each load with `%clock64`; a line it finds in its own partition returns in L2-hit time (~300 cycles on an H200), one it
fetches across the fabric ~180 cycles later. `split_by_reference` groups the SMs whose slow lines agree with the
reference's. `kernels/moe/probes/l2_partition_probe.py` prints the map; `partition_ranks` orders the SMs partition by partition.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

__all__ = [
    "device_index",
    "measure_latencies",
    "measured_partition_ranks",
    "partition_ranks",
    "slow_threshold",
    "split_by_reference",
]

FLUSH_WORDS = (256 << 20) // 4  # over four times the H200's L2
BUFFER_WORDS = (64 << 20) // 4  # the probed lines' buffer
LINE_WORDS = 32  # 128-B lines
THREADS = 32
CTAS_PER_SM = 8  # launched CTAs per SM, so that every SM receives at least one
FILL_CTAS_PER_SM = 4
AGREEMENT = 0.75  # share of lines on which an SM's slow set must match the reference's to join its group
RANK_LINES = 64  # lines per measurement of `partition_ranks` (a split is clear at 64: 0 % against ~50 % slow)
GPU_ARCH = "sm_90a"


def line_stride_words(lines: int) -> int:
    """The word stride between `lines` distinct 128-B lines spread over the buffer (line i at i x stride): a stride
    that is not a power of two, so that the lines fall on many L2 slices."""
    return ((BUFFER_WORDS // LINE_WORDS) // lines - 1) * LINE_WORDS


def slow_threshold(latencies: Sequence[Sequence[int]]) -> float:
    """The cycle count between the fast and the slow loads: two-means on every measured latency (midpoint of the two
    centres)."""
    values = sorted(v for row in latencies for v in row)
    low, high = float(values[0]), float(values[-1])
    for _ in range(50):
        cut = (low + high) / 2
        fast = [v for v in values if v <= cut]
        slow = [v for v in values if v > cut]
        if not fast or not slow:
            break
        new_low, new_high = statistics.fmean(fast), statistics.fmean(slow)
        if (new_low, new_high) == (low, high):
            break
        low, high = new_low, new_high
    return (low + high) / 2


def split_by_reference(latencies: dict[int, Sequence[int]], reference: int) -> tuple[list[int], list[int]]:
    """(the SMs in the reference's group, the others): an SM joins when the lines it finds slow agree with the lines
    the reference finds slow on at least AGREEMENT of them."""
    cut = slow_threshold(list(latencies.values()))
    pattern = [v > cut for v in latencies[reference]]
    same, other = [], []
    for sm, row in sorted(latencies.items()):
        agree = sum((v > cut) == p for v, p in zip(row, pattern, strict=True)) / len(pattern)
        (same if agree >= AGREEMENT else other).append(sm)
    return same, other


def ranks_from_split(same: Sequence[int], other: Sequence[int], sms: int) -> list[int]:
    """rank[sm]: the reference's group first (0, 1, ... in SM order), then the others; the identity unless the two
    groups split all `sms` SMs into halves of at least a third each (anything else is not a partition map)."""
    if sorted([*same, *other]) != list(range(sms)) or min(len(same), len(other)) < sms // 3:
        return list(range(sms))
    ranks = [0] * sms
    for rank, sm in enumerate([*sorted(same), *sorted(other)]):
        ranks[sm] = rank
    return ranks


class _Fill:
    """Every thread stores `value` into words tid, tid + threads, ... of `words`: evicts the L2 with our own kernel."""

    @cute.jit
    def __call__(self, words: cute.Tensor, value: cutlass.Int32, ctas: cutlass.Int32, stream):
        self.kernel(words, value).launch(grid=[ctas, 1, 1], block=[128, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, words: cute.Tensor, value: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        for i in cutlass.range(cta * 128 + tidx, words.shape[0], ctas * 128, unroll=4):
            words[i] = value


class _LatencyProbe:
    """Thread 0 of the first CTA on SM `target` (the flag word's first adder) loads buffer[i x stride] for each line i
    in order and writes its latency in cycles to latencies[i]; the other CTAs return at once. The offsets are computed,
    not loaded, so that no other load's latency falls between the two clock reads."""

    @cute.jit
    def __call__(
        self,
        buffer: cute.Tensor,
        latencies: cute.Tensor,
        sink: cute.Tensor,
        flag: cute.Tensor,
        stride: cutlass.Int32,
        target: cutlass.Int32,
        ctas: cutlass.Int32,
        stream,
    ):
        self.kernel(buffer, latencies, sink, flag, stride, target).launch(
            grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        buffer: cute.Tensor,
        latencies: cute.Tensor,
        sink: cute.Tensor,
        flag: cute.Tensor,
        stride: cutlass.Int32,
        target: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0 and cute.arch.smid() == target:
            if cute.arch.atomic_add(flag.iterator.llvm_ptr, cutlass.Int32(1), scope="gpu") == 0:
                for i in cutlass.range(latencies.shape[0], unroll=1):
                    offset = i * stride
                    start = cute.arch.clock64()
                    value = buffer[offset]
                    sink[i] = value  # waits for the load, so the next clock read comes after it
                    latencies[i] = cutlass.Int32(cute.arch.clock64() - start)


_COMPILED: dict[str, Callable] = {}


def _words(shape):
    return make_fake_compact_tensor(cutlass.Int32, shape, assumed_align=16)


def compiled_kernels(arch: str = GPU_ARCH) -> tuple[Callable, Callable]:
    """(fill, probe) for `arch` as TVM-FFI functions (compiled once; needs no GPU): fill(int32 words, value, CTAs);
    probe(int32 buffer, int32 latencies [lines], int32 sink [lines], int32 flag[1], stride in words, target SM,
    CTAs)."""
    if arch not in _COMPILED:
        options = f"--enable-tvm-ffi --gpu-arch {arch}"
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        fill = cute.compile(_Fill(), _words((cute.sym_int(),)), 0, 0, stream, options=options)
        lines = cute.sym_int()
        probe = cute.compile(
            _LatencyProbe(), _words((cute.sym_int(),)), _words((lines,)), _words((lines,)), _words((1,)), 0, 0, 0,
            stream, options=options,
        )  # fmt: skip
        _COMPILED[arch] = (fill, probe)
    return _COMPILED[arch]


def measure_latencies(device: torch.device, reference: int, lines: int) -> tuple[dict[int, list[int]], set[int]]:
    """({SM: its load latencies in cycles to the lines the reference SM read first}, SMs that no CTA reached), one
    flush per SM; synchronises the device."""
    fill, probe = compiled_kernels()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    buffer = torch.empty(BUFFER_WORDS, dtype=torch.int32, device=device)
    flush = torch.empty(FLUSH_WORDS, dtype=torch.int32, device=device)
    sink = torch.empty(lines, dtype=torch.int32, device=device)
    fill(buffer, 1, FILL_CTAS_PER_SM * sms)
    stride = line_stride_words(lines)
    found: dict[int, list[int]] = {}
    missing: set[int] = set()
    for sm in range(sms):
        fill(flush, 0, FILL_CTAS_PER_SM * sms)
        rows = []
        for target in (reference, sm):
            latencies = torch.empty(lines, dtype=torch.int32, device=device)
            flag = torch.empty(1, dtype=torch.int32, device=device)
            fill(flag, 0, 1)
            probe(buffer, latencies, sink, flag, stride, target, CTAS_PER_SM * sms)
            rows.append((flag, latencies))
        torch.cuda.synchronize(device)
        if any(int(flag[0]) == 0 for flag, _ in rows):
            missing.add(sm)
        else:
            found[sm] = rows[1][1].tolist()
    return found, missing


_RANKS: dict[int, list[int]] = {}


def device_index(device: torch.device) -> int:
    """The index of a CUDA `device` (the current device for one given without an index)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def partition_ranks(device: torch.device) -> list[int]:
    """rank[sm] for the SMs of `device`: one L2 partition's SMs first, then the other's (`ranks_from_split` on a
    measurement against SM 0; the identity if it does not split the SMs in two). Measured once per device (132 L2
    flushes: tens of ms, estimated), then kept; it synchronises, so it refuses to run inside a CUDA-graph capture."""
    index = device_index(device)
    ranks = _RANKS.get(index)
    if ranks is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the L2 partition probe synchronises the device: measure it before a capture")
        sms = torch.cuda.get_device_properties(index).multi_processor_count
        latencies, missing = measure_latencies(torch.device("cuda", index), 0, RANK_LINES)
        same, other = split_by_reference(latencies, 0) if 0 in latencies else ([], [])
        ranks = _RANKS[index] = ranks_from_split(same, other, sms) if not missing else list(range(sms))
    return ranks


def measured_partition_ranks(device: torch.device) -> list[int] | None:
    """The ranks `partition_ranks` measured for `device`, or None before it did (nothing is measured here)."""
    return _RANKS.get(device_index(device))
