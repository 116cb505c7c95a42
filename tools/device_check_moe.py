"""Device check of our FP8 block-scale MoE kernel (kernels/moe/kernel.py) on a GPU.

Compiles the kernel, then for every case in kernels/moe/check_cases.py: fresh inputs (hopperbench.synth
distributions, routing reshaped per case), a NaN-poisoned output, one call, comparison with our
reference (hopperbench/references/moe.py) under the MoE track rule (contest rule atol 1, rtol 0.3 on
>= 90 % of elements, plus relative L2 <= 1e-2, no NaN), and a median time per call from CUDA events
(warm L2: indicative only; the benchmark runner does the real cold-L2 CUPTI timing). Weight TB/s =
active local experts x 44,040,192 B / median. Then a bitwise repeat check and a CUDA-graph
capture/replay check. Exits 1 if anything failed.

    uv run python tools/device_check_moe.py [--iters 20] [--warmup 3] [--cases t1_off0,t80_off96] [--skip-slow]
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
_spec = importlib.util.spec_from_file_location("moe_check_cases", REPO_ROOT / "kernels/moe/check_cases.py")
cases = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cases
_spec.loader.exec_module(cases)

HEADER = (
    f"{'case':<26} {'T':>6} {'off':>4} {'A':>6} {'E_act':>5} {'matched':>8} {'rel_l2':>9} "
    f"{'nan':>4} {'pass':>5} {'median_us':>10} {'w_TB/s':>7}"
)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20, help="timed calls per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per case before timing")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--skip-slow", action="store_true", help=f"leave out {', '.join(sorted(cases.SLOW_CASES))}")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def _selected_cases(args: argparse.Namespace) -> list:
    selected = list(cases.CASES)
    if args.cases:
        by_name = {c.name: c for c in cases.CASES}
        unknown = [n for n in args.cases.split(",") if n not in by_name]
        if unknown:
            raise SystemExit(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(by_name)}")
        selected = [by_name[n] for n in args.cases.split(",")]
    if args.skip_slow:
        selected = [c for c in selected if c.name not in cases.SLOW_CASES]
    return selected


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


def _row(name: str, case, assignments: int, active: int, stats, median_us: float) -> str:
    tb_per_s = active * cases.WEIGHT_BYTES_PER_EXPERT / (median_us * 1e-6) / 1e12 if median_us > 0 else math.nan
    return (
        f"{name:<26} {case.num_tokens:>6} {case.local_expert_offset:>4} {assignments:>6} {active:>5} "
        f"{stats.matched_ratio:>8.5f} {stats.relative_l2:>9.2e} {stats.nan_count:>4} "
        f"{('ok' if stats.passed else 'FAIL'):>5} {median_us:>10.1f} {tb_per_s:>7.2f}"
    )


def _check_case(kernel, reference, case, args) -> bool:
    inputs = cases.make_inputs(case, "cuda", seed=args.seed)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    kernel.run(*inputs.values(), output)
    torch.cuda.synchronize()
    ref_output = reference.run(*inputs.values())
    stats = cases.compare(output, ref_output)
    passed = stats.passed
    if case.pattern == "no_local" and int(torch.count_nonzero(output)) != 0:
        passed = False
        print(f"    {case.name}: no local expert, yet {int(torch.count_nonzero(output))} nonzero elements")
    assignments, active = cases.local_assignments(reference, inputs)
    del ref_output
    median = _median_us(lambda: kernel.run(*inputs.values(), output), args.warmup, args.iters)
    print(_row(case.name, case, assignments, active, stats, median))
    if not passed:
        print(f"    {stats.reason}")
    return passed


def _check_repeat(kernel, args) -> bool:
    """Two calls on the same inputs give the same bits (rank order from atomics must not matter)."""
    case = cases.CheckCase("repeat_t901_all_local", 901, 96, "all_local")
    inputs = cases.make_inputs(case, "cuda", seed=args.seed + 3)
    first = cases.poisoned_output(case.num_tokens, "cuda")
    second = cases.poisoned_output(case.num_tokens, "cuda")
    kernel.run(*inputs.values(), first)
    kernel.run(*inputs.values(), second)
    torch.cuda.synchronize()
    identical = torch.equal(first, second)
    print(f"{case.name:<26} bitwise identical: {'ok' if identical else 'FAIL'}")
    return identical


def _check_graph_replay(kernel, reference, args) -> bool:
    """Capture one call in a CUDA graph, refill the inputs in place, replay, compare."""
    case = cases.CheckCase("graph_replay_t80", 80, 96)
    static = cases.make_inputs(case, "cuda", seed=args.seed + 1)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    kernel.run(*static.values(), output)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.run(*static.values(), output)
    fresh = cases.make_inputs(case, "cuda", seed=args.seed + 2)
    for name, value in fresh.items():
        if isinstance(value, torch.Tensor):
            static[name].copy_(value)
    del fresh
    output.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    stats = cases.compare(output, reference.run(*static.values()))
    assignments, active = cases.local_assignments(reference, static)
    median = _median_us(graph.replay, args.warmup, args.iters)
    print(_row(case.name, case, assignments, active, stats, median))
    if not stats.passed:
        print(f"    {stats.reason}")
    return stats.passed


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        print("device_check_moe: no CUDA device", file=sys.stderr)
        return 2
    selected = _selected_cases(args)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    print(f"device: {props.name} (sm_{props.major}{props.minor}, {sms} SMs), torch {torch.__version__}")

    started = time.perf_counter()
    kernel = cases.load_kernel()
    kernel.compile_only()
    print(f"compile: {time.perf_counter() - started:.1f} s (sm_90a, five kernels)")
    reference = cases.load_reference()

    print(HEADER)
    checks = [(c.name, lambda c=c: _check_case(kernel, reference, c, args)) for c in selected]
    checks.append(("repeat", lambda: _check_repeat(kernel, args)))
    checks.append(("graph_replay_t80", lambda: _check_graph_replay(kernel, reference, args)))
    all_passed = True
    for name, check in checks:
        try:
            passed = check()
        except Exception as error:  # report and go on: one broken case must not hide the others
            passed = False
            print(f"{name:<26} ERROR {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            traceback.print_exc(limit=3, file=sys.stderr)
        all_passed &= passed
        torch.cuda.empty_cache()
    print("ALL PASSED" if all_passed else "SOME CASES FAILED")
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
