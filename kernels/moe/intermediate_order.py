"""The column order of the intermediate C (GEMM1 + SwiGLU output, GEMM2's activation) when GEMM2 runs on
warpgroup MMA with its weights converted in registers (`wgmma_gemm2.py`).

GEMM2's A operand (64 weight rows x k16) comes from registers in the warpgroup MMA's fragment layout:
thread (warp w, group g, quad t) holds rows 16 w + g and + 8 at K slots 2 t, 2 t + 1, 2 t + 8, 2 t + 9
(as `mma.sync` m16n8k16; traced from CuTe's `tv_layout_A` in the tests). A sum over K does not care about
the order of K as long as both operands use the same one, so each thread reads its weights for two k16
steps as 8 contiguous bytes, natural K 32 j + 8 t .. + 7 of a 32-wide group j, and the B operand (C, read
by the tensor core from shared memory as it lies) must hold at K slot L of the group the column that the
weight byte feeding slot L multiplies: `natural_column(L)`. GEMM1 writes its natural column c of a group
to `stored_position(c)`, so a plain copy of C puts every column where GEMM2 needs it. GEMM1's items cover
32 columns each, exactly one group, so the permutation never crosses an item.

Plain arithmetic (the kernels call these with DSL integers, the tests with Python ints).
"""

from __future__ import annotations

GROUP = 32  # K columns per permutation group: two k16 steps


def natural_column(slot):
    """The natural column (0..31 in its group) that K slot `slot` of the group holds in stored order:
    slot 16 s + l of k16 step s, l = 2 t + e or 2 t + 8 + e, comes from byte 8 t + 4 s (+ 2) + e of
    thread t's 8-byte load."""
    step = slot // 16
    lane_slot = slot % 16
    quad = (lane_slot % 8) // 2
    return 8 * quad + 4 * step + 2 * (lane_slot // 8) + lane_slot % 2


def stored_position(column):
    """Inverse of `natural_column`: where natural column `column` (0..31) of a group is stored."""
    quad = column // 8
    step = (column // 4) % 2
    high = (column // 2) % 2
    return 16 * step + 2 * quad + 8 * high + column % 2
