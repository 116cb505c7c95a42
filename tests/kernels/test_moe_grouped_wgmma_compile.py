"""The compute-bound grouped GEMM1 + SwiGLU for large T (kernels/moe/grouped_wgmma.py; kernel.py's GEMM1 above
MEDIUM_T_MAX_TOKENS, after the row gather).

CPU: it compiles for sm_90a without a GPU (symbolic row count, one compile for every R) and caches; the fragment map
its promotion and SwiGLU rely on (`fragment_row`, `fragment_col`: the up and the gate accumulator share it, so an up
column and its gate column sit in one thread), traced from CuTe's own partition of the two-warpgroup MMA for all 256
consumer threads; C's columns where the WGMMA GEMM1 of the other variants stores them (the order GEMM2 reads); the
shared-memory budget and the one-CTA grid; the A-scale boxes' geometry (a TMA box starts 16-byte aligned in its
innermost dimension); from the compiled PTX and cubin: the register budget `setmaxnreg` moves (launch count x 384
threads holds 40 x 128 + 232 x 256, or the consumers' raise waits forever) and that both `setmaxnreg` sit in code
chosen by the warp-uniform warp index at warpgroup boundaries.
GPU (skipped without CUDA): the grouped GEMM against a torch fp32 reference of the same block-scaled GEMM and SwiGLU
on random inputs (uneven experts at odd offsets, empty ones, one expert with all rows); relative L2 <= 1e-2 and rows
past the experts' left untouched.
"""

from __future__ import annotations

import re
import struct

import pytest

pytest.importorskip("cutlass")

import torch  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor  # noqa: E402

from tests.kernels.compile_checks import assert_compiles_and_caches  # noqa: E402
from tests.kernels.test_moe_kernel import needs_cuda, solution_module  # noqa: E402

grouped = solution_module("grouped_wgmma")
order = solution_module("intermediate_order")
streaming = solution_module("streaming_gemm")


# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(grouped.compile_only, 1)


def _traced_accumulator_coords() -> dict[int, list[tuple[int, int]]]:
    """(row, column) in the 128 x 128 column half of an item of every accumulator entry of every consumer thread, as
    CuTe partitions the kernel's tiled MMA (evaluated while tracing: no GPU)."""
    seen: dict[int, list[tuple[int, int]]] = {}

    def collect(tiled_mma, identity):  # plain Python, called while tracing: its loops stay Python loops
        for thread in range(grouped.CONSUMER_THREADS):
            coords = tiled_mma.get_slice(thread).partition_C(identity)
            seen[thread] = [coords[i] for i in range(cute.size(coords))]

    @cute.jit
    def probe(unused: cute.Tensor):
        tiled_mma, _, _ = grouped.mma_operands(4)
        collect(tiled_mma, cute.make_identity_tensor((grouped.TILE_M, grouped.HALF_N)))

    unused = make_fake_compact_tensor(cutlass.Float32, (4,), assumed_align=16)
    cute.compile(probe, unused, options="--gpu-arch sm_90a")
    return seen


def test_the_fragment_map_covers_a_column_half_once():
    # The up and the gate accumulator are partitions of one tiled MMA over equal halves: entry i of both is one
    # (row, column), which SwiGLU pairs in the thread.
    seen = _traced_accumulator_coords()
    assert len(seen) == grouped.CONSUMER_THREADS
    covered = set()
    for thread, coords in seen.items():
        assert len(coords) == grouped.ACC_SIZE
        row0, col0 = coords[0]
        # the thread's warpgroup owns rows [64 wg, 64 wg + 64); its first column is one of the first 8
        assert row0 // grouped.WG_ROWS == thread // grouped.WARPGROUP and col0 < 8
        for i, (row, col) in enumerate(coords):
            assert (row, col) == (row0 + grouped.fragment_row(i), col0 + grouped.fragment_col(i))
            covered.add((row, col))
    assert covered == {(r, c) for r in range(grouped.TILE_M) for c in range(grouped.HALF_N)}


def test_columns_are_stored_where_the_other_wgmma_gemm1_stores_them():
    # GEMM2 reads C in one order whichever GEMM1 wrote it: the WGMMA GEMM1's items of 32 columns store natural column
    # c of item c // 32 at 32 (c // 32) + stored_position(c % 32); the grouped GEMM1's items span 128 columns.
    seen = set()
    for n_tile in range(grouped.N_TILES):
        for column in range(grouped.HALF_N):
            natural = n_tile * grouped.HALF_N + column
            stored = grouped.stored_column(n_tile, column)
            assert stored == natural - natural % order.GROUP + order.stored_position(natural % order.GROUP)
            seen.add(stored)
    assert seen == set(range(grouped.INTERMEDIATE))


def test_the_epilogue_stores_adjacent_entry_pairs_as_one_word():
    # Entries i, i + 1 (i even) of a thread's half: one row, columns c and c + 1 with c even (traced col0 is),
    # stored at adjacent, word-aligned positions of GEMM2's order: one bf16x2 store per pair.
    seen = _traced_accumulator_coords()
    for coords in seen.values():
        _, col0 = coords[0]
        assert col0 % 2 == 0
        for i in range(0, grouped.ACC_SIZE, 2):
            assert grouped.fragment_row(i) == grouped.fragment_row(i + 1)
            assert grouped.fragment_col(i + 1) == grouped.fragment_col(i) + 1
            for n_tile in range(grouped.N_TILES):
                first = grouped.stored_column(n_tile, col0 + grouped.fragment_col(i))
                assert first % 2 == 0 and grouped.stored_column(n_tile, col0 + grouped.fragment_col(i + 1)) == first + 1


def test_configurations_fit_one_cta_per_sm():
    assert grouped.GroupedGemm1Config().num_stages == 4
    for stages in (2, 3, 4):
        config = grouped.GroupedGemm1Config(stages)
        assert stages * grouped.STAGE_BYTES < config.smem_bytes()
        assert config.smem_bytes() + streaming.SMEM_RESERVED_PER_CTA <= streaming.SMEM_PER_SM
        assert config.ctas_per_sm() == 1 and config.grid(132) == 132
        assert config.gathered_rows and not config.partition_walk  # what the MoE host reads
    with pytest.raises(ValueError):
        grouped.GroupedGemm1Config(5)
    assert grouped.STAGE_BYTES == 128 * 128 * 3 + 132 * 4


def test_a_scale_boxes_start_16_byte_aligned_and_hold_the_tile():
    # TMA: the innermost box start (A's scale rows, f32) on 16 bytes, the box's inner extent a multiple of 16 bytes,
    # every stage slot's destination on 128 bytes; the tile's rows, shifted by first row % SFA_ALIGN, inside the box.
    assert grouped.SFA_ALIGN * 4 == 16 and grouped.SFA_ROWS * 4 % 16 == 0 and grouped.SFA_STAGE * 4 % 128 == 0
    assert grouped.SFA_STAGE >= grouped.SFA_ROWS <= 256
    for first_row in range(3 * grouped.SFA_ALIGN):
        start = first_row - first_row % grouped.SFA_ALIGN
        assert start * 4 % 16 == 0
        assert first_row - start + grouped.TILE_M <= grouped.SFA_ROWS


# ------------------------------------------------------------------------------------------------
# CPU: the compiled kernel's structure (PTX and cubin of one compile with dumps)
# ------------------------------------------------------------------------------------------------

EIATTR_REGCOUNT = 0x2F  # .nv.info attribute: (function symbol, registers per thread)
REGISTER_FILE = 64 * 1024  # 32-bit registers per SM (and the most one CTA holds)


@pytest.fixture(scope="module")
def dumped(tmp_path_factory) -> tuple[str, bytes]:
    folder = tmp_path_factory.mktemp("grouped_wgmma_dump")
    grouped.compiled(dump_dir=str(folder))
    (ptx,) = folder.glob("*.ptx")
    (cubin,) = folder.glob("*.cubin")
    return ptx.read_text(), cubin.read_bytes()


def _register_count(cubin: bytes) -> int:
    """Registers per thread of the cubin's one kernel: EIATTR_REGCOUNT of its ELF `.nv.info` section."""
    assert cubin[:5] == b"\x7fELF\x02"  # 64-bit ELF
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]
    counts = []
    for name_at, _, _, _, offset, size, *_ in sections:
        if cubin[names + name_at : cubin.index(b"\0", names + name_at)] != b".nv.info":
            continue
        at = offset
        while at < offset + size:  # records: format, attribute, u16 length, value
            attribute, length = cubin[at + 1], struct.unpack_from("<H", cubin, at + 2)[0]
            if attribute == EIATTR_REGCOUNT:
                counts.append(struct.unpack_from("<II", cubin, at + 4)[1])
            at += 4 + length
    assert len(counts) == 1, counts
    return counts[0]


def test_register_budget_holds_the_setmaxnreg_split(dumped):
    _, cubin = dumped
    regs = _register_count(cubin)
    # the launch allocation: 384 threads on one SM, in 8-register steps
    assert regs % 8 == 0 and regs * grouped.NUM_THREADS <= REGISTER_FILE
    # the producer lowers to 40 and the consumers raise to 232 from the launch count, within the CTA's registers
    assert grouped.PRODUCER_REGS <= regs <= grouped.CONSUMER_REGS
    needed = grouped.PRODUCER_REGS * grouped.WARPGROUP + grouped.CONSUMER_REGS * grouped.CONSUMER_THREADS
    assert needed <= regs * grouped.NUM_THREADS, (regs, needed)


def _definition(ptx_lines: list[str], register: str) -> str:
    """The one PTX instruction that writes `register` (CuTe-DSL's PTX is in SSA form)."""
    pattern = re.compile(rf"^\s*[\w.]+\s+{re.escape(register)}(?:\||,)")
    found = [line.strip() for line in ptx_lines if pattern.match(line)]
    assert len(found) == 1, (register, found)
    return found[0]


def test_setmaxnreg_only_under_warp_uniform_warpgroup_branches(dumped):
    ptx, _ = dumped
    lines = ptx.splitlines()
    assert re.search(rf"\.reqntid {grouped.NUM_THREADS}, 1, 1", ptx)
    assert "trap;" not in ptx
    sites = {
        f"setmaxnreg.dec.sync.aligned.u32 \t{grouped.PRODUCER_REGS};": 0,
        f"setmaxnreg.inc.sync.aligned.u32 \t{grouped.CONSUMER_REGS};": 0,
    }
    for at, line in enumerate(lines):
        if "setmaxnreg" not in line:
            continue
        assert line.strip() in sites, line
        sites[line.strip()] += 1
        # the branch that chose it: the one jumping to its block's label, or the one it falls through
        before = lines[at - 1].strip()
        if before.endswith(":"):
            jump = re.compile(rf"\s*@!?%p\d+ bra(\.uni)?\s+{re.escape(before[:-1])};")
            branches = [x.strip() for x in lines if jump.match(x)]
            assert len(branches) == 1, (before, branches)
            branch = branches[0]
        else:
            branch = before
        predicate = re.match(r"@!?(%p\d+) bra", branch).group(1)
        setp = _definition(lines, predicate)
        compare, warp, bound = re.match(r"setp\.(\w+)\.\w+\s+%p\d+, (%r\d+), (\d+);", setp).groups()
        # warp < 4 (lt/ge) or warp > 3 (gt/le): the split falls on a warpgroup boundary
        assert (int(bound) + (compare in ("gt", "le"))) % (grouped.WARPGROUP // 32) == 0, setp
        # the warp index made warp-uniform: lane 0's tid.x >> 5 broadcast by shfl.sync.idx (make_warp_uniform)
        source = _definition(lines, warp)
        while source.startswith("shfl.sync.idx"):
            assert source.endswith(", 0, 31, -1;"), source
            source = _definition(lines, re.match(r"shfl\.sync\.idx\.b32\s+%r\d+, (%r\d+),", source).group(1))
        assert re.match(r"shr\.u32\s+%r\d+, %r\d+, 5;", source), source
        tid = _definition(lines, re.match(r"shr\.u32\s+%r\d+, (%r\d+), 5;", source).group(1))
        assert tid.endswith("%tid.x;"), tid
    assert all(count == 1 for count in sites.values()), sites


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


SPARE_ROWS = 8  # rows past the experts', which the GEMM must leave untouched


def _inputs(counts: list[int], seed: int):
    """Grouped A (expert e's rows from the exclusive prefix of the counts on), its transposed scales, W13 and its block
    scales, random; R a multiple of 4 with SPARE_ROWS past the experts' rows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    offsets = [sum(counts[:e]) for e in range(len(counts))]
    rows = (sum(counts) + SPARE_ROWS + 3) // 4 * 4
    H, N, E = grouped.HIDDEN, 2 * grouped.INTERMEDIATE, grouped.NUM_LOCAL_EXPERTS
    a = torch.randn(rows, H, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    a_scale = torch.rand(H // 128, rows, device="cuda", generator=gen) + 0.5
    w = (torch.randn(E, N, H, device="cuda", generator=gen) * 0.5).to(torch.float8_e4m3fn)
    w_scale = (torch.rand(E, N // 128, H // 128, device="cuda", generator=gen) + 0.5) * 0.01
    return a, a_scale, w, w_scale, torch.tensor(counts, dtype=torch.int32, device="cuda"), offsets


def natural_columns(stored: torch.Tensor) -> torch.Tensor:
    """C in natural column order from the order GEMM2 reads (`intermediate_order.py`)."""
    where = [grouped.stored_column(c // grouped.HALF_N, c % grouped.HALF_N) for c in range(grouped.INTERMEDIATE)]
    return stored[:, torch.tensor(where, device=stored.device)]


def _reference(a, a_scale, w, w_scale, counts, offsets) -> dict[int, torch.Tensor]:
    """fp32 C = silu(gate) * up of each expert's rows (dequantised with the block scales), by expert."""
    out = {}
    for e, (count, offset) in enumerate(zip(counts.tolist(), offsets)):
        if count == 0:
            continue
        x = a[offset : offset + count].float() * a_scale[:, offset : offset + count].t().repeat_interleave(128, 1)
        wd = w[e].float() * w_scale[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
        g = x @ wd.t()
        up, gate = g[:, : grouped.INTERMEDIATE], g[:, grouped.INTERMEDIATE :]
        out[e] = torch.nn.functional.silu(gate) * up
    return out


GPU_CASES = {
    # uneven, with empty experts, a single row, tile edges (127, 128, 129), several row tiles and odd offsets
    "uneven": [0, 1, 127, 128, 129, 300, 0, 5, 640, 33] + [0, 17] * 11,
    # every row on one expert (skewed routing)
    "one_expert": [0] * 7 + [1500] + [0] * 24,
    # all 32 experts, a few hundred rows each
    "all_experts": [97 + 37 * (e % 9) for e in range(32)],
}


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_grouped_gemm1_matches_the_fp32_reference(case):
    a, a_scale, w, w_scale, counts, offsets = _inputs(GPU_CASES[case], seed=len(case))
    out = torch.full((a.shape[0], grouped.INTERMEDIATE), float("nan"), dtype=torch.bfloat16, device="cuda")
    num_ctas = torch.cuda.get_device_properties(a.device).multi_processor_count
    grouped.compiled()(a, a_scale, w, w_scale, out, counts, num_ctas)
    torch.cuda.synchronize()
    expected = _reference(a, a_scale, w, w_scale, counts, offsets)
    written = torch.zeros(a.shape[0], dtype=torch.bool, device="cuda")
    out = natural_columns(out)
    for e, ref in expected.items():
        offset, count = offsets[e], int(counts[e])
        got = out[offset : offset + count].float()
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel <= 1e-2, (e, count, rel)
        written[offset : offset + count] = True
    assert not out[written].isnan().any()
    assert out[~written].isnan().all()  # rows past the experts' are never stored
