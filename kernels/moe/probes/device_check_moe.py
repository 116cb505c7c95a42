"""Device check of our FP8 block-scale MoE kernel (kernels/moe/kernel.py) on a GPU.

Compiles the kernel and runs its start-up (`warm_up`, as the runner does), then for every case in
kernels/moe/check_cases.py: fresh inputs (hopperbench.synth distributions, routing reshaped per case), a
NaN-poisoned output, one call, comparison with our reference (hopperbench/tracks/moe/reference.py) under the
MoE track rule of hopperbench.acceptance (contest rule atol 1, rtol 0.3 on >= 90 % of elements, plus relative
L2 <= 1e-2, no NaN), and a median time per call from CUDA events (warm L2: indicative only; the benchmark runner
does the real cold-L2 CUPTI timing). Weight TB/s = active local experts x 44,040,192 B / median. Then a bitwise
repeat check and a CUDA-graph capture/replay check. Exits 1 if anything failed, 2 without a CUDA device.

    uv run python kernels/moe/probes/device_check_moe.py [--iters 20] [--warmup 3] [--cases t1_off0,t80_off96] [--skip-slow]
        [--kernel kernel]

--kernel names the module of kernels/moe/ whose `run` is checked: kernel.py (default) or a candidate.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import math
import sys
from types import ModuleType

import torch

from hopperbench import devcheck
from hopperbench.devcheck import Column, Table
from hopperbench.paths import REPO_ROOT

cases = devcheck.load_module_by_path(REPO_ROOT / "kernels/moe/check_cases.py", "moe_check_cases")

NAME_WIDTH = 26
TABLE = Table(
    "case",
    NAME_WIDTH,
    (
        Column("T", 6), Column("off", 4), Column("A", 6), Column("E_act", 5), Column("matched", 8, ".5f"),
        Column("rel_l2", 9, ".2e"), Column("nan", 4), Column("pass", 5), Column("median_us", 10, ".1f"),
        Column("w_TB/s", 7, ".2f"),
    ),
)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = devcheck.case_check_parser(__doc__.splitlines()[0], iters=20, warmup=3)
    parser.add_argument("--skip-slow", action="store_true", help=f"leave out {', '.join(sorted(cases.SLOW_CASES))}")
    parser.add_argument("--kernel", default="kernel", help="module of kernels/moe/ whose run is checked")
    return parser.parse_args(argv)


def _load_kernel_module(name: str) -> ModuleType:
    """kernels/moe/<name>.py as a module of the folder's package (load_kernel registers it)."""
    kernel = cases.load_kernel()
    if name == "kernel":
        return kernel
    try:
        module = importlib.import_module(f"{kernel.__package__}.{name}")
    except ModuleNotFoundError:
        raise SystemExit(f"device_check_moe: no module kernels/moe/{name}.py") from None
    if not callable(getattr(module, "run", None)):
        raise SystemExit(f"device_check_moe: kernels/moe/{name}.py has no run()")
    return module


def _selected_cases(args: argparse.Namespace) -> list:
    selected = devcheck.select_cases(cases.CASES, args.cases)
    if args.skip_slow:
        selected = [c for c in selected if c.name not in cases.SLOW_CASES]
    return selected


def _row(name: str, case, assignments: int, active: int, stats, median_us: float) -> str:
    tb_per_s = active * cases.WEIGHT_BYTES_PER_EXPERT / (median_us * 1e-6) / 1e12 if median_us > 0 else math.nan
    return TABLE.row(
        name,
        case.num_tokens,
        case.local_expert_offset,
        assignments,
        active,
        stats.matched_ratio,
        stats.relative_l2,
        stats.nan_count,
        devcheck.pass_mark(stats.passed),
        median_us,
        tb_per_s,
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
    median = devcheck.median_cuda_time_us(lambda: kernel.run(*inputs.values(), output), args.warmup, args.iters)
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
    print(f"{case.name:<{NAME_WIDTH}} bitwise identical: {devcheck.pass_mark(identical)}")
    return identical


def _check_graph_replay(kernel, reference, args) -> bool:
    """Capture one call in a CUDA graph, refill the inputs in place, replay, compare."""
    case = cases.CheckCase("graph_replay_t80", 80, 96)
    static = cases.make_inputs(case, "cuda", seed=args.seed + 1)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    fresh = cases.make_inputs(case, "cuda", seed=args.seed + 2)
    graph = devcheck.replay_on_fresh_inputs(lambda: kernel.run(*static.values(), output), static, fresh, (output,))
    del fresh  # a second copy of the 1.4 GB of expert weights; the reference reads the refilled ones
    stats = cases.compare(output, reference.run(*static.values()))
    assignments, active = cases.local_assignments(reference, static)
    median = devcheck.median_cuda_time_us(graph.replay, args.warmup, args.iters)
    print(_row(case.name, case, assignments, active, stats, median))
    if not stats.passed:
        print(f"    {stats.reason}")
    return stats.passed


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    select = functools.partial(_selected_cases, args)
    load = functools.partial(_load_kernel_module, args.kernel)
    started = devcheck.start("device_check_moe", select, load, f"sm_90a, {args.kernel}.py")
    if started is None:
        return devcheck.EXIT_NO_DEVICE
    selected, kernel = started
    kernel.warm_up()  # the start-up the runner runs before a side's calls
    reference = cases.load_reference()

    print(TABLE.header())
    checks = [(c.name, lambda c=c: _check_case(kernel, reference, c, args)) for c in selected]
    checks.append(("repeat", lambda: _check_repeat(kernel, args)))
    checks.append(("graph_replay_t80", lambda: _check_graph_replay(kernel, reference, args)))
    # Each case draws its own 1.4 GB of expert weights: hand them back before the next one.
    return devcheck.finish(devcheck.run_checks(checks, NAME_WIDTH, after_each=torch.cuda.empty_cache))


if __name__ == "__main__":
    sys.exit(main())
