"""The dispatch model behind the chunked GDN kernel's longest-first grid order: how long its grid
takes when its rows serve the sequences in list order, and when they serve the longest first.

    uv run kernels/gdn_prefill/probes/gdn_grid_order_model.py [--results results/h200/latest.csv] [--min-seqs 5]

Model: 132 SMs with two CTA slots each; CTAs start in grid order (row by row, the 32 CTAs of one
sequence together) as slots free up; a CTA's work is its sequence's chunk count plus a fixed 0.3
chunk (state in and out); it runs at rate 1 alone on its SM and at PAIR_RATE with a partner (two
CTAs per SM give 1.1-1.4x the throughput of one, measured on the H200). Each workload's inputs are the
synthesized ones of trials 0-2 (seed 0); a workload's model time is the median over its trials.
With --results, the model's time unit is fitted to ours' measured latencies (median ratio) and the
correlation between model and measurement is printed, so that the prediction states how well the
model follows the kernel it describes.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

# The H200 and chunked.py's launch (not imported: the model needs no CuTe-DSL).
NUM_SMS = 132
SLOTS_PER_SM = 2
CTAS_PER_SEQUENCE = 32  # 8 heads x 4 slices
CHUNK = 64
# Fitted, see the module doc.
PAIR_RATE = 0.62
FIXED_CHUNKS = 0.3


def makespan(works: Sequence[float], num_sms: int = NUM_SMS, slots: int = SLOTS_PER_SM, pair_rate: float = PAIR_RATE) -> float:
    """Finish time of CTAs with these works, started in order as slots free up (see the module doc)."""
    pending = list(reversed(works))  # pop() takes the next CTA in grid order
    running: list[list[float]] = [[] for _ in range(num_sms)]
    now = 0.0
    for _ in range(slots):  # the first wave fills the SMs breadth-first
        for sm in running:
            if pending:
                sm.append(pending.pop())
    while any(running):
        rates = [1.0 if len(sm) == 1 else pair_rate for sm in running]
        step = min(left / rate for sm, rate in zip(running, rates) for left in sm)
        now += step
        for sm, rate in zip(running, rates):
            sm[:] = [left - step * rate for left in sm if left - step * rate > 1e-9]
            while len(sm) < slots and pending:
                sm.append(pending.pop())
    return now


def grid_works(lengths: Sequence[int], longest_first: bool) -> list[float]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)) if longest_first else range(len(lengths))
    return [math.ceil(lengths[i] / CHUNK) + FIXED_CHUNKS for i in order for _ in range(CTAS_PER_SEQUENCE)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="a results CSV with ours' GDN latencies, to fit the time unit")
    parser.add_argument("--min-seqs", type=int, default=5,
                        help="model workloads with at least this many sequences (default 5: from there the 32-row grid has more CTAs than SMs and ranks them)")  # fmt: skip
    args = parser.parse_args(argv)

    from hopperbench.results import read_csv_rows
    from hopperbench.synth import make_inputs
    from hopperbench.workloads import synthesized_workloads

    measured: dict[str, float] = {}
    if args.results is not None:
        try:
            rows = read_csv_rows(args.results)
        except (OSError, ValueError, KeyError) as e:
            print(f"gdn_grid_order_model: cannot read {args.results}: {e}", file=sys.stderr)
            return 2
        # The workloads' own rows: a no-state twin shares its workload's uuid.
        measured = {r.uuid: r.sides["ours"].latency_ms * 1e3 for r in rows
                    if r.track == "gdn_prefill" and "state" not in (r.absent_inputs or ())
                    and "ours" in r.sides and r.sides["ours"].latency_ms}  # fmt: skip

    models = []
    for spec in synthesized_workloads("gdn_prefill").values():
        if spec.axes["num_seqs"] < args.min_seqs or spec.axes["total_seq_len"] <= CHUNK:
            continue
        times = {False: [], True: []}
        for trial in range(3):
            cu = make_inputs("gdn_prefill", spec, 0, trial, "cpu", only=["cu_seqlens"])["cu_seqlens"].tolist()
            lengths = [hi - lo for lo, hi in zip(cu[:-1], cu[1:])]
            for longest_first in times:
                times[longest_first].append(makespan(grid_works(lengths, longest_first)))
        models.append((spec, statistics.median(times[False]), statistics.median(times[True])))

    unit = statistics.median(measured[s.uuid] / ident for s, ident, _ in models if s.uuid in measured) if measured else 1.0
    print(f"{'T':>5} {'N':>3} {'list order':>10} {'longest first':>13} {'gain':>5} {'measured':>9}")
    for spec, ident, lpt in sorted(models, key=lambda m: (m[0].axes["total_seq_len"], m[0].axes["num_seqs"])):
        seen = f"{measured[spec.uuid]:9.0f}" if spec.uuid in measured else f"{'-':>9}"
        print(f"{spec.axes['total_seq_len']:>5} {spec.axes['num_seqs']:>3} {ident * unit:>10.1f} {lpt * unit:>13.1f} "
              f"{ident / lpt:>5.2f} {seen}")  # fmt: skip
    gains = [ident / lpt for _, ident, lpt in models]
    print(f"geomean gain {math.exp(statistics.mean(math.log(g) for g in gains)):.3f} over {len(gains)} workloads"
          + (" (time unit fitted: us)" if measured else " (time unit: one chunk step alone on an SM)"))
    pairs = [(ident, measured[s.uuid]) for s, ident, _ in models if s.uuid in measured]
    if len(pairs) >= 3:
        print(f"correlation of the list-order model with the measured latencies: {statistics.correlation(*zip(*pairs)):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
