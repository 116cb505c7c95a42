"""Which SMs share an L2 partition: the latency of one SM's loads from lines another SM brought into L2.

    uv run kernels/moe/probes/l2_partition_probe.py [--lines 256] [--references 2] [--output map.json]

Why: ncu's breakdown of MoE GEMM1's L2 throughput at 901 tokens (kernels/moe/NOTES.md) tops out on
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
(SM ids as ranges), their latencies and whether the references agree; `--output` writes them as JSON. The
measurement and the split are `kernels/moe/l2_partitions.py`'s, which the MoE kernel runs on its first call at
193-1024 tokens.
Exits 2 without CUDA or on bad arguments, with one line on stderr; 1 if some SM could not be probed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence

from hopperbench.devcheck import load_folder_module
from hopperbench.paths import REPO_ROOT

partitions = load_folder_module(REPO_ROOT / "kernels" / "moe", "moe_solution", "l2_partitions")


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
    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    reference, report, missing = 0, [], set()
    for _ in range(args.references):
        latencies, unreached = partitions.measure_latencies(device, reference, args.lines)
        missing |= unreached
        if reference not in latencies:
            print(f"l2_partition_probe: no CTA landed on reference SM {reference}", file=sys.stderr)
            return 1
        same, other = partitions.split_by_reference(latencies, reference)
        cut = partitions.slow_threshold(list(latencies.values()))
        every = [v for row in latencies.values() for v in row]
        fast = [v for v in every if v <= cut]
        slow = [v for v in every if v > cut]

        def slow_share(group: list[int]) -> float | None:
            shares = [sum(v > cut for v in latencies[sm]) / args.lines for sm in group]
            return statistics.fmean(shares) if shares else None

        report.append(
            {
                "reference": reference,
                "same": same,
                "other": other,
                "threshold_cycles": round(cut, 1),
                "fast_median_cycles": statistics.median(fast) if fast else None,
                "slow_median_cycles": statistics.median(slow) if slow else None,
                "slow_share_same": slow_share(same),
                "slow_share_other": slow_share(other),
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
