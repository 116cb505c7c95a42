"""Device check of GROUPED_T (kernels/moe/kernel.py above MEDIUM_T_MAX_TOKENS) and its timing against MEDIUM_T.

    python3 kernels/moe/probes/grouped_check.py [--cases t14107_off32,...] [--iters 10] [--warmup 2] [--seed 0]

For every case of check_cases.LARGE_CASES (1025-16384 tokens: uniform routing, every token on the same 8 local
experts, one expert holding every token, all 8 choices local, no local expert): fresh inputs, one call of GROUPED_T
forced on a NaN-poisoned output, compared with our reference under the MoE track's rule (and exactly zero without a
local expert); then the median time per call (CUDA events, warm L2: indicative only) of GROUPED_T and of MEDIUM_T (the
variant below the threshold, forced: its GEMM1's grid routes any T) on the same inputs, MEDIUM_T's time over
GROUPED_T's, GROUPED_T's multiple of the case's roofline floor (hopperbench.floors, exact for the inputs' routing) and
its TFLOP/s of useful work (6 x 7168 x 2048 per local assignment). One process: a device fault is sticky, so after one
every later case fails too. Exits 1 if a case failed, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from hopperbench import devcheck
from hopperbench.devcheck import Column, Table
from hopperbench.floors import floor
from hopperbench.paths import REPO_ROOT
from hopperbench.tracks.moe.floor import FLOP_PER_ASSIGNMENT

cases = devcheck.load_module_by_path(REPO_ROOT / "kernels/moe/check_cases.py", "moe_check_cases")

NAME_WIDTH = 28
TABLE = Table(
    "case",
    NAME_WIDTH,
    (
        Column("T", 6), Column("A", 7), Column("E_act", 5), Column("rel_l2", 9, ".2e"), Column("pass", 5),
        Column("grouped_us", 10, ".1f"), Column("medium_us", 10, ".1f"), Column("speedup", 7, ".3f"),
        Column("x_floor", 7, ".2f"), Column("TFLOP/s", 7, ".0f"),
    ),
)  # fmt: skip


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    return devcheck.case_check_parser(__doc__.splitlines()[0], iters=10, warmup=2).parse_args(argv)


def _check_case(kernel, reference, case, args) -> bool:
    grouped = kernel.make_run(lambda _: kernel.GROUPED_T)
    medium = kernel.make_run(lambda _: kernel.MEDIUM_T)
    inputs = cases.make_inputs(case, "cuda", seed=args.seed)
    output = cases.poisoned_output(case.num_tokens, "cuda")
    grouped(*inputs.values(), output)
    torch.cuda.synchronize()
    stats = cases.compare(output, reference.run(*inputs.values()))
    passed = stats.passed
    if case.pattern == "no_local" and int(torch.count_nonzero(output)) != 0:
        passed = False
        print(f"    {case.name}: no local expert, yet {int(torch.count_nonzero(output))} nonzero elements")
    assignments, active = cases.local_assignments(reference, inputs)
    grouped_us = devcheck.median_cuda_time_us(lambda: grouped(*inputs.values(), output), args.warmup, args.iters)
    medium_output = cases.poisoned_output(case.num_tokens, "cuda")
    medium_us = devcheck.median_cuda_time_us(lambda: medium(*inputs.values(), medium_output), args.warmup, args.iters)
    floor_us = floor("moe", {"seq_len": case.num_tokens}, t_lat_us=0.0, inputs=inputs).floor_us
    print(
        TABLE.row(
            case.name,
            case.num_tokens,
            assignments,
            active,
            stats.relative_l2,
            devcheck.pass_mark(passed),
            grouped_us,
            medium_us,
            medium_us / grouped_us,
            grouped_us / floor_us,
            assignments * FLOP_PER_ASSIGNMENT / (grouped_us * 1e-6) / 1e12,
        )
    )
    if not passed:
        print(f"    {stats.reason}")
    return passed


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    select = functools.partial(devcheck.select_cases, cases.LARGE_CASES, args.cases)
    started = devcheck.start("grouped_check", select, cases.load_kernel, "sm_90a, GROUPED_T against MEDIUM_T")
    if started is None:
        return devcheck.EXIT_NO_DEVICE
    selected, kernel = started
    reference = cases.load_reference()
    print(TABLE.header())
    checks = [(c.name, lambda c=c: _check_case(kernel, reference, c, args)) for c in selected]
    # Each case draws its own 1.4 GB of expert weights: hand them back before the next one.
    return devcheck.finish(devcheck.run_checks(checks, NAME_WIDTH, after_each=torch.cuda.empty_cache))


if __name__ == "__main__":
    sys.exit(main())
