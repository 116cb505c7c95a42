"""Run each track's reference on its largest workload and report time and peak GPU memory.

Usage: uv run tools/profile_references.py [--track all] [--seed 0] [--repeats 2]

The reference is the correctness oracle for every run of the benchmark, so it has to fit
in GPU memory and finish in reasonable time on the largest official shape. This prints
one line per track: workload, wall time per call (synchronised host clock, after one
untimed call), peak allocated memory, and whether the outputs are free of NaN.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hopperbench.definitions import reference_runner
from hopperbench.synth import input_bytes, make_inputs
from hopperbench.tracks import UnknownTrackError, parse_track_list
from hopperbench.workloads import WorkloadSpec, load_workloads


def largest_workload(workloads: list[WorkloadSpec]) -> WorkloadSpec:
    return max(workloads, key=lambda w: (sum(w.axes.values()), w.index))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--track", default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        tracks = parse_track_list(args.track)
    except UnknownTrackError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA device: the references are profiled on the GPU", file=sys.stderr)
        return 2

    print(f"{'track':<14} {'uuid':<38} {'axes':<44} {'ms/call':>9} {'peak GiB':>9} no-NaN")
    for track in tracks:
        workload = largest_workload(load_workloads(track.name))
        reference = reference_runner(track)
        inputs = make_inputs(track.name, workload, seed=args.seed, trial=0, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        outputs = reference(*inputs.values())  # untimed: warms kernels and the allocator
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            outputs = reference(*inputs.values())
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        # -inf is legitimate (DSA lse of a row with no valid index); NaN never is.
        nan_free = not any(bool(torch.isnan(o.float()).any()) for o in outputs)
        axes = ",".join(f"{k}={v}" for k, v in workload.axes.items())
        print(
            f"{track.name:<14} {workload.uuid:<38} {axes:<44} {min(times):>9.1f} {peak_gib:>9.2f} {nan_free}"
            f"   (inputs {input_bytes(track.name, workload) / 2**30:.2f} GiB)"
        )
        del inputs, outputs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
