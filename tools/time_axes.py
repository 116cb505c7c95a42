"""Time sides side by side on synthesized shapes off the workload list: one axis swept over values.

    uv run tools/time_axes.py --track moe --sides ours,cand_wide_gemm1_two_ctas --axis seq_len=1024,2048,4096
        [--template 4] [--trials 3] [--warmup 3] [--iterations 20] [--seed 0]

For each value of the axis: the template workload (an index of the track's workload list; its other axes
and its scalars are kept) with that value, synthesized as the runner synthesizes (`hopperbench.synth`,
one input set per trial), then per trial every side on the same inputs under the runner's CUPTI cold-L2
protocol (`hopperbench.timing.cupti_timer.record_cold_l2`) into NaN-poisoned outputs, and one row per
(value, trial): each side's median span and its ratio to the first side's (> 1: faster than the first).
The runner only takes listed workloads; this is how a dispatch threshold between two listed sizes is
chosen. It checks only that no output element is left NaN (the poison): correctness is the runner's and the
GPU tests' job. Exits 2 without CUDA or CUPTI, or on bad arguments, with one line on stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from hopperbench.workloads import WorkloadSpec


class SweepError(ValueError):
    """The sweep's arguments do not name a valid sweep."""


@dataclass(frozen=True)
class AxisSweep:
    name: str
    values: tuple[int, ...]


def parse_axis(text: str) -> AxisSweep:
    """`name=v1,v2,...` with positive integer values."""
    name, sep, rest = text.partition("=")
    if not sep or not name.strip():
        raise SweepError(f"--axis wants name=v1,v2,..., got {text!r}")
    try:
        values = tuple(int(v) for v in rest.split(",") if v.strip())
    except ValueError:
        raise SweepError(f"--axis values must be integers, got {rest!r}") from None
    if not values or min(values) < 1:
        raise SweepError(f"--axis wants positive values, got {rest!r}")
    return AxisSweep(name.strip(), values)


def off_list_workload(template: WorkloadSpec, axis: str, value: int) -> WorkloadSpec:
    """The template with one var axis set to `value`, as a synthesized workload of its own uuid (the
    synthesizer derives its seeds from the uuid, so each value gets its own inputs)."""
    if axis not in template.axes:
        raise SweepError(f"{template.track} workloads have no var axis {axis!r}; they have {sorted(template.axes)}")
    if template.data_source != "synthesized":
        raise SweepError("the template must be a synthesized workload (official blobs fix the shapes)")
    axes = dict(template.axes)
    axes[axis] = value
    return template.model_copy(update={"uuid": f"off-list:{axis}={value}", "axes": axes})


def ratio_row(value: int, trial: int, spans_ms: Sequence[float]) -> str:
    """One table row: the value, the trial, each side's span in us and its speedup over the first side."""
    first = spans_ms[0]
    cells = [f"{s * 1e3:10.1f} {first / s:6.3f}" for s in spans_ms]
    return f"{value:>8} {trial:>5} " + " ".join(cells)


def header(axis: str, sides: Sequence[str]) -> str:
    return f"{axis:>8} {'trial':>5} " + " ".join(f"{s[-17:]:>17}" for s in sides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--track", required=True, help="gdn_prefill, moe or dsa_attention")
    parser.add_argument("--sides", required=True, help="comma list; ratios are against the first")
    parser.add_argument("--axis", required=True, help="name=v1,v2,... (a var axis of the track's workloads)")
    parser.add_argument("--template", type=int, default=0, help="index of the workload whose other axes are kept")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    from hopperbench.definitions import load_definition
    from hopperbench.sides import run_start_up, sides_for
    from hopperbench.synth import make_inputs
    from hopperbench.timing.cupti_timer import TimerUnavailable, record_cold_l2
    from hopperbench.tracks import UnknownTrackError, get_track
    from hopperbench.worker import allocate_poisoned_outputs
    from hopperbench.workloads import load_workloads

    try:
        track = get_track(args.track)
        sweep = parse_axis(args.axis)
        workloads = load_workloads(track.name)
        if not 0 <= args.template < len(workloads):
            raise SweepError(f"{track.name} has {len(workloads)} workloads; --template {args.template} is out of range")
        specs = [off_list_workload(workloads[args.template], sweep.name, v) for v in sweep.values]
        if args.trials < 1 or args.iterations < 1 or args.warmup < 0:
            raise SweepError("need --trials >= 1, --iterations >= 1, --warmup >= 0")
        known = {s.name: s for s in sides_for(track)}
        names = [n for n in args.sides.split(",") if n]
        for name in names:
            if name not in known or not known[name].available:
                why = "unknown" if name not in known else known[name].reason
                raise SweepError(f"side {name!r} of {track.name} cannot run here: {why}")
        if any(not known[n].destination_passing_style for n in names):
            raise SweepError("every side must be destination-passing (the outputs are checked in place)")
    except (UnknownTrackError, SweepError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA device: the sweep times GPU work", file=sys.stderr)
        return 2

    definition = load_definition(track)
    functions = [known[n].build(definition) for n in names]
    for name, fn in zip(names, functions):
        run_start_up(known[name], fn, torch.device("cuda"))  # untimed, as the runner's worker runs it
    print(header(sweep.name, names), flush=True)
    for spec in specs:
        for trial in range(args.trials):
            inputs = list(make_inputs(track.name, spec, args.seed, trial, "cuda").values())
            spans = []
            for name, fn in zip(names, functions):
                outputs = allocate_poisoned_outputs(definition, spec.axes, torch.device("cuda"))
                try:
                    trace = record_cold_l2(fn, inputs + outputs, args.warmup, args.iterations)
                except TimerUnavailable as err:
                    print(f"error: {err}", file=sys.stderr)
                    return 2
                # NaN is the poison; an infinite value can be legitimate (DSA's lse of a row with no index).
                if any(bool(torch.isnan(o).any()) for o in outputs if o.dtype.is_floating_point):
                    print(f"error: {name} left NaN in its outputs at {sweep.name}={spec.axes[sweep.name]}", file=sys.stderr)
                    return 1
                spans.append(statistics.median(trace.spans()))
            print(ratio_row(spec.axes[sweep.name], trial, spans), flush=True)
            del inputs
    return 0


if __name__ == "__main__":
    sys.exit(main())
