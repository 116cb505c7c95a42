"""Index maps of the single-warp `mma.sync` m16n8k16 kernels (chunked.py's family, warp_chain.py), checked on the CPU.

MMA and ldmatrix maps come from CuTe-DSL's layout algebra, traced with static lane numbers (nothing is compiled for
or run on a GPU), and are checked against the PTX ISA: mma.m16n8k16 .row.col f16 fragments (groupID = lane // 4,
threadID_in_group = lane % 4) and ldmatrix .x4 (lane 8m + r gives the address of row r of matrix m; register m of
lane t receives row t // 4, columns 2 (t % 4) + {0, 1} of matrix m, or with .trans its columns t // 4 of rows
2 (t % 4) + {0, 1}).
"""

from __future__ import annotations

from collections.abc import Callable

import cutlass.cute as cute


def trace(body) -> list:
    """What `body(records)` appends while CuTe-DSL traces it (static layouts only, nothing launched)."""
    records: list = []

    @cute.jit
    def probe():
        body(records)

    cute.compile(probe)
    return records


def coords(tensor) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in tensor[i]) for i in range(cute.size(tensor))]


def isa_a(lane: int, i: int) -> tuple[int, int]:  # (m, k) of a_i
    group, tig = divmod(lane, 4)
    return group + 8 * ((i // 2) % 2), 2 * tig + i % 2 + 8 * (i // 4)


def isa_b(lane: int, i: int) -> tuple[int, int]:  # (n, k) of b_i
    group, tig = divmod(lane, 4)
    return group, 2 * tig + i % 2 + 8 * (i // 2)


def isa_c(lane: int, i: int) -> tuple[int, int]:  # (m, n) of c_i / d_i
    group, tig = divmod(lane, 4)
    return group + 8 * (i // 2), 2 * tig + i % 2


def check_atom_blocks(per_lane: list[list[tuple[int, int]]], isa, atom_values: int, origins: list) -> None:
    """Every block of `atom_values` fragment values is one MMA atom's operand in the ISA's layout,
    at the atom origins expected in this order (the rest modes of the fragment, colexicographic)."""
    assert len(per_lane[0]) == atom_values * len(origins)
    for block, (row0, col0) in enumerate(origins):
        for lane, values in enumerate(per_lane):
            for i in range(atom_values):
                row, col = isa(lane, i)
                assert values[block * atom_values + i] == (row0 + row, col0 + col), (block, lane, i)


def origins(rows: int, cols: int, row_step: int, col_step: int, base=(0, 0)) -> list[tuple[int, int]]:
    return [(base[0] + r, base[1] + c) for c in range(0, cols, col_step) for r in range(0, rows, row_step)]


def offset(coord, view) -> int:
    return sum(c * s for c, s in zip(coord, view[1]))


def ldmatrix_source(bases: list[int], lane: int, value: int, transposed: bool) -> int:
    """The shared-memory element (offset) that ldmatrix .x4 puts in `value` (register value // 2,
    half value % 2) of `lane`, given the row address (element offset) each lane supplied."""
    matrix, half = divmod(value, 2)
    group, tig = divmod(lane, 4)
    if transposed:
        return bases[8 * matrix + 2 * tig + half] + group
    return bases[8 * matrix + group] + 2 * tig + half


def check_ldmatrix_operand(
    make_warp_mma: Callable, make_operand_copies: Callable, what: str, role: str, view, tile_shape, tile_coords
) -> None:
    """A warp-GEMM operand read through ldmatrix: role "A" (K-major A), "B" (K-major B) or "Bt" (N-major B, .trans)
    of the tiles `tile_coords` of shape `tile_shape` of the shared-memory `view` ((shape, stride) in elements).
    Each lane's ldmatrix rows are 8 consecutive 16-B aligned elements inside the buffer, ldmatrix puts into each
    register exactly the element CuTe assigns to that fragment slot, and the fragments hold every element of the tile
    once, as MMA atoms in the ISA layout."""
    shape, stride = view
    cosize = sum((n - 1) * s for n, s in zip(shape, stride)) + 1

    def body(records):
        tiled_mma = make_warp_mma()
        copy_a, copy_b, copy_bt = make_operand_copies(tiled_mma)
        tiled_copy = {"A": copy_a, "B": copy_b, "Bt": copy_bt}[role]
        for tile_coord in tile_coords:
            tile = cute.local_tile(cute.make_identity_tensor(shape), tile_shape, tile_coord)
            lanes = []
            for lane in range(32):
                thr_mma = tiled_mma.get_slice(lane)
                thr_copy = tiled_copy.get_slice(lane)
                fragment = thr_mma.partition_A(tile) if role == "A" else thr_mma.partition_B(tile)
                views = (thr_copy.partition_S(tile), thr_copy.retile(fragment), fragment)
                lanes.append(tuple(coords(v) for v in views))
            records.append((tile_coord, lanes))

    for tile_coord, lanes in trace(body):
        origin = tuple(c * t for c, t in zip(tile_coord, tile_shape))
        sources = [[offset(c, view) for c in src] for src, _, _ in lanes]
        num_values = len(sources[0])
        assert num_values % 8 == 0 and all(len(s) == num_values for s in sources)
        for src in sources:
            for first in range(0, num_values, 8):
                assert src[first : first + 8] == list(range(src[first], src[first] + 8)), what
                assert (2 * src[first]) % 16 == 0 and 0 <= src[first] and src[first] + 8 <= cosize, what
        for first in range(0, num_values, 8):
            bases = [sources[lane][first] for lane in range(32)]
            for lane in range(32):
                for value in range(8):
                    loaded = ldmatrix_source(bases, lane, value, transposed=role == "Bt")
                    assert loaded == offset(lanes[lane][1][first + value], view), (what, tile_coord, lane, value)
        everything = sorted(c for _, _, fragment in lanes for c in fragment)
        rows, cols = tile_shape
        assert everything == [(origin[0] + r, origin[1] + c) for r in range(rows) for c in range(cols)], what
        if role == "A":
            check_atom_blocks([f for _, _, f in lanes], isa_a, 8, origins(rows, cols, 16, 16, origin))
        else:
            check_atom_blocks([f for _, _, f in lanes], isa_b, 4, origins(rows, cols, 8, 16, origin))
