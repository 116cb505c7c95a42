"""The chunked tensor-core GDN prefill kernel (kernels/gdn_prefill/chunked.py, whose chunk step the WY path reuses)
and its model.

CPU: it compiles for sm_90a; `run` validates like the token-serial path;
the tiling constants cover the state and the chunk; the MMA fragments CuTe-DSL builds are the PTX
ISA's m16n8k16 layouts, every accumulator-to-(row, col) map covers its tile once, and an emulation
of ldmatrix (.x4, .trans) on every shared-memory operand view of the kernel puts exactly the right
element in every fragment register; the kernel's per-warp tile schedule, transcribed phase by phase
(float64, NaN for unwritten shared memory, race checks between barriers), reproduces the model's
chunk step for full and partial chunks; the copy loops cover their tiles once; the PyTorch model of the chunked math
(chunked_model.py) matches the token-serial reference in float64 (the algebra: orientation,
decays, masking of partial chunks, the blocked inverse) and, with the kernel's fp16 operand
rounding, passes the track's acceptance rule with a wide margin on long-memory and fast-decay gates.
The base-2 decays the kernel keeps (G times log2(e), one 2^x per factor) are the same factors.
GPU: the GPU tests of tests/kernels/test_gdn_prefill_kernel.py run `chunked.run` too (every check
case against the reference, the input state untouched, CUDA-graph replay with new bounds).
"""

from __future__ import annotations

import math
import zlib

import cutlass
import cutlass.cute as cute
import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT
from tests.kernels import warp_mma_layouts as layouts
from tests.kernels.compile_checks import assert_compiles_and_caches

cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
device_check = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/probes/device_check_gdn.py", "device_check_gdn")
chunked = device_check.load_kernel_module("chunked")  # imports its sibling token_serial.py as a package would
model = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/chunked_model.py", "gdn_chunked_model")
reference_run = cases.load_reference_run()


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(chunked.compile_only, 1)


# Lengths around the chunk size, with and without a state, in both gate regimes.
MODEL_CASES = [
    cases.CheckCase("m_len1_state", (1,), True, 0.0, "mamba2"),
    cases.CheckCase("m_len63_64_65_state", (63, 64, 65), True, 0.05, "mamba2"),
    cases.CheckCase("m_len63_64_65_nostate_fast", (63, 64, 65), False, 0.0, "fast_decay"),
    cases.CheckCase("m_len200_0_7_state", (200, 0, 7), True, 0.0, "mamba2"),
    cases.CheckCase("m_len200_fast_state", (200,), True, 0.05, "fast_decay"),
]


def _case_inputs(case, seed: int | None = None):
    return cases.make_inputs(case, "cpu", seed=zlib.crc32(case.name.encode()) % 1000 if seed is None else seed)


# ------------------------------------------------------------------------------------------------
# CPU: the kernel
# ------------------------------------------------------------------------------------------------


def test_base2_decays_are_the_same_factors():
    # G in units of log2(e) and 2^x give exp(G): the identity the kernel's decays rely on.
    G = torch.tensor([0.0, -0.3, -7.5, -80.0], dtype=torch.float64)
    assert torch.allclose(torch.exp2(G * chunked.LOG2_E), torch.exp(G), rtol=1e-12)


def test_tiling_covers_state_and_chunk():
    assert chunked.NUM_SLICES * chunked.SLICE_ROWS == chunked.HEAD_SIZE == model.HEAD_SIZE
    assert chunked.NUM_WARPS * chunked.STATE_COLS_PER_WARP == chunked.HEAD_SIZE
    assert chunked.NUM_WARPS * chunked.BLOCK == chunked.CHUNK == model.CHUNK
    assert chunked.BLOCK == model.BLOCK
    # The Gram tiles: warp w takes k-block w (w + 1 tiles) and q-block 3 - w (4 - w tiles), which
    # is every tile of both lower triangles, five per warp.
    tiles = [("k", w, c) for w in range(chunked.NUM_WARPS) for c in range(w + 1)]
    tiles += [
        ("q", chunked.NUM_BLOCKS - 1 - w, c) for w in range(chunked.NUM_WARPS) for c in range(chunked.NUM_BLOCKS - w)
    ]
    lower = {(r, c) for r in range(chunked.NUM_BLOCKS) for c in range(r + 1)}
    assert {(r, c) for kind, r, c in tiles if kind == "k"} == lower
    assert {(r, c) for kind, r, c in tiles if kind == "q"} == lower
    # fp16 rows that ldmatrix reads start 16-B aligned and are odd multiples of 16 B (no conflicts).
    for stride in (chunked.WIDE_STRIDE, chunked.NARROW_STRIDE, chunked.SCRATCH_STRIDE):
        assert (2 * stride) % 16 == 0 and (2 * stride // 16) % 2 == 1


def test_run_rejects_bad_inputs_with_one_line_errors():
    case = next(c for c in cases.CASES if c.name == "len6_state_scale05")
    inputs = cases.make_inputs(case, "cpu", seed=1)
    output, new_state = cases.poisoned_outputs(case, "cpu")
    bad = dict(inputs, cu_seqlens=inputs["cu_seqlens"].int())
    with pytest.raises(chunked.GdnShapeError, match="cu_seqlens") as info:
        chunked.run(*bad.values(), output, new_state)
    assert "\n" not in str(info.value)
    transposed = dict(inputs, state=inputs["state"].transpose(2, 3))
    with pytest.raises(chunked.GdnShapeError, match="state"):
        chunked.run(*transposed.values(), output, new_state)
    with pytest.raises(chunked.GdnShapeError, match="output"):
        chunked.run(*inputs.values(), torch.empty(6, 4, 128, dtype=torch.bfloat16), new_state)


# ------------------------------------------------------------------------------------------------
# CPU: the kernel's index maps, against the PTX ISA (tests/kernels/warp_mma_layouts.py).
# ------------------------------------------------------------------------------------------------


def test_mma_fragments_are_the_ptx_isa_layouts():
    def body(records):
        tiled_mma = chunked._make_warp_mma()
        for lane in range(32):
            thr = tiled_mma.get_slice(lane)
            tile = cute.make_identity_tensor((chunked.BLOCK, chunked.BLOCK))
            fragments = (thr.partition_A(tile), thr.partition_B(tile), thr.partition_C(tile))
            records.append(tuple(layouts.coords(f) for f in fragments))

    records = layouts.trace(body)
    layouts.check_atom_blocks([r[0] for r in records], layouts.isa_a, 8, [(0, 0)])
    layouts.check_atom_blocks([r[1] for r in records], layouts.isa_b, 4, [(0, 0), (8, 0)])  # two n8 atoms
    layouts.check_atom_blocks([r[2] for r in records], layouts.isa_c, 4, [(0, 0), (0, 8)])


@pytest.mark.parametrize("shape", [(16, 16), (16, 32), (32, 32)], ids=str)
def test_accumulator_coordinates_cover_each_tile_once(shape):
    # coords_sq, coords_rows and coords_state: the (row, col) each accumulator register is stored to
    # (A, P, Xb^T, V'^T, T blocks, output, state): every element exactly once, atoms in ISA layout.
    def body(records):
        tiled_mma = chunked._make_warp_mma()
        for lane in range(32):
            coords = tiled_mma.get_slice(lane).partition_C(cute.make_identity_tensor(shape))
            size = cute.size(cute.make_rmem_tensor(tiled_mma.get_slice(lane).partition_shape_C(shape), cutlass.Float32))
            records.append((layouts.coords(coords), size))

    records = layouts.trace(body)
    per_lane = [r[0] for r in records]
    assert all(size == len(values) for values, size in zip(per_lane, (r[1] for r in records)))
    everything = [c for values in per_lane for c in values]
    assert sorted(everything) == [(r, c) for r in range(shape[0]) for c in range(shape[1])]
    layouts.check_atom_blocks(per_lane, layouts.isa_c, 4, layouts.origins(shape[0], shape[1], 16, 8))


def _view_2d(view, drop_leading: bool = False):
    shape, stride = view
    return (shape[1:], stride[1:]) if drop_leading else (shape, stride)


SCRATCH_2D = _view_2d(chunked.SCRATCH_VIEW, drop_leading=True)

# Every warp_gemm operand of the kernel: (what, role, view, tile shape, tile coordinates used).
# role A: ldmatrix, K-major A; B: ldmatrix, K-major B; Bt: ldmatrix.trans, N-major B.
LDMATRIX_OPERANDS = [
    ("k and q rows: Gram A, K S0^T, Q S0^T", "A", chunked.KQ_VIEW, (16, 128), [(3, 0), (4, 0)]),
    ("T diagonal block (P3)", "A", chunked.SQUARE_VIEW, (16, 16), [(1, 1), (3, 3)]),
    ("T_B rows (P4)", "A", chunked.SQUARE_VIEW, (16, 32), [(2, 1), (3, 1)]),
    ("T rows (P5), P rows (P6)", "A", chunked.SQUARE_VIEW, (16, 64), [(0, 0), (3, 0)]),
    ("scratch (P3)", "A", SCRATCH_2D, (16, 16), [(0, 0)]),
    ("scratch (P4)", "A", SCRATCH_2D, (16, 32), [(0, 0)]),
    ("V'c^T (state update)", "A", chunked.SLICE_BY_TOKEN_VIEW, (32, 64), [(0, 0)]),
    ("k rows: Gram B", "B", chunked.KQ_VIEW, (16, 128), [(0, 0), (3, 0)]),
    ("S0 in fp16: K S0^T, Q S0^T", "B", chunked.STATE16_VIEW, (32, 128), [(0, 0)]),
    ("Xb^T (P5), V'^T (P6)", "B", chunked.SLICE_BY_TOKEN_VIEW, (32, 64), [(0, 0)]),
    ("A_hl read transposed (P3)", "Bt", chunked.SQUARE_T_VIEW, (16, 16), [(0, 1), (2, 3)]),
    ("T_ll read transposed (P3)", "Bt", chunked.SQUARE_T_VIEW, (16, 16), [(0, 0), (2, 2)]),
    ("A_BA read transposed (P4)", "Bt", chunked.SQUARE_T_VIEW, (32, 32), [(0, 1)]),
    ("T_A read transposed (P4)", "Bt", chunked.SQUARE_T_VIEW, (16, 32), [(0, 0), (1, 0)]),
    ("K read transposed (state update)", "Bt", chunked.KQ_T_VIEW, (32, 64), [(0, 0), (3, 0)]),
    # The same slice operands at 16 rows (the narrow slices of wy_prepass.py's chain).
    ("V'c^T, 16-row slice", "A", ((16, chunked.CHUNK), (chunked.NARROW_STRIDE, 1)), (16, 64), [(0, 0)]),
    ("S0 in fp16, 16-row slice", "B", ((16, chunked.HEAD_SIZE), (chunked.WIDE_STRIDE, 1)), (16, 128), [(0, 0)]),
    ("Xb^T, V'^T, 16-row slice", "B", ((16, chunked.CHUNK), (chunked.NARROW_STRIDE, 1)), (16, 64), [(0, 0)]),
]


@pytest.mark.parametrize("operand", LDMATRIX_OPERANDS, ids=lambda o: o[0])
def test_ldmatrix_loads_give_the_mma_fragments(operand):
    layouts.check_ldmatrix_operand(chunked._make_warp_mma, chunked._make_operand_copies, *operand)


def test_scratch_and_buffers_keep_ldmatrix_rows_aligned():
    # Per-warp scratch bases and every fp16 row stride read by ldmatrix are multiples of 16 B.
    for warp_idx in range(chunked.NUM_WARPS):
        assert (2 * warp_idx * chunked.SCRATCH_VIEW[1][0]) % 16 == 0
    for view in (chunked.KQ_VIEW, chunked.SQUARE_VIEW, chunked.STATE16_VIEW, chunked.SLICE_BY_TOKEN_VIEW, SCRATCH_2D):
        assert (2 * view[1][0]) % 16 == 0
    for view in (chunked.KQ_T_VIEW, chunked.SQUARE_T_VIEW):
        assert (2 * view[1][1]) % 16 == 0


# The kernel's shared buffers as (storage region, element offset, shape, row stride), the padded
# strides of the kernel's views. Buffers in one region share storage (the kernel's aliases), so a
# transcription that reads an alias while its partner is live sees the partner's values or NaN,
# and the race check sees both.
def _buffers(rows: int = chunked.SLICE_ROWS) -> dict[str, tuple[str, int, tuple[int, int], int]]:
    """At `rows` V rows per CTA (chunked.py's 32, or a subclass's 16)."""
    C, B, W = chunked.CHUNK, chunked.BLOCK, chunked.NUM_WARPS
    wide, narrow = chunked.WIDE_STRIDE, chunked.NARROW_STRIDE
    buffers = {
        "kq": ("kq", 0, (2 * C, chunked.HEAD_SIZE), wide),
        "a16": ("a16", 0, (C, C), narrow),
        "a_diag": ("a_diag", 0, (C, B), chunked.DIAG_STRIDE),
        "t16": ("t16", 0, (C, C), narrow),
        "p16": ("p16", 0, (C, C), narrow),
        "s16": ("s16", 0, (rows, chunked.HEAD_SIZE), wide),
        "xb_t": ("xb_t", 0, (rows, C), narrow),
        # V'^T and V'c^T in A's storage, the inverse's scratch in the fp16 state copy's.
        "vn_t": ("a16", 0, (rows, C), narrow),
        "vnc_t": ("a16", rows * narrow, (rows, C), narrow),
        "scratch": ("s16", 0, (W * B, chunked.SCRATCH_COLS), chunked.SCRATCH_STRIDE),
        "cum_log_g": ("cum_log_g", 0, (1, C), C),
        "beta": ("beta", 0, (1, C), C),
    }
    return buffers


ASYNC_COPY = chunked.NUM_WARPS  # the agent index of cp.async copies in flight: they race with every warp


class _SharedMemory:
    """float64 stand-ins for the kernel's shared storage, NaN where nothing was written (so that a
    read of an unwritten element poisons the result), with per-warp read/write masks per phase
    (between two barriers), so that a cross-warp race inside a phase is an assertion error. Buffers
    are strided views of their storage region, so aliased buffers share elements."""

    def __init__(self, buffers: dict[str, tuple[str, int, tuple[int, int], int]]):
        self.buffers = buffers
        sizes: dict[str, int] = {}
        for region, offset, (rows, cols), stride in buffers.values():
            sizes[region] = max(sizes.get(region, 0), offset + (rows - 1) * stride + cols)
        self.storage = {region: torch.full((size,), math.nan, dtype=torch.float64) for region, size in sizes.items()}
        self.data = {name: self._view(self.storage[name_region[0]], name) for name, name_region in buffers.items()}
        self._start_phase()

    def _view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        _, offset, shape, stride = self.buffers[name]
        return flat.as_strided(shape, (stride, 1), offset)

    def _start_phase(self) -> None:
        agents = chunked.NUM_WARPS + 1  # the warps and the async copies
        self.reads = {r: [torch.zeros_like(f, dtype=torch.bool) for _ in range(agents)] for r, f in self.storage.items()}
        self.writes = {r: [torch.zeros_like(f, dtype=torch.bool) for _ in range(agents)] for r, f in self.storage.items()}

    def _mark(self, masks, agent: int, name: str, index) -> None:
        self._view(masks[self.buffers[name][0]][agent], name)[index] = True

    def barrier(self) -> None:
        """sync_threads: no element written by one agent may be touched by another in the phase."""
        agents = chunked.NUM_WARPS + 1
        for region in self.storage:
            for w in range(agents):
                touched = self.reads[region][w] | self.writes[region][w]
                for other in range(agents):
                    if other != w:
                        assert not (touched & self.writes[region][other]).any(), f"race on {region}: {w}, {other}"
        self._start_phase()

    def tile(self, warp_idx: int, name: str, shape, coord, transposed: bool = False) -> torch.Tensor:
        """cute.local_tile(view, shape, coord) of the buffer, or of its transposed view (`_t`)."""
        rows, cols = (shape[1], shape[0]) if transposed else shape
        r0, c0 = (coord[1] * rows, coord[0] * cols) if transposed else (coord[0] * rows, coord[1] * cols)
        index = (slice(r0, r0 + rows), slice(c0, c0 + cols))
        self._mark(self.reads, warp_idx, name, index)
        value = self.data[name][index].clone()
        return value.T if transposed else value

    def read(self, warp_idx: int, name: str, index) -> torch.Tensor:
        self._mark(self.reads, warp_idx, name, index)
        value = self.data[name][index]
        return value.clone() if isinstance(value, torch.Tensor) else value

    def write(self, warp_idx: int, name: str, index, value) -> None:
        self._mark(self.writes, warp_idx, name, index)
        self.data[name][index] = value


def _emulate_chunk_step(S0, q, k, v, log_g, beta, tokens_here: int):
    """One CTA's chunk step transcribed phase by phase from chunked.py (the warps' tile schedule,
    the masks, the buffers read and written), in float64. S0 [rows, 128] is the state slice (rows 32,
    or 16 for a narrow subclass); q, k [64, 128], v [64, rows], log_g and beta [64] hold garbage (NaN)
    past `tokens_here`, as the staging buffers do. Returns (O [64, rows] unscaled, S_next [rows, 128]).
    The next chunk's q rows are copied (NaN here: they are not this chunk's) into the q half of kq by
    cp.async from P2 until the next chunk's P0."""
    C, B, W = chunked.CHUNK, chunked.BLOCK, chunked.NUM_WARPS
    num_rows = S0.shape[0]
    smem = _SharedMemory(_buffers(num_rows))

    def next_q_in_flight() -> None:
        smem.write(ASYNC_COPY, "kq", (slice(C, 2 * C), slice(None)), math.nan)
    # Kernel start: the upper blocks of T and P are zeroed once (thread t takes linear t, t + 128, ...).
    for linear in range(C * C):
        smem.data["t16"][linear // C, linear % C] = 0.0
        smem.data["p16"][linear // C, linear % C] = 0.0
    smem.barrier()
    real = torch.arange(C) < tokens_here
    # P0: fp16 rows (zero past the end), gates and the scan by warp 0, the fp16 state copy.
    for row in range(2 * C):
        source = k if row < C else q
        smem.write(row // (2 * C // W), "kq", (row, slice(None)), source[row % C] if row % C < tokens_here else 0.0)
    lane_log_g = torch.where(real, log_g, 0.0).view(32, 2)  # lane l: tokens 2l, 2l + 1
    inclusive = lane_log_g.sum(1)
    offset = 1
    while offset < 32:  # shfl.up: lanes below `offset` keep their value
        inclusive = inclusive + torch.cat([torch.zeros(offset, dtype=inclusive.dtype), inclusive[:-offset]])
        offset *= 2
    exclusive = torch.cat([torch.zeros(1, dtype=inclusive.dtype), inclusive[:-1]])
    g_first = exclusive + lane_log_g[:, 0]
    smem.write(0, "cum_log_g", (0, slice(None)), torch.stack([g_first, g_first + lane_log_g[:, 1]], 1).reshape(C))
    smem.write(0, "beta", (0, slice(None)), torch.where(real, beta, 0.0))
    for w in range(W):
        cols = slice(w * chunked.STATE_COLS_PER_WARP, (w + 1) * chunked.STATE_COLS_PER_WARP)
        smem.write(w, "s16", (slice(None), cols), S0[:, cols])
    smem.barrier()
    # P1: Gram tiles, Xb^T, the inter-chunk output.
    acc_o = {}
    for w in range(W):
        G = smem.read(w, "cum_log_g", (0, slice(None)))
        bt = smem.read(w, "beta", (0, slice(None)))
        for col_block in range(w + 1):
            acc = smem.tile(w, "kq", (B, 128), (w, 0)) @ smem.tile(w, "kq", (B, 128), (col_block, 0)).T
            for r in range(B):
                for c in range(B):
                    i, j = w * B + r, col_block * B + c
                    value = bt[i] * math.exp(G[i] - G[j]) * acc[r, c] if j < i else 0.0
                    smem.write(w, "a16", (i, j), value)
                    if col_block == w:
                        smem.write(w, "a_diag", (i, c), value)
        q_block = W - 1 - w
        for col_block in range(q_block + 1):
            acc = smem.tile(w, "kq", (B, 128), (W + q_block, 0)) @ smem.tile(w, "kq", (B, 128), (col_block, 0)).T
            for r in range(B):
                for c in range(B):
                    i, j = q_block * B + r, col_block * B + c
                    smem.write(w, "p16", (i, j), math.exp(G[i] - G[j]) * acc[r, c] if j <= i else 0.0)
        acc_y = smem.tile(w, "kq", (B, 128), (w, 0)) @ smem.read(w, "s16", (slice(None), slice(None))).T
        for r in range(B):
            i = w * B + r
            for col in range(num_rows):
                value = bt[i] * (v[i, col] - math.exp(G[i]) * acc_y[r, col]) if i < tokens_here else 0.0
                smem.write(w, "xb_t", (col, i), value)
        acc = smem.tile(w, "kq", (B, 128), (W + w, 0)) @ smem.read(w, "s16", (slice(None), slice(None))).T
        acc_o[w] = torch.exp(G[w * B : (w + 1) * B])[:, None] * acc
    smem.barrier()
    next_q_in_flight()
    # P2: the diagonal blocks of T, one thread per column (threads 0..63 are warps 0 and 1).
    for tidx in range(C):
        w, base, col = tidx // 32, (tidx // B) * B, tidx % B
        column = [1.0 if col == r else 0.0 for r in range(B)]
        for j in range(B):
            for r in range(j + 1, B):
                column[r] = column[r] - smem.read(w, "a_diag", (base + r, j)) * column[j]
        for r in range(B):
            smem.write(w, "t16", (base + r, base + col), column[r])
    smem.barrier()
    next_q_in_flight()
    # P3: T_hl = -(T_hh A_hl) T_ll, warps 0 and 1.
    for w in range(2):
        hi, lo = 2 * w + 1, 2 * w
        x = smem.tile(w, "t16", (B, B), (hi, hi)) @ smem.tile(w, "a16", (B, B), (lo, hi), transposed=True).T
        smem.write(w, "scratch", (slice(w * B, (w + 1) * B), slice(0, B)), x)
        x = smem.tile(w, "scratch", (B, B), (w, 0))
        t = -(x @ smem.tile(w, "t16", (B, B), (lo, lo), transposed=True).T)
        smem.write(w, "t16", (slice(hi * B, (hi + 1) * B), slice(lo * B, (lo + 1) * B)), t)
    smem.barrier()
    next_q_in_flight()
    # P4: T[32:, :32] = -(T_B A_BA) T_A, warp w the tile (w // 2, w % 2).
    half = C // 2
    for w in range(W):
        out_row, out_col = w // 2, w % 2
        a_ba = smem.tile(w, "a16", (half, half), (0, 1), transposed=True)
        x = smem.tile(w, "t16", (B, half), (2 + out_row, 1)) @ a_ba.T
        smem.write(w, "scratch", (slice(w * B, (w + 1) * B), slice(None)), x)
        x = smem.tile(w, "scratch", (B, 2 * B), (w, 0))
        t = -(x @ smem.tile(w, "t16", (B, half), (out_col, 0), transposed=True).T)
        rows = slice(half + out_row * B, half + (out_row + 1) * B)
        smem.write(w, "t16", (rows, slice(out_col * B, (out_col + 1) * B)), t)
    smem.barrier()
    next_q_in_flight()
    # P5: V' = T Xb -> V'^T and V'c^T.
    for w in range(W):
        G = smem.read(w, "cum_log_g", (0, slice(None)))
        acc_y = smem.tile(w, "t16", (B, C), (w, 0)) @ smem.read(w, "xb_t", (slice(None), slice(None))).T
        rows = slice(w * B, (w + 1) * B)
        smem.write(w, "vn_t", (slice(None), rows), acc_y.T)
        smem.write(w, "vnc_t", (slice(None), rows), (acc_y * torch.exp(G[C - 1] - G[rows])[:, None]).T)
    g_last = smem.data["cum_log_g"][0, C - 1].item()
    smem.barrier()
    next_q_in_flight()
    # P6: O += P V'; S = exp(G_last) S + V'c^T K (warp w: state columns 32w..).
    out = torch.empty(C, num_rows, dtype=torch.float64)
    S_next = torch.empty_like(S0)
    for w in range(W):
        rows = slice(w * B, (w + 1) * B)
        out[rows] = acc_o[w] + smem.tile(w, "p16", (B, C), (w, 0)) @ smem.read(w, "vn_t", (slice(None), slice(None))).T
        cols = slice(w * chunked.STATE_COLS_PER_WARP, (w + 1) * chunked.STATE_COLS_PER_WARP)
        update = smem.read(w, "vnc_t", (slice(None), slice(None))) @ smem.tile(
            w, "kq", (chunked.STATE_COLS_PER_WARP, C), (w, 0), transposed=True
        ).T
        S_next[:, cols] = math.exp(g_last) * S0[:, cols] + update
    smem.barrier()
    return out, S_next


@pytest.mark.parametrize("rows", [chunked.SLICE_ROWS, 16])
@pytest.mark.parametrize("tokens_here", [1, 6, 37, 64])
def test_kernel_tile_schedule_computes_the_model_chunk_step(tokens_here, rows):
    # The kernel's per-warp tile schedule (transcribed) against chunked_model.chunk_step in float64:
    # same outputs and state, no read of an unwritten element (NaN), no race inside a phase; at
    # chunked.py's 32 V rows per CTA and at the narrow subclasses' 16 (the fp16 state copy's storage
    # then holds the inverse's larger scratch).
    generator = torch.Generator().manual_seed(tokens_here)
    C = chunked.CHUNK

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=generator, dtype=torch.float64) * std

    q = torch.nn.functional.normalize(randn(C, 128), dim=-1)
    k = torch.nn.functional.normalize(randn(C, 128), dim=-1)
    v, S0 = randn(C, rows), randn(rows, 128, std=0.2)
    log_g = -torch.rand(C, generator=generator, dtype=torch.float64) * 0.5
    beta = torch.rand(C, generator=generator, dtype=torch.float64)
    garbage = torch.arange(C) >= tokens_here
    poison = lambda x: torch.where(garbage.view(-1, *[1] * (x.dim() - 1)), math.nan, x)  # noqa: E731
    out, S_next = _emulate_chunk_step(S0, poison(q), poison(k), poison(v), poison(log_g), poison(beta), tokens_here)

    zero = lambda x: torch.where(garbage.view(-1, *[1] * (x.dim() - 1)), 0.0, x)  # noqa: E731
    ref_out, ref_S = model.chunk_step(
        S0[None], zero(q)[None], zero(k)[None], zero(v)[None], zero(log_g)[None], zero(beta)[None], 1.0, model.EXACT
    )
    assert not torch.isnan(S_next).any()
    assert not torch.isnan(out[:tokens_here]).any()
    assert torch.allclose(out[:tokens_here], ref_out[0, :tokens_here], atol=1e-10)
    assert torch.allclose(S_next, ref_S[0], atol=1e-10)


def test_copy_loops_cover_their_tiles_once():
    # load_chunk: k pieces (8 rounds), v pieces (2 rounds), one a or b row per thread; load_q: q
    # pieces (8 rounds); convert_kq: 16 rounds; the zero fill of T and P: 32 rounds. Every
    # (row, piece) exactly once.
    C, P, threads = chunked.CHUNK, chunked.PIECES_PER_ROW, chunked.NUM_THREADS

    def covered(rounds: int, per_row: int) -> list[tuple[int, int]]:
        return sorted(divmod(i * threads + t, per_row) for i in range(rounds) for t in range(threads))

    assert covered(C * P // threads, P) == [(j, p) for j in range(C) for p in range(P)]
    v_pieces = chunked.SLICE_ROWS // chunked.COPY_ELEMS
    assert covered(C * v_pieces // threads, v_pieces) == [(j, p) for j in range(C) for p in range(v_pieces)]
    assert sorted((t % C, t // C) for t in range(threads)) == [(j, r) for j in range(C) for r in range(2)]
    assert covered(2 * C * P // threads, P) == [(r, p) for r in range(2 * C) for p in range(P)]
    assert covered(C * C // threads, C) == [(r, c) for r in range(C) for c in range(C)]


# ------------------------------------------------------------------------------------------------
# CPU: the model of the chunked math
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_blocked_inverse_inverts_unit_lower_triangular(seed):
    generator = torch.Generator().manual_seed(seed)
    A = (torch.randn(3, 64, 64, generator=generator, dtype=torch.float64) * 0.2).tril(-1)
    T = model.invert_unit_lower(A, model.EXACT)
    eye = torch.eye(64, dtype=torch.float64)
    assert torch.allclose(T @ (eye + A), eye.expand_as(T), atol=1e-12)
    assert torch.equal(T.triu(1), torch.zeros_like(T))


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: c.name)
def test_exact_model_matches_reference(case):
    inputs = _case_inputs(case)
    out, new_state = model.run(*inputs.values(), precision=model.EXACT)
    ref_out, ref_state = reference_run(*inputs.values())
    # Only the reference's own fp32 rounding (and the bf16 output rounding) separate them.
    assert (new_state - ref_state).abs().max() < 1e-5
    assert (out.float() - ref_out.float()).abs().max() <= 2e-3
    if 0 in case.lengths:
        assert torch.count_nonzero(new_state[case.lengths.index(0)]) == 0


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: c.name)
def test_kernel_precision_model_passes_with_margin(case):
    inputs = _case_inputs(case)
    result = cases.compare(*model.run(*inputs.values(), precision=model.KERNEL), *reference_run(*inputs.values()))
    assert result.passed, result
    # fp16 operands: errors an order of magnitude inside atol = 1e-2.
    assert result.outputs["new_state"].max_abs_err < 2e-3
    assert result.outputs["output"].max_abs_err < 2e-3


def test_kernel_precision_holds_over_a_long_memory_sequence():
    # 1024 tokens (16 chunks) of Mamba2-style gates with a state: the rounding of the carried
    # state and of the corrected values accumulates here if anywhere.
    case = cases.CheckCase("m_long1024_state", (1024,), True, 0.0, "mamba2")
    inputs = _case_inputs(case)
    result = cases.compare(*model.run(*inputs.values(), precision=model.KERNEL), *reference_run(*inputs.values()))
    assert result.passed, result
    assert result.outputs["new_state"].max_abs_err < 2e-3


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: c.name)
def test_two_level_form_is_the_same_algebra(case):
    # Prepass (U, W, P for all chunks at once) + state pass: in float64 the chunk step's results.
    inputs = _case_inputs(case)
    out, new_state = model.run(*inputs.values(), precision=model.EXACT, step=model.two_level_step)
    ref_out, ref_state = model.run(*inputs.values(), precision=model.EXACT)
    assert (new_state - ref_state).abs().max() < 1e-10
    assert torch.equal(out, ref_out) or (out.float() - ref_out.float()).abs().max() <= 2**-8  # one bf16 ulp at most


@pytest.mark.parametrize(
    "case", [*MODEL_CASES, cases.CheckCase("m_long1024_state", (1024,), True, 0.0, "mamba2")], ids=lambda c: c.name
)
def test_two_level_form_with_fp16_operands_passes_with_margin(case):
    # The prepass stores U and W rounded to fp16: the errors stay an order of magnitude inside the
    # rule and within a small factor of the chunk step's own rounding.
    inputs = _case_inputs(case)
    ref = reference_run(*inputs.values())
    two_level = cases.compare(*model.run(*inputs.values(), precision=model.KERNEL, step=model.two_level_step), *ref)
    chunk = cases.compare(*model.run(*inputs.values(), precision=model.KERNEL), *ref)
    assert two_level.passed, two_level
    for name in ("output", "new_state"):
        assert two_level.outputs[name].max_abs_err < 2e-3
        assert two_level.outputs[name].max_abs_err <= 3 * max(chunk.outputs[name].max_abs_err, 2**-11)


def test_model_depends_on_the_initial_state():
    # Guards the test inputs themselves: with long memory, dropping the state must change the answer.
    case = cases.CheckCase("m_state_matters", (65,), True, 0.0, "mamba2")
    inputs = _case_inputs(case)
    with_state = model.run(*inputs.values(), precision=model.EXACT)
    without = model.run(*dict(inputs, state=None).values(), precision=model.EXACT)
    assert not cases.compare(*without, *with_state).passed


@pytest.mark.parametrize(
    "lengths",
    [(1,), (64,), (65,), (0, 64, 0, 129, 1), cases.MANY_SHORT, (8192,), tuple(range(0, 300, 7))],
    ids=lambda lengths: f"{len(lengths)}seqs_{sum(lengths)}tok",
)
def test_design_v2_chunk_slots_cover_every_chunk_once_within_the_grid_bound(lengths):
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    slots = model.chunk_slots(bounds, bounds[-1])
    expected = [(s, c) for s, length in enumerate(lengths) for c in range(math.ceil(length / model.CHUNK))]
    assert [slots.owner(slot) for slot in range(slots.first[-1])] == expected
    assert slots.first[-1] <= slots.slots  # the grid bound ceil(T / 64) + N always holds them
    assert all(slots.owner(slot) is None for slot in range(slots.first[-1], slots.slots))
    assert slots.owner(-1) is None


def test_design_v2_chunk_slots_clamp_malformed_bounds_as_the_kernel_does():
    # Decreasing and out-of-range bounds: clamped to [0, T] with end >= start, like chunked.py.
    slots = model.chunk_slots([0, 200, 100, 500, -5], 300)
    # [0, 200) -> 4 chunks; [200, 200) empty; [100, 300) -> 4 chunks; [300, 300) empty.
    assert slots.first == (0, 4, 4, 8, 8)
    assert slots.owner(3) == (0, 3) and slots.owner(4) == (2, 0) and slots.owner(8) is None
