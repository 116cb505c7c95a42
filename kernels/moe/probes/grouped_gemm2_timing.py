"""Time the compute-bound grouped GEMM2 (kernels/moe/grouped_gemm2.py) alone, in TFLOP/s of useful work.

    uv run kernels/moe/probes/grouped_gemm2_timing.py [--tokens 14107] [--iters 20]

Two routings of T tokens' local assignments, rows already grouped by expert (`check_cases.grouped_counts`: uniform
and skewed). C holds f16 times a power of two per row (as `c_to_f16.py` leaves it). Useful FLOP = 2 x rows x 2048 x
7168 (padding rows of a 128-row tile not counted). Prints one line per routing: median ms per call (CUDA events, after
warm-up), TFLOP/s, items. Exits 2 without CUDA, with one line on stderr.
"""

from __future__ import annotations

import argparse
import sys

import torch

from hopperbench.devcheck import load_folder_module, load_module_by_path, median_cuda_time_us
from hopperbench.paths import REPO_ROOT

cases = load_module_by_path(REPO_ROOT / "kernels/moe/check_cases.py", "moe_check_cases")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=14107)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("grouped_gemm2_timing: needs a CUDA device", file=sys.stderr)
        return 2
    grouped = load_folder_module(REPO_ROOT / "kernels" / "moe", "moe_solution", "grouped_gemm2")
    fn = grouped.compiled()
    hidden, k, e = grouped.HIDDEN, grouped.INTERMEDIATE, grouped.NUM_LOCAL_EXPERTS
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(e, hidden, k, device="cuda").to(torch.float8_e4m3fn)
    w_scale = torch.rand(e, hidden // 128, k // 128, device="cuda") * 0.01 + 0.005
    num_ctas = torch.cuda.get_device_properties(0).multi_processor_count
    for kind in ("uniform", "skewed"):
        counts = cases.grouped_counts(kind, args.tokens, gen)
        rows = sum(counts)
        c = (torch.randn(rows, k, device="cuda") * 2.0**12).half().view(torch.bfloat16)
        c_scale = torch.full((rows,), 2.0**-12, device="cuda")
        counts_d = torch.tensor(counts, dtype=torch.int32, device="cuda")
        out = torch.empty(rows, hidden, dtype=torch.float32, device="cuda")
        ms = median_cuda_time_us(lambda: fn(c, c_scale, w, w_scale, out, counts_d, num_ctas), 3, args.iters) / 1e3
        flop = 2.0 * rows * k * hidden
        items = sum((count + grouped.TILE_T - 1) // grouped.TILE_T for count in counts) * grouped.W_TILES
        print(f"{kind}: T={args.tokens} rows={rows} items={items} {ms:.3f} ms {flop / ms / 1e9:.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
