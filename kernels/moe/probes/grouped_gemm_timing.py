"""Time the compute-bound grouped GEMMs alone, in TFLOP/s of useful work: GEMM1 + SwiGLU
(kernels/moe/grouped_wgmma.py) and GEMM2 (kernels/moe/grouped_gemm2.py), or DeepGEMM's at the same shapes.

    uv run kernels/moe/probes/grouped_gemm_timing.py [--gemm 1 2] [--tokens 14107] [--iters 20] [--side deepgemm]

Two routings of T tokens' local assignments, rows already grouped by expert (`check_cases.grouped_counts`: uniform
and skewed). GEMM2's C holds f16 times a power of two per row (as `c_to_f16.py` leaves it). Useful FLOP = 2 x rows x
7168 x 4096 (GEMM1) or x 2048 (GEMM2); padding rows of a 128-row tile not counted. Prints one line per GEMM and
routing: median ms per call (the call replayed from a CUDA graph, CUDA events around each replay, after warm-up;
warm L2), TFLOP/s, items. `--side deepgemm`: DeepGEMM's `m_grouped_fp8_gemm_nt_contiguous` on the same counts as
its users run it (each expert's rows padded to its alignment, 1 x 128 activation scales; GEMM1 without SwiGLU,
GEMM2 on FP8 C, both bf16 out), through the `deepgemm_grouped` side's loader. Exits 2 without CUDA or without that
library, with one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from hopperbench.devcheck import capture_graph, load_folder_module, load_module_by_path, median_cuda_time_us
from hopperbench.paths import REPO_ROOT

cases = load_module_by_path(REPO_ROOT / "kernels/moe/check_cases.py", "moe_check_cases")
MODULES = {1: "grouped_wgmma", 2: "grouped_gemm2"}


def gemm1_call(grouped, counts: list[int]) -> tuple[Callable[[int], object], float, int]:
    """GEMM1 on random e4m3 rows and weights: (call(num_ctas), useful FLOP, items)."""
    hidden, n, e = grouped.HIDDEN, 2 * grouped.INTERMEDIATE, grouped.NUM_LOCAL_EXPERTS
    w = torch.randn(e, n, hidden, device="cuda").to(torch.float8_e4m3fn)
    w_scale = torch.rand(e, n // 128, hidden // 128, device="cuda") * 0.01 + 0.005
    rows = (sum(counts) + 3) // 4 * 4
    a = torch.randn(rows, hidden, device="cuda").to(torch.float8_e4m3fn)
    a_scale = torch.rand(hidden // 128, rows, device="cuda") + 0.5
    out = torch.empty(rows, grouped.INTERMEDIATE, dtype=torch.bfloat16, device="cuda")
    c = torch.tensor(counts, dtype=torch.int32, device="cuda")
    fn = grouped.compiled()
    items = sum((count + grouped.TILE_M - 1) // grouped.TILE_M for count in counts) * grouped.N_TILES
    return lambda num_ctas: fn(a, a_scale, w, w_scale, out, c, num_ctas), 2.0 * sum(counts) * hidden * n, items


def gemm2_call(grouped, counts: list[int]) -> tuple[Callable[[int], object], float, int]:
    """GEMM2 on random f16 C (times 2^-12 per row) and e4m3 weights: (call(num_ctas), useful FLOP, items)."""
    hidden, k, e = grouped.HIDDEN, grouped.INTERMEDIATE, grouped.NUM_LOCAL_EXPERTS
    w = torch.randn(e, hidden, k, device="cuda").to(torch.float8_e4m3fn)
    w_scale = torch.rand(e, hidden // 128, k // 128, device="cuda") * 0.01 + 0.005
    rows = sum(counts)
    c = (torch.randn(rows, k, device="cuda") * 2.0**12).half().view(torch.bfloat16)
    c_scale = torch.full((rows,), 2.0**-12, device="cuda")
    counts_d = torch.tensor(counts, dtype=torch.int32, device="cuda")
    out = torch.empty(rows, hidden, dtype=torch.float32, device="cuda")
    fn = grouped.compiled()
    items = sum((count + grouped.TILE_T - 1) // grouped.TILE_T for count in counts) * grouped.W_TILES
    return lambda num_ctas: fn(c, c_scale, w, w_scale, out, counts_d, num_ctas), 2.0 * rows * k * hidden, items


CALLS = {1: gemm1_call, 2: gemm2_call}


def deepgemm_call(deep_gemm, grouped, which: int, counts: list[int]) -> tuple[Callable[[int], object], float, int]:
    """DeepGEMM's grouped GEMM `which` (1: x W13^T, 2: C W2^T) on random e4m3 rows in its contiguous layout:
    (call, useful FLOP, 128-row blocks of the padded layout)."""
    hidden, inter, e = grouped.HIDDEN, grouped.INTERMEDIATE, grouped.NUM_LOCAL_EXPERTS
    n, k = (2 * inter, hidden) if which == 1 else (hidden, inter)
    align = int(deep_gemm.get_mk_alignment_for_contiguous_layout())
    padded = [(count + align - 1) // align * align for count in counts]
    m_indices = torch.cat(
        [torch.tensor([expert] * count + [-1] * (size - count), dtype=torch.int32) for expert, (count, size) in
         enumerate(zip(counts, padded))]
    ).cuda()  # fmt: skip
    rows = sum(padded)
    a = torch.randn(rows, k, device="cuda").to(torch.float8_e4m3fn)
    a_scale = (torch.rand(rows, k // 128, device="cuda") + 0.5).T.contiguous().T  # MN-major, as its users pass them
    w = torch.randn(e, n, k, device="cuda").to(torch.float8_e4m3fn)
    w_scale = torch.rand(e, n // 128, k // 128, device="cuda") * 0.01 + 0.005
    out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")

    def call(_num_ctas: int) -> None:
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, a_scale), (w, w_scale), out, m_indices)

    return call, 2.0 * sum(counts) * n * k, rows // 128


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gemm", type=int, nargs="+", choices=sorted(MODULES), default=sorted(MODULES))
    parser.add_argument("--tokens", type=int, default=14107)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--side", choices=("ours", "deepgemm"), default="ours")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("grouped_gemm_timing: needs a CUDA device", file=sys.stderr)
        return 2
    deep_gemm = None
    if args.side == "deepgemm":
        from hopperbench.tracks.moe.adapters import deepgemm_moe

        try:
            deep_gemm = deepgemm_moe.load_deep_gemm()
        except deepgemm_moe.LibraryUnavailableError as error:
            print(f"grouped_gemm_timing: {error}", file=sys.stderr)
            return 2
    num_ctas = torch.cuda.get_device_properties(0).multi_processor_count
    for which in args.gemm:
        grouped = load_folder_module(REPO_ROOT / "kernels" / "moe", "moe_solution", MODULES[which])
        gen = torch.Generator().manual_seed(0)
        for kind in ("uniform", "skewed"):
            counts = cases.grouped_counts(kind, args.tokens, gen)
            if deep_gemm is None:
                call, flop, items = CALLS[which](grouped, counts)
            else:
                call, flop, items = deepgemm_call(deep_gemm, grouped, which, counts)
            graph = capture_graph(lambda: call(num_ctas))
            ms = median_cuda_time_us(graph.replay, 3, args.iters) / 1e3
            print(
                f"{args.side} GEMM{which} {kind}: T={args.tokens} rows={sum(counts)} items={items} {ms:.3f} ms "
                f"{flop / ms / 1e9:.0f} TFLOP/s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
