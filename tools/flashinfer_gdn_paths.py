"""Time FlashInfer's SM90 GDN paths against the rule the `flashinfer_gdn` side picks one by.

    uv run tools/flashinfer_gdn_paths.py [--min-tokens 341] [--max-tokens T] [--max-seqs 8] [--trials 3]
                                         [--even 1024,2048/2,4]

FlashInfer's `chunk_gated_delta_rule` runs a fused chunked kernel (`use_cp=False`) or a context-parallel pipeline
(`use_cp=True`); its own auto rule looks at N alone. The side takes one of the two by T and N
(`flashinfer_gdn.use_cp_for`). FlashInfer also has a multi-token decode kernel (`gdn_decode.gated_delta_rule_mtp`,
built for speculative-decoding verification: equal lengths [B, T], gates from A_log, a, dt_bias and b inside, the
state updated in place in a pool, one compile per T), which computes the same thing for one sequence: path "mtp",
timed with the copy of `state` into `new_state` (its pool slot) that the definition's separate output needs.

This tool measures those paths, the pipeline again with the exact `max_seqlen` hint, and ours
(`kernels/gdn_prefill/kernel.py`), each graph-replayed under the harness's CUPTI cold-L2 timer (the median span
over --iterations, then the median over trials), on the track's listed workloads of at most --max-seqs sequences
from --min-tokens (to --max-tokens) tokens (one input set per trial, as the runner draws them: a split of T per
trial) and on even splits of the --even token counts into the given sequence counts. Each chunk_gated_delta_rule
call includes the side's gate kernel. Every path's outputs of every trial are gated against the definition's
reference under the track's rule; a path that fails it, or raises, is reported and not compared. It prints one
line per shape and, last, the shapes where the side's path is more than --tolerance slower than FlashInfer's fastest
passing path; nothing is written unless --output names a JSON file.

Exits 2 with one line on stderr without CUDA or FlashInfer, or on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
TRACK = "gdn_prefill"
PATHS = ("fused", "cp", "cp_exact_max", "mtp")
# The paths the side may take (the exact max_seqlen would need a host read of cu_seqlens).
SIDE_PATHS = ("fused", "cp", "mtp")
# FlashInfer's auto rule takes its pipeline on the H200 up to this many sequences (`should_use_cp_host`: 2 N H < SMs).
AUTO_CP_MAX_SEQS = 8


class PathsError(RuntimeError):
    """Why nothing was measured."""


@dataclass(frozen=True)
class Shape:
    label: str  # the workload's index, or "even"
    total_tokens: int
    num_seqs: int
    uuid: str


@dataclass(frozen=True)
class ShapeTimes:
    shape: Shape
    side_path: str  # "fused" or "cp": what `use_cp_for` picks
    median_us: dict[str, float]  # per path that ran and passed, and "ours"
    failed: tuple[str, ...] = ()  # paths whose outputs failed the track's rule in some trial

    @property
    def side_loss(self) -> float:
        """How much slower the side's path is than FlashInfer's fastest passing path (0 when it is that one)."""
        passing = [self.median_us[p] for p in SIDE_PATHS if p in self.median_us]
        side = self.median_us.get(self.side_path)
        if side is None or not passing:
            return 0.0
        return max(0.0, side / min(passing) - 1.0)


def parse_even(text: str) -> list[tuple[int, int]]:
    """`1024,2048/2,4` -> every (tokens, sequences) pair of the two lists."""
    try:
        tokens, seqs = text.split("/")
        pairs = [(int(t), int(n)) for t in tokens.split(",") for n in seqs.split(",")]
    except ValueError:
        raise PathsError(f"--even must look like 1024,2048/2,4, got {text!r}") from None
    if any(n < 1 or t < n for t, n in pairs):
        raise PathsError(f"--even needs 1 <= sequences <= tokens, got {text!r}")
    return pairs


def select_shapes(
    workloads: Sequence[Any],
    min_tokens: int,
    max_seqs: int,
    even: Sequence[tuple[int, int]],
    max_tokens: int | None = None,
) -> list[Shape]:
    """The listed workloads of at most `max_seqs` sequences from `min_tokens` (to `max_tokens`) tokens, then the
    even splits."""
    listed = [
        Shape(str(w.index), w.axes["total_seq_len"], w.axes["num_seqs"], w.uuid)
        for w in workloads
        if w.axes["num_seqs"] <= max_seqs
        and min_tokens <= w.axes["total_seq_len"] <= (max_tokens if max_tokens is not None else sys.maxsize)
    ]
    return listed + [Shape("even", t, n, f"even-{t}-{n}") for t, n in even]


def side_losses(rows: Sequence[ShapeTimes], tolerance: float) -> list[ShapeTimes]:
    """The shapes where the side's path is more than `tolerance` slower than FlashInfer's fastest passing path."""
    return [r for r in rows if r.side_loss > tolerance]


def _even_inputs(shape: Shape, inputs: dict[str, Any]) -> dict[str, Any]:
    """`inputs` with cu_seqlens replaced by an even split of the tokens (the remainder on the last sequence)."""
    import torch

    cu = [i * (shape.total_tokens // shape.num_seqs) for i in range(shape.num_seqs)] + [shape.total_tokens]
    return {**inputs, "cu_seqlens": torch.tensor(cu, dtype=inputs["cu_seqlens"].dtype, device="cuda")}


def takes_mtp(shape: Shape) -> bool:
    """FlashInfer's multi-token kernel runs a batch of equal lengths of at least 2 tokens: one call for one
    sequence."""
    return shape.num_seqs == 1 and shape.total_tokens >= 2


def measure(shapes: Sequence[Shape], trials: int, iterations: int) -> list[ShapeTimes]:
    import torch
    from flashinfer.gdn_decode import gated_delta_rule_mtp

    from hopperbench import devcheck
    from hopperbench.acceptance import check_outputs
    from hopperbench.definitions import reference_runner
    from hopperbench.synth import make_inputs
    from hopperbench.timing.cupti_timer import time_cold_l2
    from hopperbench.timing.graph import capture_call
    from hopperbench.tracks import get_track
    from hopperbench.tracks.gdn_prefill.adapters import flashinfer_gdn as fi
    from hopperbench.workloads import load_workloads

    ours = devcheck.load_folder_module(REPO_ROOT / "kernels" / TRACK, "gdn_solution", "kernel")
    track = get_track(TRACK)
    reference_run, rule = reference_runner(track), track.acceptance
    by_uuid = {w.uuid: w for w in load_workloads(TRACK)}
    template = next(iter(by_uuid.values()))
    first_slot = torch.zeros(1, dtype=torch.int32, device="cuda")  # the pool slot of the one sequence

    def flashinfer(use_cp: bool, max_seqlen: int | None) -> Callable[..., None]:
        return lambda *args: fi.run_path(*args, use_cp=use_cp, max_seqlen=max_seqlen)

    def mtp(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
        """One sequence through FlashInfer's multi-token kernel, `new_state` as its pool of one slot."""
        t, qk_heads, v_heads = q.shape[0], fi.NUM_Q_HEADS, fi.NUM_V_HEADS
        if state is None:
            new_state.zero_()
        else:
            new_state.copy_(state)
        gated_delta_rule_mtp(
            q.view(1, t, qk_heads, fi.HEAD_SIZE), k.view(1, t, qk_heads, fi.HEAD_SIZE),
            v.view(1, t, v_heads, fi.HEAD_SIZE), new_state, first_slot, A_log, a.view(1, t, v_heads), dt_bias,
            b.view(1, t, v_heads), scale=float(scale) if scale else fi.DEFAULT_SCALE,
            output=output.view(1, t, v_heads, fi.HEAD_SIZE), disable_state_update=False, use_qk_l2norm=False,
        )  # fmt: skip

    def time_us(fn: Callable[..., None], inputs: dict[str, Any], reference: dict[str, Any]) -> float | None:
        """The median replay span in us, or None when the replayed outputs fail the track's rule."""
        num_seqs = inputs["cu_seqlens"].shape[0] - 1
        output = torch.empty_like(inputs["v"])
        new_state = torch.empty(
            num_seqs, fi.NUM_V_HEADS, fi.HEAD_SIZE, fi.HEAD_SIZE, dtype=torch.float32, device="cuda"
        )
        replay, _ = capture_call(fn, [*inputs.values(), output, new_state])
        output.fill_(float("nan"))
        new_state.fill_(float("nan"))
        replay()
        if not check_outputs(rule, {"output": output, "new_state": new_state}, reference).passed:
            return None
        return statistics.median(time_cold_l2(replay, [], warmup=3, iterations=iterations)) * 1e3

    rows = []
    for shape in shapes:
        workload = by_uuid.get(shape.uuid) or template.model_copy(
            update={"uuid": shape.uuid, "axes": {**template.axes, "total_seq_len": shape.total_tokens,
                                                 "num_seqs": shape.num_seqs, "len_cu_seqlens": shape.num_seqs + 1}}
        )  # fmt: skip
        times: dict[str, list[float]] = {}
        failed: set[str] = set()
        for trial in range(trials):
            inputs = make_inputs(TRACK, workload, 0, trial, "cuda")
            if shape.label == "even":
                inputs = _even_inputs(shape, inputs)
            expected_output, expected_state = reference_run(*inputs.values())
            reference = {"output": expected_output, "new_state": expected_state}
            cu = inputs["cu_seqlens"]
            longest = int((cu[1:] - cu[:-1]).max().item())
            calls = {"fused": flashinfer(False, None), "cp": flashinfer(True, None),
                     "cp_exact_max": flashinfer(True, longest), "ours": ours.run}  # fmt: skip
            if takes_mtp(shape):
                calls["mtp"] = mtp
            for name, fn in calls.items():
                if name in failed:
                    continue
                try:
                    us = time_us(fn, inputs, reference)
                except Exception as e:  # a path that cannot run here (a JIT build, a capture) fails, the rest goes on
                    first_line = str(e).splitlines()[0] if str(e) else ""
                    print(f"{shape.label}: {name} raised {type(e).__name__}: {first_line}")
                    us = None
                if us is None:
                    failed.add(name)
                else:
                    times.setdefault(name, []).append(us)
        auto_cp = shape.num_seqs <= AUTO_CP_MAX_SEQS
        side_path = "cp" if fi.use_cp_for(shape.total_tokens, shape.num_seqs) and auto_cp else "fused"
        medians = {name: statistics.median(ts) for name, ts in times.items() if name not in failed}
        rows.append(ShapeTimes(shape, side_path, medians, tuple(sorted(failed))))
        print(_line(rows[-1]), flush=True)
    return rows


def _line(row: ShapeTimes) -> str:
    s, us = row.shape, row.median_us
    cells = " ".join(
        f"{name} {us[name]:7.1f}" if name in us else f"{name} {'FAILED' if name in row.failed else '-':>7}"
        for name in (*PATHS, "ours")
    )
    return f"{s.label:>5} T {s.total_tokens:6d} N {s.num_seqs:2d}  {cells} us  side: {row.side_path}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-tokens", type=int, default=341)
    parser.add_argument("--max-tokens", type=int, default=None, help="at most this many tokens (no bound)")
    parser.add_argument("--max-seqs", type=int, default=AUTO_CP_MAX_SEQS, help="at most this many sequences (8)")
    parser.add_argument("--trials", type=int, default=3, help="input sets (splits of T) per listed workload")
    parser.add_argument("--iterations", type=int, default=30, help="timed replays per trial")
    parser.add_argument("--even", default="", help="even splits, tokens/sequences: 1024,2048/2,4")
    parser.add_argument("--tolerance", type=float, default=0.03, help="side losses reported above this fraction")
    parser.add_argument("--output", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    import torch

    from hopperbench.tracks.gdn_prefill.adapters import flashinfer_gdn
    from hopperbench.workloads import load_workloads

    try:
        if args.trials < 1 or args.iterations < 1:
            raise PathsError("--trials and --iterations must be >= 1")
        if args.max_tokens is not None and args.max_tokens < args.min_tokens:
            raise PathsError(f"--max-tokens {args.max_tokens} is below --min-tokens {args.min_tokens}")
        even = parse_even(args.even) if args.even else []
        if args.output and not args.output.parent.is_dir():
            raise PathsError(f"--output: no folder {args.output.parent}")
        if not torch.cuda.is_available():
            raise PathsError("needs a CUDA GPU")
        flashinfer_gdn.load_chunk_gated_delta_rule()
        shapes = select_shapes(load_workloads(TRACK), args.min_tokens, args.max_seqs, even, args.max_tokens)
        rows = measure(shapes, args.trials, args.iterations)
    except (PathsError, flashinfer_gdn.LibraryUnavailableError) as e:
        print(f"flashinfer_gdn_paths: {e}", file=sys.stderr)
        return 2
    losses = side_losses(rows, args.tolerance)
    print(f"the side's path slower than FlashInfer's fastest passing one by more than {args.tolerance:.0%}:"
          f" {len(losses)} of {len(rows)} shapes")  # fmt: skip
    for row in losses:
        print(f"  {_line(row)}  ({row.side_loss:.0%})")
    if args.output:
        args.output.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
