"""Device check of our GDN prefill kernel (kernels/gdn_prefill/kernel.py) on a GPU.

Compiles the kernel, then for every case in kernels/gdn_prefill/check_cases.py: fresh inputs,
NaN-poisoned outputs, one call, comparison with our reference (hopperbench/references/gdn_prefill.py,
atol = rtol = 1e-2 on every element of output and new_state, no NaN), a check that the input state
is unchanged, and a median time per call from CUDA events (warm L2; the benchmark runner does the
real timing). Then a CUDA-graph capture/replay check with new sequence bounds. Exits 1 if anything
failed.

    uv run python tools/device_check_gdn.py [--iters 20] [--warmup 3] [--cases len1_state,len6_nostate]
                                            [--skip-long]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gdn_check_cases", REPO_ROOT / "kernels/gdn_prefill/check_cases.py")
cases = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cases
_spec.loader.exec_module(cases)

GRAPH_CASE = cases.CheckCase("graph_replay_new_bounds", (40, 30, 58), True, 0.0, "mamba2")
GRAPH_FRESH = cases.CheckCase("graph_replay_new_bounds", (1, 100, 27), True, 0.0, "mamba2")
HEADER = (
    f"{'case':<28} {'T':>6} {'N':>3} {'out_err':>9} {'state_err':>9} {'bad_out':>7} {'bad_st':>7} "
    f"{'nan':>5} {'pass':>5} {'median_us':>10}"
)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20, help="timed calls per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per case before timing")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--skip-long", action="store_true", help="leave out the 65536-token case")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def _selected_cases(args: argparse.Namespace) -> list:
    if not args.cases:
        return [c for c in cases.CASES if not (args.skip_long and c.long)]
    by_name = {c.name: c for c in cases.CASES}
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(by_name)}")
    return [by_name[n] for n in names]


def _median_us(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, stop in zip(starts, stops):
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, stops)) * 1e3


def _print_row(case, result, median: float, note: str = "") -> None:
    print(
        f"{case.name:<28} {case.num_tokens:>6} {case.num_seqs:>3} {result.output_max_abs_err:>9.2e} "
        f"{result.state_max_abs_err:>9.2e} {result.output_mismatches:>7} {result.state_mismatches:>7} "
        f"{result.nan_count:>5} {('ok' if result.passed and not note else 'FAIL'):>5} {median:>10.1f}{note}"
    )


def _check_case(kernel, reference, case, args) -> bool:
    inputs = cases.make_inputs(case, "cuda", seed=args.seed)
    state_before = None if inputs["state"] is None else inputs["state"].clone()
    output, new_state = cases.poisoned_outputs(case, "cuda")
    kernel.run(*inputs.values(), output, new_state)
    torch.cuda.synchronize()
    result = cases.compare(output, new_state, *reference(*inputs.values()))
    state_kept = state_before is None or torch.equal(inputs["state"], state_before)
    median = _median_us(lambda: kernel.run(*inputs.values(), output, new_state), args.warmup, args.iters)
    _print_row(case, result, median, "" if state_kept else "  (input state modified)")
    return result.passed and state_kept


def _check_graph_replay(kernel, reference, args) -> bool:
    """Capture one call in a CUDA graph, refill the inputs in place with a different split of the
    same T tokens into N sequences, replay, compare."""
    static = cases.make_inputs(GRAPH_CASE, "cuda", seed=args.seed + 1)
    output, new_state = cases.poisoned_outputs(GRAPH_CASE, "cuda")
    kernel.run(*static.values(), output, new_state)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.run(*static.values(), output, new_state)
    fresh = cases.make_inputs(GRAPH_FRESH, "cuda", seed=args.seed + 2)
    for name, value in fresh.items():
        if isinstance(value, torch.Tensor):
            static[name].copy_(value)
    output.fill_(math.nan)
    new_state.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    result = cases.compare(output, new_state, *reference(*fresh.values()))
    median = _median_us(graph.replay, args.warmup, args.iters)
    _print_row(GRAPH_FRESH, result, median)
    return result.passed


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        print("device_check_gdn: no CUDA device", file=sys.stderr)
        return 2
    selected = _selected_cases(args)
    props = torch.cuda.get_device_properties(0)
    print(
        f"device: {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs), "
        f"torch {torch.__version__}"
    )

    started = time.perf_counter()
    kernel = cases.load_kernel()
    kernel.compile_only()
    print(f"compile: {time.perf_counter() - started:.1f} s (sm_90a)")
    reference = cases.load_reference_run()

    print(HEADER)
    all_passed = True
    for case in [*selected, None]:
        name = GRAPH_FRESH.name if case is None else case.name
        try:
            passed = (
                _check_graph_replay(kernel, reference, args)
                if case is None
                else _check_case(kernel, reference, case, args)
            )
        except Exception as error:  # report and go on: one broken case must not hide the others
            passed = False
            message = str(error).splitlines()[0] if str(error) else ""
            print(f"{name:<28} ERROR {type(error).__name__}: {message}")
            traceback.print_exc(limit=3, file=sys.stderr)
        all_passed &= passed
    print("ALL PASSED" if all_passed else "SOME CASES FAILED")
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
