"""How precise GEMM2's output stays when the MoE's intermediate activation C (silu(gate) * up, one expert) is
stored as bf16 (`kernel.py`), as one e4m3 term per (token, group of columns) with its own scale (what a
tensor-core FP8 GEMM2 reads, DeepGEMM's choice), as two such terms (hi + lo: the residual quantised
again: what an FP8 warpgroup-MMA GEMM2 without conversions would read), or as f16 with one power-of-two scale
per token (what an `mma.sync` GEMM2 reads whose e4m3 weights are converted once per pair instead of four times;
NOTES.md's ideas table has its measured outcome).

    uv run kernels/moe/probes/moe_activation_numerics.py [--tokens 64] [--seeds 0,1,2] [--groups 32,128]

On the CPU, in fp32: random hidden states and block-scaled e4m3 weights (W13, W2 of one expert, 128 x 128
scale blocks as the definition's), C in fp32, and per format the relative L2 error of O = C W2^T against
fp32 C. Prints one row per seed and format. Exits 2 on bad arguments, with one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

E4M3_MAX = 448.0
HIDDEN, INTERMEDIATE, BLOCK = 7168, 2048, 128


def e4m3(values: torch.Tensor) -> torch.Tensor:
    """`values` rounded to e4m3 (saturating), back in fp32."""
    return values.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def quantise_groups(c: torch.Tensor, terms: int, group: int) -> torch.Tensor:
    """C as the sum of `terms` e4m3 terms, each with one scale per (row, `group` columns): the first term
    quantises C, each next one the residual of the terms before (amax scaling, an all-zero group stays 0)."""
    rows, columns = c.shape
    if columns % group:
        raise ValueError(f"group {group} must divide the {columns} columns")
    rest = c.reshape(rows, columns // group, group).clone()
    total = torch.zeros_like(rest)
    for _ in range(terms):
        scale = rest.abs().amax(dim=2, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / E4M3_MAX
        term = e4m3(rest / scale) * scale
        total += term
        rest -= term
    return total.reshape(rows, columns)


def f16_per_row(c: torch.Tensor) -> torch.Tensor:
    """C as f16 with one power-of-two scale per row that puts the row's amax in [2^14, 2^15): exact
    scaling, f16's 11-bit significand, and room below f16's maximum (65504). An all-zero row stays 0."""
    amax = c.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - 14)
    return (c / scale).half().float() * scale


def block_scaled_weights(rows: int, columns: int, generator: torch.Generator) -> torch.Tensor:
    """A random weight matrix as the definition stores it: e4m3 with one fp32 scale per 128 x 128 block."""
    weights = torch.randn(rows, columns, generator=generator) * 0.02
    blocks = weights.reshape(rows // BLOCK, BLOCK, columns // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True) / E4M3_MAX
    return (e4m3(blocks / scale) * scale).reshape(rows, columns)


def relative_l2(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).norm() / reference.norm())


def errors(tokens: int, seed: int, groups: Sequence[int]) -> dict[str, float]:
    """Relative L2 error of one expert's GEMM2 output per format of C, against fp32 C."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    projected = x @ block_scaled_weights(2 * INTERMEDIATE, HIDDEN, generator).T
    c = torch.nn.functional.silu(projected[:, INTERMEDIATE:]) * projected[:, :INTERMEDIATE]  # gate: 2nd half
    w2 = block_scaled_weights(HIDDEN, INTERMEDIATE, generator)
    reference = c @ w2.T
    result = {
        "bf16": relative_l2(c.to(torch.bfloat16).float() @ w2.T, reference),
        "f16 /token": relative_l2(f16_per_row(c) @ w2.T, reference),
    }
    for group in groups:
        for terms in (1, 2):
            result[f"e4m3 x{terms} /{group}"] = relative_l2(quantise_groups(c, terms, group) @ w2.T, reference)
    return result


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < 0:
        raise ValueError(text)
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the expert (default 64)")
    parser.add_argument("--seeds", default="0,1,2", help="comma list (default 0,1,2)")
    parser.add_argument("--groups", default="32,128", help="columns per scale, comma list dividing 2048")
    args = parser.parse_args(argv)
    try:
        seeds, groups = _int_list(args.seeds), _int_list(args.groups)
        if args.tokens < 1 or any(g < 1 or INTERMEDIATE % g for g in groups):
            raise ValueError
    except ValueError:
        print("moe_activation_numerics: --tokens must be >= 1, --seeds and --groups comma lists of "
              "non-negative integers, each group dividing 2048", file=sys.stderr)
        return 2
    print(f"{'seed':>4}  {'format':<14} rel L2 of O = C W2^T against fp32 C ({args.tokens} tokens)")
    for seed in seeds:
        for name, error in errors(args.tokens, seed, groups).items():
            print(f"{seed:>4}  {name:<14} {error:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
