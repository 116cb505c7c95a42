"""Whether the lines that `cp.async.bulk.prefetch.L2` brings in serve later loads from L2, and what the prefetches cost
when few or many SMs issue them.

    uv run tools/l2_prefetch_probe.py [--megabytes 6] [--chunk-kb 448] [--sms 1,2,8,132] [--repeats 30]

Why: MoE candidates v2.35 and v2.37 (kernels/moe/NOTES.md, session 26) prefetched expert weights into L2 with a few
large bulk prefetches and lost (0.962x and 0.977x at 7 tokens), v2.37 in a window where DRAM idles, as if the later
loads read none of the prefetched lines from L2. This separates the two questions on a plain buffer.

Each measurement first writes a 256-MB buffer (which evicts the H200's 60-MB L2), then times the reader (one
`torch.sum` over the probed buffer, a reduction whose loads go through L2) with CUDA events:

- cold: the reader alone;
- warm: the reader right after a first reader (the buffer in L2: the most a prefetch can give);
- settled: the prefetch from P CTAs (one per SM at most), a device synchronisation and 1 ms on the host, then the reader:
  equal to warm if prefetched lines serve later loads, equal to cold if they do not;
- in stream: the prefetch from P CTAs, then at once the reader, in stream order (the timed span starts once the
  prefetch kernel has issued its prefetches, which are then still in flight), against cold: what the prefetches add or
  save when loads follow them at once, as in v2.37.

Thread 0 of CTA c of the prefetch grid issues one bulk prefetch per chunk c, c + P, ... (`chunks_of_cta`). Medians of
`--repeats` measurements each. Exits 2 without CUDA, with one line on stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_prefetch

FLUSH_BYTES = 256 << 20  # over four times the H200's L2
THREADS = 32


def chunks_of_cta(cta: int, ctas: int, chunks: int) -> list[int]:
    """The chunks thread 0 of CTA `cta` of `ctas` prefetches: cta, cta + ctas, ... below `chunks`."""
    return list(range(cta, chunks, ctas))


class _Prefetcher:
    """Thread 0 of each CTA issues one `cp.async.bulk.prefetch.L2` of `chunk_bytes` per chunk of its share of the
    buffer (`chunks_of_cta`); the buffer's size is a multiple of the chunk."""

    def __init__(self, chunk_bytes: int):
        if chunk_bytes <= 0 or chunk_bytes % 16:
            raise ValueError(f"a bulk prefetch takes a positive multiple of 16 bytes, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes

    @cute.jit
    def __call__(self, buffer: cute.Tensor, ctas: cutlass.Int32, stream):
        self.kernel(buffer).launch(grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, buffer: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        if tidx == 0:
            for chunk in cutlass.range(cta, buffer.shape[0] // self.chunk_bytes, ctas, unroll=1):
                cp_async_bulk_prefetch(buffer.iterator + chunk * self.chunk_bytes, self.chunk_bytes)


def compiled_prefetcher(chunk_bytes: int) -> Callable:
    """The prefetch kernel for sm_90a as a TVM-FFI function (needs no GPU): (uint8 buffer, CTAs)."""
    buffer = make_fake_compact_tensor(cutlass.Uint8, (cute.sym_int(),), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(_Prefetcher(chunk_bytes), buffer, 0, stream, options="--enable-tvm-ffi --gpu-arch sm_90a")


def _sm_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--sms takes positive CTA counts separated by commas, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=6, help="the probed buffer (v2.37 prefetched ~6.3 MB)")
    parser.add_argument("--chunk-kb", type=int, default=448, help="bytes per bulk prefetch (v2.37: 448 KB at 7 tokens)")
    parser.add_argument("--sms", type=_sm_counts, default=[1, 2, 8, 132], help="prefetching CTAs, one per SM at most")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    chunk_bytes = args.chunk_kb << 10
    chunks = (args.megabytes << 20) // chunk_bytes
    if chunks < 1 or args.repeats < 1:
        print("l2_prefetch_probe: the buffer must hold one chunk and --repeats be >= 1", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("l2_prefetch_probe: needs a CUDA device", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if max(args.sms) > sms:
        print(f"l2_prefetch_probe: at most {sms} prefetching CTAs (one per SM), got {max(args.sms)}", file=sys.stderr)
        return 2
    prefetch = compiled_prefetcher(chunk_bytes)
    # Random bytes: a reader of zeros could be served by anything; the sum also keeps the reads from being dropped.
    buffer = torch.randint(0, 256, (chunks * chunk_bytes,), dtype=torch.uint8, device="cuda")
    words = buffer.view(torch.int32)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    expected = int(words.sum())

    def timed(before: Callable[[], None], settle: bool) -> float:
        """The reader's time in us, after the flush, `before` and, with `settle`, a synchronisation and 1 ms."""
        flush.fill_(1)
        before()
        if settle:
            torch.cuda.synchronize()
            time.sleep(1e-3)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        total = words.sum()
        end.record()
        torch.cuda.synchronize()
        if int(total) != expected:
            raise RuntimeError("the reader's sum changed: the probe is broken")
        return start.elapsed_time(end) * 1e3  # us

    def median(measure: Callable[[], float]) -> float:
        measure()  # the first call of each form pays for its own setup
        return statistics.median(measure() for _ in range(args.repeats))

    def nothing() -> None:
        pass

    def read() -> None:
        words.sum()

    cold = median(lambda: timed(nothing, settle=False))
    warm = median(lambda: timed(read, settle=False))
    print(f"buffer {chunks * chunk_bytes / 2**20:.2f} MB in {chunks} bulk prefetches of {args.chunk_kb} KB; "
          f"reader: cold {cold:.1f} us, warm (in L2) {warm:.1f} us; medians of {args.repeats}")  # fmt: skip
    print(f"{'CTAs':>5} {'settled us':>11} {'settled vs warm':>16} {'in stream us':>13} {'in stream vs cold':>18}")
    for ctas in args.sms:

        def issue(ctas: int = ctas) -> None:
            prefetch(buffer, ctas)

        settled = median(lambda: timed(issue, settle=True))
        in_stream = median(lambda: timed(issue, settle=False))
        print(f"{ctas:>5} {settled:>11.1f} {settled / warm:>16.2f} {in_stream:>13.1f} {in_stream / cold:>18.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
