"""How the MoE workloads' routing spreads tokens over the local experts, and what that means for the
weight-streaming GEMMs' row tiles and their traffic through L2.

    uv run kernels/moe/probes/moe_routing_stats.py [--workloads 4,3,12] [--trials 3] [--seed 0] [--device cpu] [--tiles 16,32,64]

For each workload (indices of the MoE workload list) and trial: the routing inputs the runner
synthesizes (`hopperbench.synth`, those inputs only), routed as the definition routes
(`hopperbench.tracks.moe.floor.local_expert_counts`), and one row: active local experts, assignments, the
largest expert's tokens and, per row-tile width, the row tiles of all experts and the bytes both GEMMs
move through L2 under the streaming kernels' item map (a row tile reads its expert's weights once;
an assignment's activations are read once per item column: 64 for GEMM1, 112 for GEMM2).

The synthesizer draws the routing logits with the target device's generator, so on the CPU the values
differ from the runner's GPU draws (same distribution); `--device cuda` gives the runner's inputs.
Exits 2 on bad arguments, with one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hopperbench.tracks.moe.floor import local_expert_counts
from hopperbench.synth import make_inputs
from hopperbench.workloads import WorkloadSpec, load_workloads

W13_BYTES_PER_EXPERT = 4096 * 7168  # e4m3
W2_BYTES_PER_EXPERT = 7168 * 2048
GEMM1_ITEM_COLUMNS = 64  # WGMMA GEMM1 items per row tile (64 weight rows each)
GEMM2_ITEM_COLUMNS = 112  # WGMMA GEMM2 items per row tile (64 output columns each)
ACTIVATION_BYTES = 7168  # one token's e4m3 hidden state
INTERMEDIATE_BYTES = 2048 * 2  # one assignment's bf16 C row
ROUTING_INPUTS = ("routing_logits", "routing_bias", "local_expert_offset")


@dataclass(frozen=True)
class TileTraffic:
    """Row tiles of all experts at one tile width, and the bytes each GEMM reads through L2."""

    tile: int
    row_tiles: int
    gemm1_bytes: int
    gemm2_bytes: int


def tile_traffic(counts: Sequence[int], tile: int) -> TileTraffic:
    """`counts`: tokens per local expert. Each row tile reads its expert's weights once; each assignment
    is read once per item column (only valid rows are copied)."""
    row_tiles = sum((c + tile - 1) // tile for c in counts)
    assignments = sum(counts)
    return TileTraffic(
        tile=tile,
        row_tiles=row_tiles,
        gemm1_bytes=row_tiles * W13_BYTES_PER_EXPERT + GEMM1_ITEM_COLUMNS * assignments * ACTIVATION_BYTES,
        gemm2_bytes=row_tiles * W2_BYTES_PER_EXPERT + GEMM2_ITEM_COLUMNS * assignments * INTERMEDIATE_BYTES,
    )


def routing_counts(workload: WorkloadSpec, seed: int, trial: int, device: str) -> tuple[int, int, list[int]]:
    """(T, local_expert_offset, tokens per local expert) of one synthesized input set."""
    inputs = make_inputs("moe", workload, seed, trial, device, only=ROUTING_INPUTS)
    offset = int(inputs["local_expert_offset"])
    counts = local_expert_counts(inputs["routing_logits"], inputs["routing_bias"], offset)
    return workload.axes["seq_len"], offset, [int(c) for c in counts.tolist()]


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{what} must be non-negative integers, got {text!r}")
    return values


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line on stderr, not argparse's usage block
        print(f"moe_routing_stats: {message}", file=sys.stderr)
        raise SystemExit(2)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", type=lambda s: _int_list(s, "--workloads"), default=[4])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tiles", type=lambda s: _int_list(s, "--tiles"), default=[16, 32, 64])
    args = parser.parse_args(argv)
    if args.trials < 1 or 0 in args.tiles:
        parser.error("--trials and every tile must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parse_args(argv)
    except SystemExit as exit_:
        return 2 if exit_.code else 0
    workloads = load_workloads("moe")
    bad = [i for i in args.workloads if i >= len(workloads)]
    if bad:
        print(f"moe_routing_stats: workload indices {bad} out of range (the MoE list has {len(workloads)})", file=sys.stderr)
        return 2
    if args.device != "cpu" and not torch.cuda.is_available():
        print(f"moe_routing_stats: --device {args.device} needs CUDA", file=sys.stderr)
        return 2
    tile_columns = "".join(f"  {'tiles@' + str(t):>9} {'GEMM1 GB':>8} {'GEMM2 GB':>8}" for t in args.tiles)
    print(f"{'#':>3} {'T':>6} {'off':>4} {'trial':>5} {'active':>7} {'assign':>7} {'max':>4}{tile_columns}")
    for index in args.workloads:
        for trial in range(args.trials):
            num_tokens, offset, counts = routing_counts(workloads[index], args.seed, trial, args.device)
            active = sum(1 for c in counts if c)
            cells = "".join(
                f"  {tt.row_tiles:9d} {tt.gemm1_bytes / 1e9:8.2f} {tt.gemm2_bytes / 1e9:8.2f}"
                for tt in (tile_traffic(counts, t) for t in args.tiles)
            )
            print(f"{index:3d} {num_tokens:6d} {offset:4d} {trial:5d} {active:7d} {sum(counts):7d} {max(counts):4d}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
