"""Where one side's time goes: every GPU activity of its call, under the runner's timing protocol.

    uv run tools/kernel_breakdown.py --track moe [--side ours] [--workloads 1,0,12] [--iterations 20]
        [--workload-list offlist]

For each chosen workload (indices of the track's workload list, or of its off-list workloads with
`--workload-list offlist`; default: the first): synthesized
inputs (seed, trial 0; through the side's untimed `prepare` where it has one, as the runner does), then the CUPTI cold-L2 protocol of hopperbench.timing (the same flush,
synchronisation and span rules as the runner), then one table: per activity of the call, in launch
order, when the host issued it (the start of its launching API call), when it started and ended on
the GPU (all three from the call's first GPU start; CUPTI puts host and GPU times on one clock), its
duration and the gap before it (from the previous activity's end: host time the span holds), each a
median over the iterations, and the median span. A multi-launch side shows which kernel or which
host gap dominates, and whether a kernel waited for its own launch (issued after the previous one
ended) or for the GPU; a single kernel shows whether the span is the kernel. Below it, the host's
CUDA runtime and driver calls inside the call (name, start on the same origin, duration): where
the host's time between two launches goes. No correctness check here: the runner does that.
Exits 2 without CUDA or CUPTI, or on bad arguments, with one line on stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hopperbench.timing.span import ApiRecord, GpuRecord, api_calls_in_windows

NS_PER_US = 1e3


class BreakdownError(ValueError):
    """The iterations cannot be lined up activity by activity."""


@dataclass(frozen=True)
class ActivityStat:
    """One activity (by position in the call) over the timed iterations."""

    position: int
    name: str
    median_us: float
    median_gap_before_us: float  # from the previous activity's end (0 for the first)
    median_start_us: float = 0.0  # GPU start, from the iteration's first GPU start
    median_end_us: float = 0.0  # GPU end, same origin
    median_issued_us: float | None = None  # host start of its launching API call, same origin; None: unknown


@dataclass(frozen=True)
class HostCallStat:
    """One host API call (by position inside the call) over the timed iterations."""

    position: int
    name: str
    median_start_us: float  # from the iteration's first GPU start, like ActivityStat's times
    median_us: float


@dataclass(frozen=True)
class Breakdown:
    activities: list[ActivityStat]
    median_span_us: float

    @property
    def median_busy_us(self) -> float:
        return sum(a.median_us for a in self.activities)


def issue_times(api_records: Sequence[ApiRecord]) -> dict[int, int]:
    """Correlation id -> host start (ns) of the earliest API call with that id (a runtime launch and the
    driver call inside it can share one), i.e. when the host began to issue that GPU work."""
    issued: dict[int, int] = {}
    for record in api_records:
        known = issued.get(record.correlation_id)
        if known is None or record.start < known:
            issued[record.correlation_id] = record.start
    return issued


def breakdown(per_iteration: Sequence[Sequence[GpuRecord]], issued: Mapping[int, int] | None = None) -> Breakdown:
    """Line up each iteration's activities by start order and take medians position by position.

    Every iteration must launch the same activities in the same order (the timer already refuses
    iterations whose sets differ; the order is checked here). `issued` (`issue_times`) adds when the
    host issued each activity; an activity whose launch is missing from it in any iteration gets None."""
    if not per_iteration:
        raise BreakdownError("no iterations")
    ordered = [sorted(records, key=lambda r: (r.start, r.end)) for records in per_iteration]
    names = [r.name for r in ordered[0]]
    for index, records in enumerate(ordered[1:], start=1):
        if [r.name for r in records] != names:
            raise BreakdownError(f"iteration {index} launched its activities in another order than iteration 0")
    activities = []
    for position, name in enumerate(names):
        durations = [(records[position].end - records[position].start) / NS_PER_US for records in ordered]
        gaps = [
            0.0 if position == 0 else max(0.0, (records[position].start - records[position - 1].end) / NS_PER_US)
            for records in ordered
        ]
        origins = [records[0].start for records in ordered]
        starts = [(records[position].start - origin) / NS_PER_US for records, origin in zip(ordered, origins)]
        ends = [(records[position].end - origin) / NS_PER_US for records, origin in zip(ordered, origins)]
        issue = None
        if issued is not None and all(records[position].correlation_id in issued for records in ordered):
            issue = statistics.median(
                (issued[records[position].correlation_id] - origin) / NS_PER_US
                for records, origin in zip(ordered, origins)
            )
        activities.append(
            ActivityStat(
                position,
                name,
                statistics.median(durations),
                statistics.median(gaps),
                statistics.median(starts),
                statistics.median(ends),
                issue,
            )
        )
    spans = [(max(r.end for r in records) - min(r.start for r in records)) / NS_PER_US for records in ordered]
    return Breakdown(activities, statistics.median(spans))


def host_calls(
    windows: Sequence[tuple[int, int]],
    api_records: Sequence[ApiRecord],
    origins: Sequence[int],
    name_of: Callable[[ApiRecord], str],
) -> list[HostCallStat] | None:
    """The API calls that started inside each iteration's window [t0, t1], lined up by start order,
    with median start (from that iteration's `origins` entry) and duration; None when the iterations
    did not make the same calls in the same order (then no position means the same call)."""
    if len(windows) != len(origins):
        raise BreakdownError(f"{len(windows)} windows but {len(origins)} origins")
    per_iteration = api_calls_in_windows(windows, api_records)
    if not per_iteration:
        return []
    signature = [(r.kind, r.callback_id) for r in per_iteration[0]]
    if any([(r.kind, r.callback_id) for r in calls] != signature for calls in per_iteration[1:]):
        return None
    stats = []
    for position in range(len(signature)):
        starts = [(calls[position].start - origin) / NS_PER_US for calls, origin in zip(per_iteration, origins)]
        durations = [(calls[position].end - calls[position].start) / NS_PER_US for calls in per_iteration]
        name = name_of(per_iteration[0][position])
        stats.append(HostCallStat(position, name, statistics.median(starts), statistics.median(durations)))
    return stats


def render_host_calls(calls: list[HostCallStat] | None, name_width: int = 40) -> str:
    if calls is None:
        return "  host API calls: not the same calls in every iteration"
    indent = " " * len("  host API calls: ")
    lines = [f"  host API calls: {'#':>2} {'name':<{name_width}} {'start':>7} {'median us':>10}"]
    for c in calls:
        name = c.name[:name_width]
        lines.append(f"{indent}{c.position:>2} {name:<{name_width}} {c.median_start_us:>7.1f} {c.median_us:>10.1f}")
    return "\n".join(lines)


def api_call_namer(cupti: Any) -> Callable[[ApiRecord], str]:
    """Names of CUPTI's runtime and driver callback ids (the number where the enum has none)."""
    tables = {
        int(cupti.ActivityKind.RUNTIME): cupti.runtime_api_trace_cbid,
        int(cupti.ActivityKind.DRIVER): cupti.driver_api_trace_cbid,
    }

    def name_of(record: ApiRecord) -> str:
        table = tables.get(record.kind)
        if table is not None:
            try:
                return table(record.callback_id).name
            except ValueError:  # an id the enum does not list
                pass
        return f"kind {record.kind}: {record.callback_id}"

    return name_of


def render(title: str, result: Breakdown, name_width: int = 60) -> str:
    lines = [
        title,
        f"  {'#':>2} {'activity':<{name_width}} {'issued':>7} {'start':>7} {'end':>7} {'median us':>10} {'gap before':>11}",
    ]
    for a in result.activities:
        name = a.name if len(a.name) <= name_width else a.name[: name_width - 3] + "..."
        issued = "-" if a.median_issued_us is None else f"{a.median_issued_us:.1f}"
        lines.append(
            f"  {a.position:>2} {name:<{name_width}} {issued:>7} {a.median_start_us:>7.1f} {a.median_end_us:>7.1f}"
            f" {a.median_us:>10.1f} {a.median_gap_before_us:>11.1f}"
        )
    gaps = result.median_span_us - result.median_busy_us
    lines.append(
        f"  span {result.median_span_us:.1f} us = activities {result.median_busy_us:.1f} us + gaps/overlap {gaps:.1f} us"
    )
    return "\n".join(lines)


def _parse_indices(text: str) -> list[int]:
    try:
        indices = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BreakdownError(f"--workloads wants comma-separated indices, got {text!r}") from None
    if not indices or min(indices) < 0:
        raise BreakdownError(f"--workloads wants indices >= 0, got {text!r}")
    return indices


def timed_arguments(
    inputs: Mapping[str, Any], prepare: Callable[..., Mapping[str, Any]] | None, outputs: Sequence[Any]
) -> list[Any]:
    """The arguments of the timed call, as the runner's worker builds them: the definition's inputs (through
    the side's untimed `prepare` where it has one: a library's own input layout), then the outputs."""
    prepared = prepare(*inputs.values()) if prepare is not None else inputs
    return [*prepared.values(), *outputs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--track", required=True, help="gdn_prefill, moe or dsa_attention")
    parser.add_argument("--side", default="ours", help="a side of the track (default ours)")
    parser.add_argument("--workloads", default="0", help="indices into the track's workload list")
    parser.add_argument(
        "--workload-list",
        choices=("listed", "offlist"),
        default="listed",
        help="the track's listed workloads, or its off-list ones (offlist.tsv)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    from hopperbench.definitions import load_definition
    from hopperbench.sides import run_start_up, sides_for
    from hopperbench.synth import make_inputs
    from hopperbench.timing.cupti_timer import TimerUnavailable, load_cupti, record_cold_l2
    from hopperbench.timing.span import iteration_gpu_records
    from hopperbench.tracks import UnknownTrackError, get_track
    from hopperbench.worker import allocate_poisoned_outputs, load_side_prepare
    from hopperbench.workloads import WorkloadError, load_offlist, load_workloads

    try:
        track = get_track(args.track)
        indices = _parse_indices(args.workloads)
    except (UnknownTrackError, BreakdownError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        workloads = load_offlist(track.name) if args.workload_list == "offlist" else load_workloads(track.name)
    except WorkloadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if max(indices) >= len(workloads):
        print(f"error: {track.name} has {len(workloads)} workloads; index {max(indices)} is out of range", file=sys.stderr)
        return 2
    sides = {s.name: s for s in sides_for(track)}
    side = sides.get(args.side)
    if side is None or not side.available:
        why = "unknown" if side is None else side.reason
        print(f"error: side {args.side!r} of {track.name} cannot run here: {why}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA device: the breakdown times GPU work", file=sys.stderr)
        return 2

    definition = load_definition(track)
    fn = side.build(definition)
    run_start_up(side, fn, torch.device("cuda"))  # untimed, as the runner's worker runs it
    prepare = load_side_prepare(side)  # a library side's untimed step, as the runner applies it
    for index in indices:
        workload = workloads[index]
        inputs = make_inputs(track.name, workload, args.seed, 0, "cuda")
        outputs = []
        if side.destination_passing_style:
            outputs = allocate_poisoned_outputs(definition, workload.axes, torch.device("cuda"))
        call_args = timed_arguments(inputs, prepare, outputs)
        try:
            trace = record_cold_l2(fn, call_args, args.warmup, args.iterations)
        except TimerUnavailable as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        per_iteration = iteration_gpu_records(trace.windows, trace.api_records, trace.gpu_records)
        result = breakdown(per_iteration, issue_times(trace.api_records))
        axes = " ".join(f"{k}={v}" for k, v in workload.axes.items())
        print(render(f"{track.name} #{index} ({axes}), side {side.name}:", result))
        origins = [min(r.start for r in records) for records in per_iteration]
        print(render_host_calls(host_calls(trace.windows, trace.api_records, origins, api_call_namer(load_cupti()))))
        del inputs, outputs, call_args, trace
    return 0


if __name__ == "__main__":
    sys.exit(main())
