"""Device check of our DSA sparse-attention kernel (kernels/dsa_attention/kernel.py) on a GPU.

`--kernel NAME` checks another module of the folder listed in KERNEL_MODULES instead (a candidate;
none at present: they share `run`; the split sweep runs when the module has `run_with_splits`).
Compiles the kernel, then for every case in kernels/dsa_attention/check_cases.py: fresh random
inputs, NaN-poisoned outputs, one call, comparison with our reference
(hopperbench/tracks/dsa_attention/reference.py) under the DSA track rule of hopperbench.acceptance
(atol = rtol = 1e-2 on every element, no NaN), a median time per call from CUDA events (warm
L2; the benchmark runner does the real timing), and the comparison again on the last timed call's
outputs (state carried between calls shows there). Then a CUDA-graph capture/replay check, and a sweep
of every split count at the contest's cache size (correctness and time, for tuning the split
heuristic). Exits 1 if anything failed, 2 without a CUDA device.

    uv run python kernels/dsa_attention/probes/device_check_dsa.py [--kernel kernel] [--iters 50] [--warmup 10]
                                            [--cases t1_random,t8_one_valid] [--sweep-tokens 1,2,8]
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from hopperbench import devcheck
from hopperbench.devcheck import Column, Table
from hopperbench.paths import REPO_ROOT

cases = devcheck.load_module_by_path(REPO_ROOT / "kernels/dsa_attention/check_cases.py", "dsa_check_cases")

NAME_WIDTH = 26
CASE_TABLE = Table(
    "case",
    NAME_WIDTH,
    (
        Column("T", 5), Column("pages", 6), Column("out_err", 9, ".2e"), Column("lse_err", 9, ".2e"),
        Column("nan", 4), Column("pass", 5), Column("median_us", 10, ".1f"),
    ),
)
SWEEP_TABLE = Table(
    "sweep (contest pages)",
    NAME_WIDTH,
    (
        Column("T", 5), Column("splits", 6), Column("out_err", 9, ".2e"), Column("lse_err", 9, ".2e"),
        Column("pass", 5), Column("median_us", 10, ".1f"),
    ),
)
GRAPH_CASE = cases.CheckCase("graph_replay_t8", 8, 300, "scattered_padding")
# Kernel modules of kernels/dsa_attention/ this tool can check: file stem -> what it compiles.
KERNEL_MODULES = {"kernel": "sm_90a, both kernels"}


def _kernel_loader(name: str):
    """Loader of kernels/dsa_attention/<name>.py (kernel.py through check_cases, as the tests do)."""
    if name == "kernel":
        return cases.load_kernel
    path = REPO_ROOT / "kernels" / "dsa_attention" / f"{name}.py"
    return lambda: devcheck.load_module_by_path(path, f"dsa_attention_{name}")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = devcheck.case_check_parser(__doc__.splitlines()[0], iters=50, warmup=10)
    parser.add_argument(
        "--kernel",
        choices=sorted(KERNEL_MODULES),
        default="kernel",
        help="which module of kernels/dsa_attention/ to check (default: kernel.py)",
    )
    parser.add_argument(
        "--sweep-tokens",
        type=lambda text: [int(t) for t in text.split(",") if t],
        default=[1, 2, 8],
        help="batch sizes for the split-count sweep (empty string: no sweep)",
    )
    return parser.parse_args(argv)


def _case_row(case, verdict, median: float) -> str:
    output, lse = verdict.outputs["output"], verdict.outputs["lse"]
    return CASE_TABLE.row(
        case.name,
        case.num_tokens,
        case.num_pages,
        output.max_abs_err,
        lse.max_abs_err,
        devcheck.total_nan(verdict),
        devcheck.pass_mark(verdict.passed),
        median,
    )


def _check_case(kernel, reference, case, args) -> bool:
    inputs = cases.make_inputs(case, "cuda", seed=args.seed)
    output, lse = cases.poisoned_outputs(case.num_tokens, "cuda")
    kernel.run(*inputs.values(), output, lse)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference(*inputs.values())
    verdict = cases.compare(output, lse, ref_out, ref_lse)
    median = devcheck.median_cuda_time_us(
        lambda: kernel.run(*inputs.values(), output, lse), args.warmup, args.iters
    )
    print(_case_row(case, verdict, median))
    if not verdict.passed:
        print(
            f"    mismatches: output {verdict.outputs['output'].bad_count}, lse {verdict.outputs['lse'].bad_count}"
        )
    # The outputs now hold the last timed call's results: a kernel that carries state from call to
    # call (say, arrival counters) must still be right after warmup + iters calls.
    after = cases.compare(output, lse, ref_out, ref_lse)
    if not after.passed:
        print(
            f"    after {args.warmup + args.iters} more calls: mismatches output "
            f"{after.outputs['output'].bad_count}, lse {after.outputs['lse'].bad_count}"
        )
    return verdict.passed and after.passed


def _sweep_splits(kernel, reference, args) -> bool:
    """Every split count at the contest's cache size for a few decode batch sizes (tuning data).
    Needs the module's `run_with_splits`, `num_splits_for` and `VALID_SPLITS`."""
    print(f"\n{SWEEP_TABLE.header()}")
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
            verdict = cases.compare(output, lse, ref_out, ref_lse)
            median = devcheck.median_cuda_time_us(
                lambda: kernel.run_with_splits(*inputs.values(), output, lse, splits), args.warmup, args.iters
            )
            row = SWEEP_TABLE.row(
                case.name,
                num_tokens,
                splits,
                verdict.outputs["output"].max_abs_err,
                verdict.outputs["lse"].max_abs_err,
                devcheck.pass_mark(verdict.passed),
                median,
                note=" (run)" if splits == chosen else "",
            )
            print(row)
            all_passed &= verdict.passed
    return all_passed


def _check_graph_replay(kernel, reference, args) -> bool:
    """Capture one call in a CUDA graph, refill the inputs in place, replay, compare."""
    static = cases.make_inputs(GRAPH_CASE, "cuda", seed=args.seed + 1)
    output, lse = cases.poisoned_outputs(GRAPH_CASE.num_tokens, "cuda")
    fresh = cases.make_inputs(GRAPH_CASE, "cuda", seed=args.seed + 2)
    graph = devcheck.replay_on_fresh_inputs(
        lambda: kernel.run(*static.values(), output, lse), static, fresh, (output, lse)
    )
    verdict = cases.compare(output, lse, *reference(*fresh.values()))
    median = devcheck.median_cuda_time_us(graph.replay, args.warmup, args.iters)
    print(_case_row(GRAPH_CASE, verdict, median))
    return verdict.passed


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    select = functools.partial(devcheck.select_cases, cases.CASES, args.cases)
    started = devcheck.start("device_check_dsa", select, _kernel_loader(args.kernel), KERNEL_MODULES[args.kernel])
    if started is None:
        return devcheck.EXIT_NO_DEVICE
    selected, kernel = started
    reference = cases.load_reference_run()

    print(CASE_TABLE.header())
    checks = [(c.name, lambda c=c: _check_case(kernel, reference, c, args)) for c in selected]
    checks.append((GRAPH_CASE.name, lambda: _check_graph_replay(kernel, reference, args)))
    all_passed = devcheck.run_checks(checks, NAME_WIDTH)
    if args.sweep_tokens and hasattr(kernel, "run_with_splits"):
        # name_width 0: a sweep failure prints as "sweep ERROR ...", outside the case table.
        all_passed &= devcheck.run_checks([("sweep", lambda: _sweep_splits(kernel, reference, args))], 0)
    return devcheck.finish(all_passed)


if __name__ == "__main__":
    sys.exit(main())
