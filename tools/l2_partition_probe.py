"""Which SMs share an L2 partition: the latency of one SM's loads from lines another SM brought into L2.

    uv run tools/l2_partition_probe.py [--lines 256] [--references 2] [--output map.json]

Why: ncu's breakdown of MoE GEMM1's L2 throughput at 901 tokens (kernels/moe/NOTES.md, session 31) tops out on
`lts__ltcfabric2ltc_cycles_active`, the fabric between the H200's two L2 partitions, not on the L2's tags or sectors.
A walk that keeps the CTAs reading the same lines on one partition's SMs would cross it less; no PTX register names
an SM's partition, so this measures it.

Each measurement writes a 256-MB buffer (which evicts the 60-MB L2), then thread 0 of the first CTA that lands on the
reference SM loads `--lines` lines of a 64-MB buffer (one 4-B load per 128-B line, spread over the buffer), then the
same on the probed SM, which times each load with `%clock64` (the load's value stored before the second clock read,
so the read waits for the load). A line the probed SM finds in its own partition returns in L2-hit time; one it
must fetch across the fabric, later. Every SM is probed against each of `--references` reference SMs (the first SM 0,
each next one an SM the previous reference's split put in the other group). `split_by_reference` puts an SM in the
reference's group when its slow lines agree with the reference's own pattern (none slow in a replicating L2; the
same lines slow in a home-partition L2) on at least three quarters of the lines. Prints the two groups per reference
(SM ids as ranges), their latencies and whether the references agree; `--output` writes them as JSON.
Exits 2 without CUDA or on bad arguments, with one line on stderr; 1 if some SM could not be probed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

FLUSH_BYTES = 256 << 20  # over four times the H200's L2
BUFFER_WORDS = (64 << 20) // 4  # the probed lines' buffer: 64 MB of int32
LINE_WORDS = 32  # 128-B lines
THREADS = 32
CTAS_PER_SM = 8  # launched CTAs per SM, so that every SM receives at least one
AGREEMENT = 0.75  # share of lines on which an SM's slow set must match the reference's to join its group


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


def as_ranges(sms: Sequence[int]) -> str:
    """`0-3,8,10-11`: sorted SM ids as ranges."""
    parts: list[str] = []
    ordered = sorted(sms)
    start = previous = ordered[0] if ordered else 0
    for sm in ordered[1:] + [None]:
        if sm is not None and sm == previous + 1:
            previous = sm
            continue
        parts.append(f"{start}" if start == previous else f"{start}-{previous}")
        if sm is not None:
            start = previous = sm
    return ",".join(parts) if ordered else ""


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


def compiled_probe() -> Callable:
    """The probe for sm_90a as a TVM-FFI function (needs no GPU): (int32 buffer, int32 latencies [lines], int32 sink
    [lines], int32 flag[1], stride in words, target SM, CTAs)."""

    def words(shape):
        return make_fake_compact_tensor(cutlass.Int32, shape, assumed_align=16)

    lines = cute.sym_int()
    return cute.compile(
        _LatencyProbe(),
        words((cute.sym_int(),)),
        words((lines,)),
        words((lines,)),
        words((1,)),
        0,
        0,
        0,
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi --gpu-arch sm_90a",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=256, help="probed 128-B lines per measurement")
    parser.add_argument(
        "--references", type=int, default=2, help="reference SMs, each from the previous one's other group"
    )
    parser.add_argument("--output", help="write the groups as JSON here")
    args = parser.parse_args(argv)
    if not 8 <= args.lines <= 4096 or args.references < 1:
        print("l2_partition_probe: --lines must be 8..4096 and --references >= 1", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("l2_partition_probe: needs a CUDA device", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    probe = compiled_probe()
    buffer = torch.arange(BUFFER_WORDS, dtype=torch.int32, device="cuda")
    stride = line_stride_words(args.lines)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    sink = torch.empty(args.lines, dtype=torch.int32, device="cuda")

    def measure(reference: int, sm: int) -> list[int] | None:
        """The probed SM's latencies to the lines after a flush and the reference SM's loads; None if no CTA landed
        on one of the two."""
        flush.fill_(1)
        rows = []
        for target in (reference, sm):
            latencies = torch.zeros(args.lines, dtype=torch.int32, device="cuda")
            flag = torch.zeros(1, dtype=torch.int32, device="cuda")
            probe(buffer, latencies, sink, flag, stride, target, CTAS_PER_SM * sms)
            rows.append((flag, latencies))
        torch.cuda.synchronize()
        if any(int(flag[0]) == 0 for flag, _ in rows):
            return None
        return rows[1][1].tolist()

    reference, report, missing = 0, [], set()
    for _ in range(args.references):
        latencies: dict[int, list[int]] = {}
        for sm in range(sms):
            row = measure(reference, sm)
            if row is None:
                missing.add(sm)
            else:
                latencies[sm] = row
        if reference not in latencies:
            print(f"l2_partition_probe: no CTA landed on reference SM {reference}", file=sys.stderr)
            return 1
        same, other = split_by_reference(latencies, reference)
        cut = slow_threshold(list(latencies.values()))
        every = [v for row in latencies.values() for v in row]
        fast = [v for v in every if v <= cut]
        slow = [v for v in every if v > cut]
        report.append(
            {
                "reference": reference,
                "same": same,
                "other": other,
                "threshold_cycles": round(cut, 1),
                "fast_median_cycles": statistics.median(fast) if fast else None,
                "slow_median_cycles": statistics.median(slow) if slow else None,
                "slow_share_same": statistics.fmean(sum(v > cut for v in latencies[sm]) / args.lines for sm in same),
                "slow_share_other": (
                    statistics.fmean(sum(v > cut for v in latencies[sm]) / args.lines for sm in other)
                    if other
                    else None
                ),
            }
        )
        print(
            f"reference SM {reference}: {len(same)} SMs with it [{as_ranges(same)}], {len(other)} apart "
            f"[{as_ranges(other)}]; fast loads {report[-1]['fast_median_cycles']} cycles, slow "
            f"{report[-1]['slow_median_cycles']} (threshold {cut:.0f}); slow share with it "
            f"{report[-1]['slow_share_same']:.2f}, apart {report[-1]['slow_share_other']}"
        )
        if not other:
            break
        reference = other[0]
    groups = [frozenset(entry["same"]) for entry in report]
    agree = all(g in (groups[0], frozenset(range(sms)) - groups[0] - missing) for g in groups)
    print(f"references agree: {agree}; SMs not probed: {sorted(missing) or 'none'}")
    if args.output:
        with open(args.output, "w") as out:
            json.dump({"sms": sms, "lines": args.lines, "references": report, "agree": agree}, out, indent=1)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
