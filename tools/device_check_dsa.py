"""Device check of our DSA sparse-attention kernel (kernels/dsa_attention/kernel.py) on a GPU.

Compiles the kernel, then for every case in kernels/dsa_attention/check_cases.py: fresh random
inputs, NaN-poisoned outputs, one call, comparison with our reference
(hopperbench/references/dsa_attention.py, atol = rtol = 1e-2 on every element, no NaN), and a
median time per call from CUDA events (warm L2; the benchmark runner does the real timing).
Then a CUDA-graph capture/replay check, and a sweep of every split count at the contest's cache size
(correctness and time, for tuning the split heuristic). Exits 1 if anything failed.

    uv run python tools/device_check_dsa.py [--iters 50] [--warmup 10] [--cases t1_random,t8_one_valid]
                                            [--sweep-tokens 1,2,8]
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
_spec = importlib.util.spec_from_file_location("dsa_check_cases", REPO_ROOT / "kernels/dsa_attention/check_cases.py")
cases = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cases
_spec.loader.exec_module(cases)

HEADER = f"{'case':<26} {'T':>5} {'pages':>6} {'out_err':>9} {'lse_err':>9} {'nan':>4} {'pass':>5} {'median_us':>10}"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50, help="timed calls per case")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls per case before timing")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sweep-tokens",
        type=lambda text: [int(t) for t in text.split(",") if t],
        default=[1, 2, 8],
        help="batch sizes for the split-count sweep (empty string: no sweep)",
    )
    return parser.parse_args(argv)


def _selected_cases(names: str) -> list:
    if not names:
        return list(cases.CASES)
    by_name = {c.name: c for c in cases.CASES}
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(by_name)}")
    return [by_name[n] for n in names.split(",")]


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


def _check_case(kernel, reference, case, args) -> bool:
    inputs = cases.make_inputs(case, "cuda", seed=args.seed)
    output, lse = cases.poisoned_outputs(case.num_tokens, "cuda")
    kernel.run(*inputs.values(), output, lse)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference(*inputs.values())
    result = cases.compare(output, lse, ref_out, ref_lse)
    median = _median_us(lambda: kernel.run(*inputs.values(), output, lse), args.warmup, args.iters)
    print(
        f"{case.name:<26} {case.num_tokens:>5} {case.num_pages:>6} {result.output_max_abs_err:>9.2e} "
        f"{result.lse_max_abs_err:>9.2e} {result.nan_count:>4} {('ok' if result.passed else 'FAIL'):>5} {median:>10.1f}"
    )
    if not result.passed:
        print(f"    mismatches: output {result.output_mismatches}, lse {result.lse_mismatches}")
    return result.passed


def _sweep_splits(kernel, reference, args) -> bool:
    """Every split count at the contest's cache size for a few decode batch sizes (tuning data)."""
    print(f"\n{'sweep (contest pages)':<26} {'T':>5} {'splits':>6} {'out_err':>9} {'lse_err':>9} {'pass':>5} {'median_us':>10}")
    all_passed = True
    for num_tokens in args.sweep_tokens:
        case = cases.CheckCase(f"sweep_t{num_tokens}", num_tokens, cases.CONTEST_NUM_PAGES, "random")
        inputs = cases.make_inputs(case, "cuda", seed=args.seed + num_tokens)
        ref_out, ref_lse = reference(*inputs.values())
        chosen = kernel.num_splits_for(num_tokens)
        for splits in kernel.VALID_SPLITS:
            output, lse = cases.poisoned_outputs(num_tokens, "cuda")
            kernel.run_with_splits(*inputs.values(), output, lse, splits)
            torch.cuda.synchronize()
            result = cases.compare(output, lse, ref_out, ref_lse)
            median = _median_us(
                lambda: kernel.run_with_splits(*inputs.values(), output, lse, splits), args.warmup, args.iters
            )
            mark = " (run)" if splits == chosen else ""
            print(
                f"{case.name:<26} {num_tokens:>5} {splits:>6} {result.output_max_abs_err:>9.2e} "
                f"{result.lse_max_abs_err:>9.2e} {('ok' if result.passed else 'FAIL'):>5} {median:>10.1f}{mark}"
            )
            all_passed &= result.passed
    return all_passed


def _check_graph_replay(kernel, reference, args) -> bool:
    """Capture one call in a CUDA graph, refill the inputs in place, replay, compare."""
    case = cases.CheckCase("graph_replay_t8", 8, 300, "scattered_padding")
    static = cases.make_inputs(case, "cuda", seed=args.seed + 1)
    output, lse = cases.poisoned_outputs(case.num_tokens, "cuda")
    kernel.run(*static.values(), output, lse)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.run(*static.values(), output, lse)
    fresh = cases.make_inputs(case, "cuda", seed=args.seed + 2)
    for name, value in fresh.items():
        if isinstance(value, torch.Tensor):
            static[name].copy_(value)
    output.fill_(math.nan)
    lse.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    result = cases.compare(output, lse, *reference(*fresh.values()))
    median = _median_us(graph.replay, args.warmup, args.iters)
    print(
        f"{case.name:<26} {case.num_tokens:>5} {case.num_pages:>6} {result.output_max_abs_err:>9.2e} "
        f"{result.lse_max_abs_err:>9.2e} {result.nan_count:>4} {('ok' if result.passed else 'FAIL'):>5} {median:>10.1f}"
    )
    return result.passed


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        print("device_check_dsa: no CUDA device", file=sys.stderr)
        return 2
    selected = _selected_cases(args.cases)
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs), torch {torch.__version__}")

    started = time.perf_counter()
    kernel = cases.load_kernel()
    kernel.compile_only()
    print(f"compile: {time.perf_counter() - started:.1f} s (sm_90a, both kernels)")
    reference = cases.load_reference_run()

    print(HEADER)
    all_passed = True
    for case in [*selected, None]:
        try:
            passed = _check_graph_replay(kernel, reference, args) if case is None else _check_case(
                kernel, reference, case, args
            )
        except Exception as error:  # report and go on: one broken case must not hide the others
            passed = False
            name = "graph_replay_t8" if case is None else case.name
            print(f"{name:<26} ERROR {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            traceback.print_exc(limit=3, file=sys.stderr)
        all_passed &= passed
    if args.sweep_tokens:
        try:
            all_passed &= _sweep_splits(kernel, reference, args)
        except Exception as error:
            all_passed = False
            print(f"sweep ERROR {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            traceback.print_exc(limit=3, file=sys.stderr)
    print("ALL PASSED" if all_passed else "SOME CASES FAILED")
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
