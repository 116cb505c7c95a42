"""Where the GDN kernels' error comes from, and what removes it: the CPU models of the chained path
(`chunked_model.py`) and the context-parallel path (`cp_model.py`) at the kernels' precision (fp32, fp16
tensor-core operands), with chosen rounding points (`chunked_model.ROUNDING_POINTS`) kept as hi / lo fp16 pairs
(two MMAs where the kernels issue one), against the float64 token recurrence.

    uv run kernels/gdn_prefill/probes/rounding_points.py [--case repeated_keys16384_slow] [--seeds 0,1] \
        [--points none,T,Vc,Xb,state,T+Vc]

For each seed and set of paired points: the largest element's error over the track's tolerance (the
contest's rule: an element fails when its absolute error exceeds atol and its relative error rtol, i.e. when
min(abs / atol, rel / rtol) > 1) of the output and of the final state, chained and context parallel (16 segments, as `kernel.py` cuts
one sequence). NOTES.md's accuracy bullet cites it. Exits 2 on bad arguments, with one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from hopperbench.acceptance import REL_EPS
from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT
from hopperbench.tracks import get_track

FOLDER = REPO_ROOT / "kernels/gdn_prefill"
cases = load_module_by_path(FOLDER / "check_cases.py", "gdn_check_cases")
chunked_model = load_module_by_path(FOLDER / "chunked_model.py", "gdn_chunked_model_for_cp")
cp_model = load_module_by_path(FOLDER / "cp_model.py", "gdn_cp_model")

RULE = get_track("gdn_prefill").acceptance
CP_SEGMENTS = 16  # context_parallel.CP_SEGMENTS (not imported: the models need no CuTe-DSL)
INPUTS = ("q", "k", "v", "state", "A_log", "a", "dt_bias", "b", "cu_seqlens", "scale")


def over_tolerance(x: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest min(abs / atol, rel / rtol) over the elements (relative error as `hopperbench.acceptance`
    computes it): above 1, that element fails the track's rule."""
    abs_err = (x.double() - reference).abs()
    rel_err = abs_err / (reference.abs() + REL_EPS)
    return torch.minimum(abs_err / RULE.atol, rel_err / RULE.rtol).max().item()


def parse_points(spec: str) -> frozenset[str]:
    points = frozenset() if spec == "none" else frozenset(spec.split("+"))
    chunked_model.check_rounding_points(points)
    return points


def errors(args: list, reference: tuple[torch.Tensor, torch.Tensor], paired: frozenset[str]) -> dict[str, float]:
    """Output and state error over the tolerance, chained and context parallel, with `paired` points as pairs."""
    ref_out, ref_state = reference

    def step(*a, **kw):
        return chunked_model.chunk_step(*a, **kw, paired=paired)

    out, state = chunked_model.run(*args, precision=chunked_model.KERNEL, step=step)
    num_tokens = args[0].shape[0]
    segment_chunks = max(1, num_tokens // (CP_SEGMENTS * chunked_model.CHUNK))
    cp_out, cp_state = cp_model.run(
        *args, precision=chunked_model.KERNEL, segment_chunks=segment_chunks, paired=paired
    )
    return {
        "chained output": over_tolerance(out, ref_out),
        "chained state": over_tolerance(state, ref_state),
        "CP output": over_tolerance(cp_out, ref_out),
        "CP state": over_tolerance(cp_state, ref_state),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="repeated_keys16384_slow", help="a case of check_cases.py")
    parser.add_argument("--seeds", default="0", help="comma list of input seeds")
    parser.add_argument("--points", default="none,T,Vc,Xb,state,T+Vc", help="comma list of '+'-joined points")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        case = next((c for c in cases.CASES if c.name == args.case), None)
        if case is None:
            raise ValueError(f"unknown case {args.case!r}; see kernels/gdn_prefill/check_cases.py")
        seeds = [int(s) for s in args.seeds.split(",")]
        variants = [parse_points(p) for p in args.points.split(",")]
    except ValueError as e:
        print(f"rounding_points: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    print(f"{case.name}: error / tolerance (above 1 fails)")
    for seed in seeds:
        inputs = cases.make_inputs(case, "cpu", seed=seed)
        run_args = [inputs[name] for name in INPUTS]
        reference = cp_model.token_recurrence(*run_args)
        for paired in variants:
            cells = errors(run_args, reference, paired)
            names = "+".join(sorted(paired)) or "none"
            print(f"seed {seed}  paired {names:12s} " + "  ".join(f"{k} {v:.3f}" for k, v in cells.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
