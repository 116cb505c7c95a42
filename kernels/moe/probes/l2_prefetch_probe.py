"""Whether the lines that `cp.async.bulk.prefetch.L2` brings in serve later loads from L2, and what the prefetches cost
when few or many SMs issue them.

    uv run kernels/moe/probes/l2_prefetch_probe.py [--megabytes 6] [--chunk-kb 448] [--sms 1,2,8,132] [--repeats 30]

Why: two MoE candidates (kernels/moe/NOTES.md, ideas tried) prefetched expert weights into L2 with a few large bulk
prefetches and lost (0.962x and 0.977x at 7 tokens), the second in a window where DRAM idles, as if the later loads
read none of the prefetched lines from L2. This separates the two questions on a plain buffer.

Each measurement first writes a 256-MB buffer (which evicts the H200's 60-MB L2), then times the reader with CUDA
events. The reader reads the probed buffer as the MoE GEMMs read their weights: 16-byte `cp.async.cg` copies into
shared memory (L2 only), READER_COPIES per thread in flight, two CTAs per SM (`_Reader`). All steps run in stream order
without host waits, so the GPU never idles down its clocks between them (a host sleep between them would time the
reader at idle clocks):

- cold: a SPIN_US spin (one CTA reading `%globaltimer`), then the reader;
- warm: the reader, the spin, the reader again (the buffer in L2: the most a prefetch can give);
- settled: the prefetch from P CTAs (one per SM at most), the spin (time for every prefetch to land), the reader: equal
  to warm if prefetched lines serve later loads, equal to cold if they do not;
- in stream: the prefetch from P CTAs, then at once the reader (the timed span starts once the prefetch kernel has
  ended), against cold: what the prefetches add or save when loads follow them at once, as in the second candidate;
- issue: the prefetch kernel itself, after the spin: if it lasts about as long as its bytes take from DRAM, its threads
  (or its end) wait for the prefetches, which a GEMM CTA that prefetches and then loads would feel.

Thread 0 of CTA c of the prefetch grid issues one bulk prefetch per chunk c, c + P, ... (`chunks_of_cta`). Medians of
`--repeats` measurements each. Exits 2 without CUDA, with one line on stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_prefetch

FLUSH_BYTES = 256 << 20  # over four times the H200's L2
THREADS = 32
CHUNK = 16  # bytes per cp.async of the reader
READER_THREADS = 128
READER_COPIES = 8  # cp.async per reader thread in flight: 16 KB per CTA, ~4 MB over two CTAs per SM
SPIN_US = 50  # longer than any probed buffer takes to land from DRAM (48 MB at ~4 TB/s: ~12 us)


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


# The reader's shared memory: one 16-byte slot per copy in flight (built from a dict: this module's annotations are
# strings, which `cute.struct` does not take).
_ReaderStorage = cute.struct(
    type(
        "ReaderStorage",
        (),
        {
            "__annotations__": {
                "slots": cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, READER_THREADS * READER_COPIES * CHUNK], 128]
            }
        },
    )
)


class _Reader:
    """Thread t of CTA c copies 16-byte chunks c R + t + j 128 (j < READER_COPIES), then the same a grid's R further on
    (R = READER_THREADS x READER_COPIES), each into its own shared-memory slot, and waits for its copies after each
    round: a stream of L2-only loads with READER_COPIES per thread in flight."""

    @cute.jit
    def __call__(self, buffer: cute.Tensor, ctas: cutlass.Int32, stream):
        self.kernel(buffer).launch(
            grid=[ctas, 1, 1], block=[READER_THREADS, 1, 1], smem=_ReaderStorage.size_in_bytes(), stream=stream
        )

    @cute.kernel
    def kernel(self, buffer: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        storage = cutlass.memory.SmemAllocator().allocate(_ReaderStorage)
        slots = storage.slots.get_tensor(cute.make_layout(READER_THREADS * READER_COPIES * CHUNK))
        copy = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Uint8, num_bits_per_copy=CHUNK * 8
        )
        chunks = buffer.shape[0] // CHUNK
        per_cta = READER_THREADS * READER_COPIES
        for first in cutlass.range(cta * per_cta + tidx, chunks, ctas * per_cta, unroll=1):
            for j in cutlass.range_constexpr(READER_COPIES):
                chunk = first + j * READER_THREADS
                if chunk < chunks:
                    source = cute.make_tensor(
                        buffer.iterator + cute.assume(chunk * CHUNK, divby=CHUNK), cute.make_layout(CHUNK)
                    )
                    cute.copy(copy, source, cute.local_tile(slots, (CHUNK,), (j * READER_THREADS + tidx,)))
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)


class _Spin:
    """One CTA that reads `%globaltimer` until `nanoseconds` have passed, then writes the nanoseconds it spun into
    elapsed[0]: GPU time between two kernels, with no host wait."""

    @cute.jit
    def __call__(self, elapsed: cute.Tensor, nanoseconds: cutlass.Int32, stream):
        self.kernel(elapsed, nanoseconds).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, elapsed: cute.Tensor, nanoseconds: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        start = cute.arch.globaltimer()
        now = cute.arch.globaltimer()
        while now - start < cutlass.Int64(nanoseconds):
            now = cute.arch.globaltimer()
        if tidx == 0:
            elapsed[0] = cutlass.Int32(now - start)


def _compile(probe, *args) -> Callable:
    return cute.compile(
        probe, *args, make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi --gpu-arch sm_90a"
    )


def _fake_buffer():
    return make_fake_compact_tensor(cutlass.Uint8, (cute.sym_int(),), assumed_align=16)


def compiled_prefetcher(chunk_bytes: int) -> Callable:
    """The prefetch kernel for sm_90a as a TVM-FFI function (needs no GPU): (uint8 buffer, CTAs)."""
    return _compile(_Prefetcher(chunk_bytes), _fake_buffer(), 0)


def compiled_reader() -> Callable:
    """The reader for sm_90a as a TVM-FFI function (needs no GPU): (uint8 buffer, CTAs)."""
    return _compile(_Reader(), _fake_buffer(), 0)


def compiled_spin() -> Callable:
    """The spin for sm_90a as a TVM-FFI function (needs no GPU): (int32 elapsed[1], nanoseconds)."""
    return _compile(_Spin(), make_fake_compact_tensor(cutlass.Int32, (1,), assumed_align=4), 0)


def _sm_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--sms takes positive CTA counts separated by commas, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=6, help="the probed buffer (the candidate prefetched ~6.3 MB)")
    parser.add_argument("--chunk-kb", type=int, default=448, help="bytes per bulk prefetch (the candidate: 448 KB at 7 tokens)")
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
    prefetch, reader, spin = compiled_prefetcher(chunk_bytes), compiled_reader(), compiled_spin()
    buffer = torch.randint(0, 256, (chunks * chunk_bytes,), dtype=torch.uint8, device="cuda")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    spun = torch.zeros(1, dtype=torch.int32, device="cuda")

    def read() -> None:
        reader(buffer, 2 * sms)

    def pause() -> None:
        spin(spun, SPIN_US * 1000)

    def timed(*before: Callable[[], None], step: Callable[[], None] = read) -> float:
        """The time of `step` (the reader) in us after the flush and `before`, all in stream order."""
        flush.fill_(1)
        for earlier in before:
            earlier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3

    def median(*before: Callable[[], None], step: Callable[[], None] = read) -> float:
        timed(*before, step=step)  # the first call of each form pays for its own setup
        return statistics.median(timed(*before, step=step) for _ in range(args.repeats))

    cold = median(pause)
    if int(spun[0]) < SPIN_US * 1000:
        raise RuntimeError(f"the spin lasted {int(spun[0])} ns, under {SPIN_US} us: the probe is broken")
    warm = median(read, pause)
    size = chunks * chunk_bytes
    print(f"buffer {size / 2**20:.2f} MB in {chunks} bulk prefetches of {args.chunk_kb} KB; reader: cold {cold:.1f} us "
          f"({size / cold / 1e6:.2f} TB/s), warm (in L2) {warm:.1f} us ({size / warm / 1e6:.2f} TB/s); medians of "
          f"{args.repeats}")  # fmt: skip
    print(f"{'CTAs':>5} {'settled us':>11} {'settled vs warm':>16} {'in stream us':>13} {'in stream vs cold':>18} "
          f"{'issue us':>9}")  # fmt: skip
    for ctas in args.sms:

        def issue(ctas: int = ctas) -> None:
            prefetch(buffer, ctas)

        settled = median(issue, pause)
        in_stream = median(issue)
        issuing = median(pause, step=issue)
        print(
            f"{ctas:>5} {settled:>11.1f} {settled / warm:>16.2f} {in_stream:>13.1f} {in_stream / cold:>18.2f} "
            f"{issuing:>9.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
