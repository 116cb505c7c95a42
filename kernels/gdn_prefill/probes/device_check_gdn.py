"""Device check of our GDN prefill kernel (kernels/gdn_prefill/kernel.py) on a GPU.

`--kernel NAME` (one of KERNEL_CHOICES: `token_serial`, `chunked`, `wy_prepass`, `wgmma_value_side`,
`context_parallel` or `warp_chain`) checks one of kernel.py's paths alone, at every case
(kernel.py picks one from T and N): kernels/gdn_prefill/<name>.py, loaded as a module of a package made of
that folder (as the harness packs it), so that it may import its siblings. A case with a `known_failure`
is reported with its reason and does not fail the check, but for the paths with the slow-chunk pairs
(`check_cases.PAIRED_PATHS`), which must pass it.
Compiles the kernel, then for every case in kernels/gdn_prefill/check_cases.py: fresh inputs,
NaN-poisoned outputs, one call, comparison with our reference (hopperbench/tracks/gdn_prefill/reference.py)
under the GDN track rule of hopperbench.acceptance (atol = rtol = 1e-2 on every element of output
and new_state, no NaN), a check that the input state is unchanged, and a median time per call from
CUDA events (warm L2; the benchmark runner does the real timing). Then a CUDA-graph capture/replay
check with new sequence bounds. Exits 1 if anything failed, 2 without a CUDA device.

    uv run python kernels/gdn_prefill/probes/device_check_gdn.py [--kernel {kernel,token_serial,chunked}] [--iters 20] [--warmup 3]
                                            [--cases len1_state,len6_nostate] [--skip-long]
"""

from __future__ import annotations

import argparse
import functools
import sys
from types import ModuleType

import torch

from hopperbench import devcheck
from hopperbench.devcheck import Column, Table
from hopperbench.paths import REPO_ROOT

cases = devcheck.load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")

KERNEL_DIR = REPO_ROOT / "kernels" / "gdn_prefill"
# Modules of KERNEL_DIR with the `run` entry: kernel.py, its paths, and any candidates.
KERNEL_CHOICES = (
    "kernel",
    "token_serial",
    "chunked",
    "wy_prepass",
    "wgmma_value_side",
    "context_parallel",
    "warp_chain",
)

# Ten sequences, so that the chunked kernel, which orders its grid rows by length, re-ranks at replay:
# the longest is sequence 7 at capture and sequence 1 in the fresh split.
GRAPH_CASE = cases.CheckCase("graph_replay_new_bounds", (40, 30, 58, 1, 64, 3, 20, 90, 7, 15), True, 0.0, "mamba2")
GRAPH_FRESH = cases.CheckCase("graph_replay_new_bounds", (1, 100, 27, 60, 5, 44, 30, 9, 40, 12), True, 0.0, "mamba2")
NAME_WIDTH = 28
TABLE = Table(
    "case",
    NAME_WIDTH,
    (
        Column("T", 6), Column("N", 3), Column("out_err", 9, ".2e"), Column("state_err", 9, ".2e"),
        Column("bad_out", 7), Column("bad_st", 7), Column("nan", 5), Column("pass", 5),
        Column("median_us", 10, ".1f"),
    ),
)


def load_kernel_module(name: str) -> ModuleType:
    """kernels/gdn_prefill/<name>.py as a module of a package made of that folder (no
    __init__.py needed), so that its relative imports of siblings (`from .kernel import ...`)
    resolve the way they do in the harness's packed solution."""
    if name not in KERNEL_CHOICES:
        raise ValueError(f"unknown GDN kernel module {name!r}; choose from {', '.join(KERNEL_CHOICES)}")
    return devcheck.load_folder_module(KERNEL_DIR, cases.SOLUTION_PACKAGE, name)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = devcheck.case_check_parser(__doc__.splitlines()[0], iters=20, warmup=3)
    parser.add_argument(
        "--kernel", choices=KERNEL_CHOICES, default="kernel", help="which module of kernels/gdn_prefill to check"
    )
    parser.add_argument("--skip-long", action="store_true", help="leave out the long cases (16384-65536 tokens)")
    return parser.parse_args(argv)


def _selected_cases(args: argparse.Namespace) -> list:
    selected = devcheck.select_cases(cases.CASES, args.cases)
    if args.skip_long and not args.cases:  # cases named on the command line run even if long
        selected = [c for c in selected if not c.long]
    return selected


def _print_row(case, verdict, median: float, note: str = "") -> None:
    output, state = verdict.outputs["output"], verdict.outputs["new_state"]
    row = TABLE.row(
        case.name,
        case.num_tokens,
        case.num_seqs,
        output.max_abs_err,
        state.max_abs_err,
        output.bad_count,
        state.bad_count,
        devcheck.total_nan(verdict),
        devcheck.pass_mark(verdict.passed and not note),
        median,
        note=note,
    )
    print(row)


def _check_case(kernel, reference, case, args, known_failure: str) -> bool:
    inputs = cases.make_inputs(case, "cuda", seed=args.seed)
    state_before = None if inputs["state"] is None else inputs["state"].clone()
    output, new_state = cases.poisoned_outputs(case, "cuda")
    kernel.run(*inputs.values(), output, new_state)
    torch.cuda.synchronize()
    verdict = cases.compare(output, new_state, *reference(*inputs.values()))
    state_kept = state_before is None or torch.equal(inputs["state"], state_before)
    median = devcheck.median_cuda_time_us(
        lambda: kernel.run(*inputs.values(), output, new_state), args.warmup, args.iters
    )
    note = "" if state_kept else "  (input state modified)"
    if known_failure and state_kept:
        note = f"  (known failure: {known_failure})" if not verdict.passed else "  (known failure passes here)"
    _print_row(case, verdict, median, note)
    return state_kept and (verdict.passed or bool(known_failure))


def _check_graph_replay(kernel, reference, args) -> bool:
    """Capture one call in a CUDA graph, refill the inputs in place with a different split of the
    same T tokens into N sequences, replay, compare."""
    static = cases.make_inputs(GRAPH_CASE, "cuda", seed=args.seed + 1)
    output, new_state = cases.poisoned_outputs(GRAPH_CASE, "cuda")
    fresh = cases.make_inputs(GRAPH_FRESH, "cuda", seed=args.seed + 2)
    graph = devcheck.replay_on_fresh_inputs(
        lambda: kernel.run(*static.values(), output, new_state), static, fresh, (output, new_state)
    )
    verdict = cases.compare(output, new_state, *reference(*fresh.values()))
    median = devcheck.median_cuda_time_us(graph.replay, args.warmup, args.iters)
    _print_row(GRAPH_FRESH, verdict, median)
    return verdict.passed


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    select = functools.partial(_selected_cases, args)
    load = cases.load_kernel if args.kernel == "kernel" else functools.partial(load_kernel_module, args.kernel)
    started = devcheck.start("device_check_gdn", select, load, f"{args.kernel}.py, sm_90a")
    if started is None:
        return devcheck.EXIT_NO_DEVICE
    selected, kernel = started
    reference = cases.load_reference_run()

    print(TABLE.header())
    paired = args.kernel in cases.PAIRED_PATHS  # these must pass a case's known failure (the other paths')
    checks = [
        (c.name, lambda c=c: _check_case(kernel, reference, c, args, "" if paired else c.known_failure))
        for c in selected
    ]
    checks.append((GRAPH_FRESH.name, lambda: _check_graph_replay(kernel, reference, args)))
    return devcheck.finish(devcheck.run_checks(checks, NAME_WIDTH))


if __name__ == "__main__":
    sys.exit(main())
