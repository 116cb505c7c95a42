"""Time FlashInfer's two SM90 GDN paths against the rule the `flashinfer_gdn` side picks one by.

    uv run tools/flashinfer_gdn_paths.py [--min-tokens 341] [--max-seqs 8] [--trials 3] [--even 1024,2048/2,4]

FlashInfer's `chunk_gated_delta_rule` runs a fused chunked kernel (`use_cp=False`) or a context-parallel pipeline
(`use_cp=True`); its own auto rule looks at N alone. The side takes one of the two by T and N
(`flashinfer_gdn.use_cp_for`). This tool measures both paths, the pipeline again with the exact `max_seqlen` hint,
and ours (`kernels/gdn_prefill/kernel.py`), each graph-replayed under the harness's CUPTI cold-L2 timer (the median
span over --iterations, then the median over trials), on the track's listed workloads of at most --max-seqs
sequences from --min-tokens tokens (one input set per trial, as the runner draws them: a split of T per trial) and
on even splits of the --even token counts into the given sequence counts. Each call includes the side's gate kernel.
It prints one line per shape and, last, the shapes where the side's path is more than --tolerance slower than the
other; nothing is written unless --output names a JSON file.

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
PATHS = ("fused", "cp", "cp_exact_max")
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
    median_us: dict[str, float]  # per path, and "ours"

    @property
    def side_loss(self) -> float:
        """How much slower the side's path is than FlashInfer's other path (0 when it is the faster)."""
        other = "cp" if self.side_path == "fused" else "fused"
        return max(0.0, self.median_us[self.side_path] / self.median_us[other] - 1.0)


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
    workloads: Sequence[Any], min_tokens: int, max_seqs: int, even: Sequence[tuple[int, int]]
) -> list[Shape]:
    """The listed workloads of at most `max_seqs` sequences from `min_tokens` tokens, then the even splits."""
    listed = [
        Shape(str(w.index), w.axes["total_seq_len"], w.axes["num_seqs"], w.uuid)
        for w in workloads
        if w.axes["num_seqs"] <= max_seqs and w.axes["total_seq_len"] >= min_tokens
    ]
    return listed + [Shape("even", t, n, f"even-{t}-{n}") for t, n in even]


def side_losses(rows: Sequence[ShapeTimes], tolerance: float) -> list[ShapeTimes]:
    """The shapes where the side's path is more than `tolerance` slower than FlashInfer's other path."""
    return [r for r in rows if r.side_loss > tolerance]


def _even_inputs(shape: Shape, inputs: dict[str, Any]) -> dict[str, Any]:
    """`inputs` with cu_seqlens replaced by an even split of the tokens (the remainder on the last sequence)."""
    import torch

    cu = [i * (shape.total_tokens // shape.num_seqs) for i in range(shape.num_seqs)] + [shape.total_tokens]
    return {**inputs, "cu_seqlens": torch.tensor(cu, dtype=inputs["cu_seqlens"].dtype, device="cuda")}


def measure(shapes: Sequence[Shape], trials: int, iterations: int) -> list[ShapeTimes]:
    import torch

    from hopperbench import devcheck
    from hopperbench.synth import make_inputs
    from hopperbench.timing.cupti_timer import time_cold_l2
    from hopperbench.timing.graph import capture_call
    from hopperbench.tracks.gdn_prefill.adapters import flashinfer_gdn as fi
    from hopperbench.workloads import load_workloads

    chunk_rule = fi.load_chunk_gated_delta_rule()
    ours = devcheck.load_folder_module(REPO_ROOT / "kernels" / TRACK, "gdn_solution", "kernel")
    by_uuid = {w.uuid: w for w in load_workloads(TRACK)}
    template = next(iter(by_uuid.values()))

    def flashinfer(use_cp: bool, max_seqlen: int | None) -> Callable[..., None]:
        def call(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
            g, beta = fi.gates(A_log, a, dt_bias, b)
            chunk_rule(q, k, v, g=g, beta=beta, scale=fi.DEFAULT_SCALE, initial_state=state, output_final_state=True,
                       cu_seqlens=cu_seqlens, output=output, output_state=new_state, use_cp=use_cp,
                       max_seqlen=max_seqlen)  # fmt: skip

        return call

    def time_us(fn: Callable[..., None], inputs: dict[str, Any]) -> float:
        num_seqs = inputs["cu_seqlens"].shape[0] - 1
        output = torch.empty_like(inputs["v"])
        new_state = torch.empty(
            num_seqs, fi.NUM_V_HEADS, fi.HEAD_SIZE, fi.HEAD_SIZE, dtype=torch.float32, device="cuda"
        )
        replay, _ = capture_call(fn, [*inputs.values(), output, new_state])
        output.fill_(float("nan"))
        new_state.fill_(float("nan"))
        replay()
        if not (output.isfinite().all() and new_state.isfinite().all()):
            raise PathsError(f"a call left NaN or inf in its outputs at T {len(output)}, N {num_seqs}")
        return statistics.median(time_cold_l2(replay, [], warmup=3, iterations=iterations)) * 1e3

    rows = []
    for shape in shapes:
        workload = by_uuid.get(shape.uuid) or template.model_copy(
            update={"uuid": shape.uuid, "axes": {**template.axes, "total_seq_len": shape.total_tokens,
                                                 "num_seqs": shape.num_seqs, "len_cu_seqlens": shape.num_seqs + 1}}
        )  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in (*PATHS, "ours")}
        for trial in range(trials):
            inputs = make_inputs(TRACK, workload, 0, trial, "cuda")
            if shape.label == "even":
                inputs = _even_inputs(shape, inputs)
            cu = inputs["cu_seqlens"]
            longest = int((cu[1:] - cu[:-1]).max().item())
            calls = {"fused": flashinfer(False, None), "cp": flashinfer(True, None),
                     "cp_exact_max": flashinfer(True, longest), "ours": ours.run}  # fmt: skip
            for name, fn in calls.items():
                times[name].append(time_us(fn, inputs))
        auto_cp = shape.num_seqs <= AUTO_CP_MAX_SEQS
        side_path = "cp" if fi.use_cp_for(shape.total_tokens, shape.num_seqs) and auto_cp else "fused"
        rows.append(ShapeTimes(shape, side_path, {name: statistics.median(ts) for name, ts in times.items()}))
        print(_line(rows[-1]), flush=True)
    return rows


def _line(row: ShapeTimes) -> str:
    s, us = row.shape, row.median_us
    cells = " ".join(f"{name} {us[name]:7.1f}" for name in (*PATHS, "ours"))
    return f"{s.label:>5} T {s.total_tokens:6d} N {s.num_seqs:2d}  {cells} us  side: {row.side_path}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-tokens", type=int, default=341)
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
        even = parse_even(args.even) if args.even else []
        if args.output and not args.output.parent.is_dir():
            raise PathsError(f"--output: no folder {args.output.parent}")
        if not torch.cuda.is_available():
            raise PathsError("needs a CUDA GPU")
        flashinfer_gdn.load_chunk_gated_delta_rule()
        shapes = select_shapes(load_workloads(TRACK), args.min_tokens, args.max_seqs, even)
        rows = measure(shapes, args.trials, args.iterations)
    except (PathsError, flashinfer_gdn.LibraryUnavailableError) as e:
        print(f"flashinfer_gdn_paths: {e}", file=sys.stderr)
        return 2
    losses = side_losses(rows, args.tolerance)
    print(f"the side's path slower by more than {args.tolerance:.0%}: {len(losses)} of {len(rows)} shapes")
    for row in losses:
        print(f"  {_line(row)}  ({row.side_loss:.0%})")
    if args.output:
        args.output.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
