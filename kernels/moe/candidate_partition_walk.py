"""MoE candidate v2.56 (NOTES.md, session 31): `kernel.py` v2.16 with MEDIUM_T's GEMM1 (193 to MEDIUM_T_MAX_TOKENS
tokens) walking its items partition by partition: the walk's SM index is the SM's rank with one L2 partition's SMs
first (`l2_partitions.partition_ranks`, measured on the device at the first call), and an expert's items run weight
tile by weight tile, so that the CTAs that read one weight tile at once sit on one partition's SMs.

Why: ncu puts v2.16's GEMM1 at 901 tokens on the fabric between the H200's two L2 partitions (86.7 %, session 31), and
the L2 replicates lines per partition (`tools/l2_partition_probe.py`): a weight tile read from both partitions crosses
the fabric once more than one read from a single partition. The items and their arithmetic are v2.16's, so the
outputs are bit for bit `kernel.py`'s (a GPU test).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import counters, kernel, l2_partitions
from .kernel import MoeShapeError, StreamingVariant
from .streaming_gemm import WALK_SLOT_WORDS

__all__ = ["PARTITION_WALK", "MoeShapeError", "compile_only", "run", "variant_for"]

PARTITION_WALK = dataclasses.replace(kernel.MEDIUM_T, gemm1_partition_walk=True)


def variant_for(num_tokens: int) -> StreamingVariant:
    """`kernel.py`'s variant, MEDIUM_T's GEMM1 with the partition walk."""
    chosen = kernel.variant_for(num_tokens)  # also rejects an empty batch
    return PARTITION_WALK if chosen is kernel.MEDIUM_T else chosen


def compile_only(arch: str = kernel.GPU_ARCH) -> tuple[Callable, ...]:
    """`kernel.py`'s configurations and this candidate's (with the zeroing of its longer walk buffer and the partition
    probe's kernels), for `arch` without a GPU."""
    return (
        *kernel.compile_only(arch),
        kernel.compiled_for(PARTITION_WALK, arch),
        counters.compiled_zero(arch, 2 * WALK_SLOT_WORDS),
        *l2_partitions.compiled_kernels(arch),
    )


# `kernel.py`'s contract, with this dispatch.
run = kernel.make_run(variant_for)
