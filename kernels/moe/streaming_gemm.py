"""Weight-streaming expert GEMMs of the MoE kernel on `mma.sync` (GEMM1 + SwiGLU, GEMM2) for few tokens per expert.

Why: at small T the MoE is bound by the fp8 weights (44 MB per active local expert), and a grouped GEMM's grid
(64-token row tiles x 128-row N tiles, 2 stages) keeps only a few hundred KB in flight. Here every
SM streams weights:

- Work item = (row tile of BLOCK_TOKENS tokens of one expert, 32 weight rows). GEMM1: 16 up rows
  16 nt.. and the 16 gate rows 2048 + 16 nt.. (so SwiGLU needs no other CTA), 128 items per row
  tile; GEMM2: 32 output columns 32 nt.., 224 items per row tile. At T = 1 with one active expert
  that is 128 (224) items of 229 KB (64 KB) for 132 SMs.
- Persistent CTAs (grid = SMs x CTAs per SM, from the host) walk the items b, b + G, ...; the total
  is computed on the device from the per-expert counts, so no CTA is launched for nothing and the
  host never reads a count. The cp.async pipeline runs across item boundaries (a flat loop over
  (item, K stage)), so streaming never drains between items.
- A K stage is 4 quantisation blocks (512 K); warp w owns block w of every stage (split-K inside
  the CTA). Each warp promotes its own blocks as DeepGEMM does (fp32 sum over the 128-wide block,
  then acc += block * (activation scale x weight block scale)); the 4 partial sums are added in
  warp order in the epilogue, so results are deterministic.
- Swapped operands: the weights are the MMA's A operand (16 rows per m16n8k16), the tokens its N
  operand (8 per n8), so a tile of one token wastes nothing on 16-row padding. n8 sub-tiles past the
  tile's valid tokens are skipped (a CTA-uniform branch).
- No bf16 staging in shared memory: each thread reads 16 contiguous fp8 bytes per row with one
  ld.shared.v4 and converts in registers. That works because the K order inside a 64-wide chunk is
  free as long as A and B use the same one: thread q of a quad takes memory k = 16q .. 16q + 15,
  and MMA j (of 4) gets bytes 4j .. 4j + 3, i.e. slots {2q, 2q+1} <- 16q + 4j + {0, 1} and
  {2q+8, 2q+9} <- 16q + 4j + {2, 3}, for A and B alike.
- GEMM1 multiplies f16 (e4m3 -> f16 is exact, `cvt.rn.f16x2.e4m3x2`), GEMM2 bf16 (its activation
  operand, the intermediate C, is bf16; e4m3 -> f16 -> f32 -> bf16 is exact). Products of such values are
  exact in fp32 and the MMA accumulates in fp32, so the numerics are those of a per-block promotion.
- Shared-memory rows are XOR-swizzled by 16-B chunk (`fp8_chunk_slot`, `bf16_chunk_slot`) so that
  the two rows that the 8 threads of one ld.shared.v4 phase read cover all 32 banks.

Layout of the packed workspaces and the row numbering are the routing's (routing.py, combine.py), so
every GEMM variant shares the routing and combine kernels.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from .chain import NO_CHAIN, ChainLink, enter
from .routing import ROUTING_WARPS, route_then_meet, wait_until_routed
from .shapes import BLOCK, GEMM1_OUT, HIDDEN, INTERMEDIATE, NUM_LOCAL_EXPERTS, TOP_K
from .swiglu import swiglu_bf16

NUM_THREADS = 128  # 4 warps, one per K block of a stage
NUM_WARPS = NUM_THREADS // 32
BLOCKS_PER_STAGE = NUM_WARPS  # K blocks of 128 per pipeline stage
STAGE_K = BLOCKS_PER_STAGE * BLOCK  # 512
ITEM_ROWS = 32  # weight rows per work item: two m16 tiles
M_TILES = ITEM_ROWS // 16
GEMM1_ITEM_COLUMNS = ITEM_ROWS // 2  # C columns per GEMM1 item (16 up + 16 gate rows)
GEMM1_ITEMS_PER_ROW_TILE = INTERMEDIATE // GEMM1_ITEM_COLUMNS  # 128
GEMM2_ITEMS_PER_ROW_TILE = HIDDEN // ITEM_ROWS  # 224
CHUNK = 16  # bytes per cp.async / ld.shared.v4
FP8_CHUNKS_PER_BLOCK_ROW = BLOCK // CHUNK  # 8: one 128-wide K block of an fp8 row
BF16_CHUNKS_PER_BLOCK_ROW = 2 * BLOCK // CHUNK  # 16
SMEM_PER_SM = 227 * 1024  # usable shared memory per SM on SM90
SMEM_RESERVED_PER_CTA = 1024
PAIRED_SLOTS = 3  # CTAs per SM of a GEMM1 that walks by SM id (`take_walk_slot`'s slots 0-2; the WGMMA GEMM1's)
WALK_SLOT_WORDS = 256  # SM ids the walk by SM id keeps a slot counter for
# The last word of a walk buffer with partition ranks (twice WALK_SLOT_WORDS, the ranks after the slot
# counters) once its ranks are written; a buffer without it (made inside a CUDA-graph capture) walks by `%smid`.
RANKS_WRITTEN = 0x5A17
# Values of an SM's slot counter per round: PAIRED_SLOTS slots and one value that a draw skips (`take_walk_slot`); a
# power of two, so a divisor of 2**32 and the word's wrap keeps the rounds.
WALK_SLOT_ROUND = 4

assert WALK_SLOT_ROUND == PAIRED_SLOTS + 1 and WALK_SLOT_ROUND & (WALK_SLOT_ROUND - 1) == 0
assert GEMM1_OUT == 2 * INTERMEDIATE and HIDDEN % STAGE_K == 0 and INTERMEDIATE % STAGE_K == 0
assert BLOCK % ITEM_ROWS == 0  # an item's rows (per half for GEMM1) lie in one scale block
assert BLOCK % GEMM1_ITEM_COLUMNS == 0


class StreamingConfigError(ValueError):
    """A streaming GEMM configuration that the kernel cannot run."""


# ------------------------------------------------------------------------------------------------
# index maps (plain arithmetic: the kernel calls them with DSL integers at trace time and the CPU
# tests with Python ints, so the tests check the very formulas the kernel runs)
# ------------------------------------------------------------------------------------------------

# Sources of the four A registers of MMA j (of the 4 in a 64-wide K chunk): (row offset from the
# thread's group g, high half of word j of that row's 16-B load). PTX ISA m16n8k16 .f16/.bf16:
# a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9].
A_REGISTER_SOURCES = ((0, False), (8, False), (0, True), (8, True))
# b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]: for e4m3 activations the low and the high half of
# word j; for bf16 activations b_r of MMA j is word 2 j + r of the thread's two 16-B loads.
B_REGISTER_HIGH_HALF = (False, True)


def fp8_chunk_slot(chunk, row):
    """Shared-memory position of 16-B chunk `chunk` (0..7) of the 128-B fp8 row `row`: odd rows
    swap their 64-B halves, so that rows g and g + 1 of one ld.shared.v4 phase use all 32 banks."""
    return chunk ^ ((row % 2) * 4)


def bf16_chunk_slot(chunk, row):
    """Shared-memory position of 16-B chunk `chunk` (0..15) of the 256-B bf16 row `row`: odd rows
    swap neighbouring chunks (the same bank argument)."""
    return chunk ^ (row % 2)


def fp8_thread_chunk(half, quad):
    """The 16-B chunk of a 128-wide fp8 K block that thread `quad` of a quad loads for the 64-wide K
    chunk `half`: k = 64 half + 16 quad .. + 15, for weights and activations alike."""
    return half * 4 + quad


def bf16_thread_chunk(half, quad, c):
    """16-B chunk c (0, 1) of the bf16 elements k = 64 half + 16 quad .. + 15."""
    return half * 8 + quad * 2 + c


def item_weight_row(gemm1: bool, n_tile, row):
    """Weight row of row `row` (0..31) of the items of column tile `n_tile`. GEMM1: rows [0, 16) are
    the up rows 16 n_tile + r, rows [16, 32) the gate rows 2048 + 16 n_tile + r - 16 (written
    branch-free so that it traces for a DSL integer). GEMM2: the output columns 32 n_tile + r."""
    if gemm1:
        gate = row // GEMM1_ITEM_COLUMNS
        return n_tile * GEMM1_ITEM_COLUMNS + row + gate * (INTERMEDIATE - GEMM1_ITEM_COLUMNS)
    return n_tile * ITEM_ROWS + row


def item_weight_scale_row(gemm1: bool, n_tile, m_tile):
    """Row of the 128 x 128 weight block scales that holds m tile `m_tile` (item rows 16 m_tile ..)."""
    if gemm1:
        return (m_tile * INTERMEDIATE + n_tile * GEMM1_ITEM_COLUMNS) // BLOCK
    return n_tile * ITEM_ROWS // BLOCK  # both m tiles lie in one block


def accumulator_coords(m_tile, n_tile, i, group, quad):
    """(item row, token slot) of accumulator element i (0..3) of MMA tile (m_tile, n_tile). PTX ISA
    m16n8k16 C/D: c0, c1 lie in row g, c2, c3 in row g + 8; the column is 2 t + (i % 2)."""
    return m_tile * 16 + (i // 2) * 8 + group, n_tile * 8 + quad * 2 + (i % 2)


# ------------------------------------------------------------------------------------------------
# inline PTX helpers
# ------------------------------------------------------------------------------------------------


def _e4m3x2_to_mma_input(word: Int32, high: bool, bf16: bool) -> Int32:
    return e4m3x2_to_bf16x2(word, high) if bf16 else e4m3x2_to_f16x2(word, high)


@dsl_user_op
def lds_shared(pointer, count: int, *, loc=None, ip=None) -> tuple[Int32, ...]:
    """ld.shared.v`count`.b32 (count 2 or 4) from a shared-memory pointer aligned to 4 `count` bytes.
    Volatile, so that it is never moved across the barriers and cp.async waits that make the data valid."""
    address = llvm.ptrtoint(T.i32(), pointer.llvm_ptr, loc=loc, ip=ip)
    registers = ", ".join(f"${i}" for i in range(count))
    words = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * count),
        [address],
        f"ld.shared.v{count}.b32 {{{registers}}}, [${count}];",
        ",".join(["=r"] * count + ["r"]),
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    return tuple(Int32(llvm.extractvalue(T.i32(), words, [i], loc=loc, ip=ip)) for i in range(count))


def e4m3x2_to_f16x2(word: Int32, high: bool) -> Int32:
    """Two e4m3 bytes (the low or high half of `word`) as f16x2, exactly."""
    half = "hi" if high else "lo"
    return cute.arch.inline_ptx(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, {$r0}; cvt.rn.f16x2.e4m3x2 {$w0}, " + half + "; }",
        write_only_types=[Int32],
        read_only_args=[word],
    )


def e4m3x2_to_bf16x2(word: Int32, high: bool) -> Int32:
    """Two e4m3 bytes as bf16x2, exactly (through f16 and f32: each step is exact for 4-bit
    significands)."""
    half = "hi" if high else "lo"
    return cute.arch.inline_ptx(
        "{ .reg .b16 lo, hi, a, b; .reg .b32 h2; .reg .f32 fa, fb; mov.b32 {lo, hi}, {$r0}; "
        "cvt.rn.f16x2.e4m3x2 h2, " + half + "; mov.b32 {a, b}, h2; cvt.f32.f16 fa, a; cvt.f32.f16 fb, b; "
        "cvt.rn.bf16x2.f32 {$w0}, fb, fa; }",
        write_only_types=[Int32],
        read_only_args=[word],
    )


def _mma_16816(
    a0: Int32, a1: Int32, a2: Int32, a3: Int32, b0: Int32, b1: Int32,
    c0: Float32, c1: Float32, c2: Float32, c3: Float32, bf16: bool,
):
    """D = A B + C for one m16n8k16 with fp32 accumulation; f16 or bf16 multiplicands."""
    kind = "bf16.bf16" if bf16 else "f16.f16"
    return cute.arch.inline_ptx(
        "mma.sync.aligned.m16n8k16.row.col.f32." + kind + ".f32 {{$w0}, {$w1}, {$w2}, {$w3}}, "
        "{{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, {{$r6}, {$r7}, {$r8}, {$r9}};",
        write_only_types=[Float32, Float32, Float32, Float32],
        read_only_args=[a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
    )


# ------------------------------------------------------------------------------------------------
# configuration (host side, pure Python: unit-tested on CPU)
# ------------------------------------------------------------------------------------------------


def smem_region(dtype, count: int, alignment: int):
    """One aligned array of a kernel's shared-memory struct."""
    return cute.struct.Align[cute.struct.MemRange[dtype, count], alignment]


class PersistentGemmConfig:
    """What the persistent weight-streaming GEMMs' configurations (this file's, `wgmma_gemm1.py`'s,
    `wgmma_gemm2.py`'s and `fused_gemms.py`'s) share: a shared-memory struct made of the subclass's `fields()`
    followed by the item walk's tables (`schedule_tables`), the bytes it takes, the CTAs per SM it allows and the
    persistent grid (`grid`) that `launch_persistent` launches."""

    _smem_bytes: int | None = None
    # A GEMM2 that issues its first weights before its programmatic wait takes the kept routed count (only the
    # `mma.sync` one can: `StreamingGemmConfig`'s weights_before_wait).
    weights_before_wait: bool = False
    # A GEMM1 whose every CTA routes up to ROUTING_WARPS tokens itself (the `mma.sync` one only).
    routing_per_cta: bool = False
    # A three-CTA GEMM1 that walks by the SMs' L2-partition ranks and takes the kept walk buffer (the WGMMA one).
    partition_walk: bool = False
    # A GEMM2 that multiplies C rewritten as f16 and so needs `c_to_f16.py` before it (the WGMMA one).
    f16_c: bool = False
    # A GEMM1 whose A is the grouped rows of the row gather (`gather_rows.py`) instead of x: none of these, only
    # `grouped_wgmma.GroupedGemm1Config`, which states it too.
    gathered_rows: bool = False
    # Registers allow two CTAs of 128 threads per SM at up to 255 registers a thread. A configuration that allows
    # three states it (the WGMMA GEMM1 with its producer warp, the f16 WGMMA GEMM2; their compiled registers were read
    # from the cubin), and a cooperative launch of a grid that cannot all be resident fails rather than hangs.
    max_ctas_per_sm: int = 2

    def fields(self) -> dict:
        raise NotImplementedError

    def set_max_ctas_per_sm(self, max_ctas_per_sm: int) -> None:
        """Keep `max_ctas_per_sm`: 2, or 3 from a configuration that states its registers allow it."""
        if max_ctas_per_sm not in (2, 3):
            raise StreamingConfigError(f"max_ctas_per_sm must be 2 or 3, got {max_ctas_per_sm}")
        self.max_ctas_per_sm = max_ctas_per_sm

    def shared_storage(self):
        """The kernel's shared-memory struct (one definition for the kernel and the occupancy maths)."""
        tables = {name: smem_region(Int32, NUM_LOCAL_EXPERTS, 16) for name in SCHEDULE_TABLES}
        return cute.struct(type("SharedStorage", (), {"__annotations__": {**self.fields(), **tables}}))

    def smem_bytes(self) -> int:
        """Dynamic shared memory per CTA (building the struct takes ~0.1 ms: computed once)."""
        if self._smem_bytes is None:
            self._smem_bytes = self.shared_storage().size_in_bytes()
        return self._smem_bytes

    def check_fits(self) -> None:
        if self.smem_bytes() + SMEM_RESERVED_PER_CTA > SMEM_PER_SM:
            raise StreamingConfigError(f"{self.smem_bytes()} B of shared memory per CTA do not fit an SM")

    def ctas_per_sm(self) -> int:
        """Resident CTAs per SM the shared memory allows, at most max_ctas_per_sm."""
        return max(1, min(self.max_ctas_per_sm, SMEM_PER_SM // (self.smem_bytes() + SMEM_RESERVED_PER_CTA)))

    def grid(self, num_sms: int) -> int:
        """The persistent grid: every SM holds as many CTAs as the configuration allows."""
        return num_sms * self.ctas_per_sm()


class StreamingGemmConfig(PersistentGemmConfig):
    """Compile-time shape of one streaming GEMM: which GEMM, tokens per row tile, pipeline depth."""

    def __init__(
        self,
        gemm1: bool,
        block_tokens: int,
        num_stages: int,
        weights_before_wait: bool = False,
        routing_per_cta: bool = False,
    ):
        """`weights_before_wait` (GEMM2 as a programmatic dependent of a GEMM1 that routes): the CTA reads the
        schedule once the kept count of routed tokens is complete and issues its first stages' weights before
        `griddepcontrol.wait`; only the activations (GEMM1's output) wait for GEMM1 to complete.
        `routing_per_cta` (GEMM1 that routes): up to ROUTING_WARPS tokens every CTA routes them all
        (`routing.route_in_every_cta`) in a few words of shared memory of its own. Two CTAs per SM."""
        if block_tokens not in (8, 16, 32):
            raise StreamingConfigError(f"block_tokens must be 8, 16 or 32, got {block_tokens}")
        if num_stages < 2:
            raise StreamingConfigError(f"num_stages must be >= 2, got {num_stages}")
        self.gemm1 = gemm1
        self.block_tokens = block_tokens
        self.num_stages = num_stages
        if weights_before_wait and gemm1:
            raise StreamingConfigError("weights_before_wait is GEMM2's (GEMM1 is the call's first kernel)")
        self.weights_before_wait = weights_before_wait
        if routing_per_cta and not gemm1:
            raise StreamingConfigError("routing_per_cta is GEMM1's (the call's first kernel routes)")
        self.routing_per_cta = routing_per_cta
        self.n_tiles = block_tokens // 8  # n8 MMA tiles per row tile
        self.k = HIDDEN if gemm1 else INTERMEDIATE
        self.k_stages = self.k // STAGE_K  # 14 or 4 per item
        self.items_per_row_tile = GEMM1_ITEMS_PER_ROW_TILE if gemm1 else GEMM2_ITEMS_PER_ROW_TILE
        self.weight_rows = GEMM1_OUT if gemm1 else HIDDEN
        # activation bytes per token and K block: fp8 rows for GEMM1, bf16 C rows for GEMM2
        self.x_block_row_bytes = BLOCK if gemm1 else 2 * BLOCK
        self.threads_per_token = NUM_THREADS // block_tokens
        if self.gemm1 and self.threads_per_token < BLOCKS_PER_STAGE:
            raise StreamingConfigError("GEMM1 needs >= 4 threads per token for the activation scales")
        self.check_fits()
        if self.k_stages < num_stages:
            # The computed item's valid rows come from the load side, which must not have moved on to the next
            # item by the computed item's first stage.
            raise StreamingConfigError(f"an item of {self.k_stages} K stages needs num_stages <= {self.k_stages}")

    def fields(self) -> dict:
        ns, bt = self.num_stages, self.block_tokens
        x_dtype = cutlass.Float8E4M3FN if self.gemm1 else cutlass.BFloat16
        return {
            "w_stages": smem_region(cutlass.Float8E4M3FN, ns * BLOCKS_PER_STAGE * ITEM_ROWS * BLOCK, 128),
            "x_stages": smem_region(x_dtype, ns * BLOCKS_PER_STAGE * bt * BLOCK, 128),
            # the activation-scale ring is allocated for GEMM2 too (unused there: C is unscaled)
            "x_scales": smem_region(Float32, ns * BLOCKS_PER_STAGE * bt, 128),
            "w_scales": smem_region(Float32, ns * M_TILES * BLOCKS_PER_STAGE, 128),
            "scratch": smem_region(Float32, NUM_WARPS * ITEM_ROWS * bt, 128),
            **({"routing_choices": smem_region(Int32, ROUTING_WARPS * TOP_K, 16)} if self.routing_per_cta else {}),
        }


# ------------------------------------------------------------------------------------------------
# the work schedule (shared with wgmma_gemm1.py and wgmma_gemm2.py)
# ------------------------------------------------------------------------------------------------

SCHEDULE_TABLES = ("tile_end", "expert_count", "expert_offset")  # shared memory, per local expert


@cute.jit
def fill_schedule_tables(
    storage, counts: cute.Tensor, block_tokens: cutlass.Constexpr, cta: Int32, warp_id: Int32, lane: Int32,
    counts_out=None,
):
    """Warp 0 builds the expert tables in shared memory (`build_expert_tables`: lane e holds expert e); with
    `counts_out` (GEMM1), CTA 0 copies the call's final counts there, for the combine (which then zeroes the kept
    counters) and for inspection. The caller publishes the tables to the CTA (a barrier) before reading them.
    Returns (tile_end, expert_count, expert_offset)."""
    tile_end = storage.tile_end.get_tensor(cute.make_layout(NUM_LOCAL_EXPERTS))
    expert_count = storage.expert_count.get_tensor(cute.make_layout(NUM_LOCAL_EXPERTS))
    expert_offset = storage.expert_offset.get_tensor(cute.make_layout(NUM_LOCAL_EXPERTS))
    if warp_id == 0:
        build_expert_tables(counts, block_tokens, tile_end, expert_count, expert_offset, lane)
        if cutlass.const_expr(counts_out is not None):
            if cta == 0:
                counts_out[lane] = expert_count[lane]
    return tile_end, expert_count, expert_offset


@cute.jit
def schedule_tables(
    storage,
    counts: cute.Tensor,
    block_tokens: cutlass.Constexpr,
    items_per_row_tile: cutlass.Constexpr,
    k_stages: cutlass.Constexpr,
    cta: Int32,
    grid: Int32,
    warp_id: Int32,
    lane: Int32,
    counts_out=None,
):
    """The persistent item walk's start, in every streaming GEMM: the expert tables (`fill_schedule_tables`), the
    CTA waits for them, and the CTA's stage count follows. Returns (tile_end, expert_count, expert_offset,
    total_stages)."""
    tile_end, expert_count, expert_offset = fill_schedule_tables(
        storage, counts, block_tokens, cta, warp_id, lane, counts_out
    )
    cute.arch.sync_threads()
    total_stages = cta_stage_count(tile_end, items_per_row_tile, k_stages, cta, grid)
    return tile_end, expert_count, expert_offset, total_stages


@cute.jit
def build_expert_tables(
    counts: cute.Tensor,
    block_tokens: cutlass.Constexpr,
    tile_end: cute.Tensor,
    expert_count: cute.Tensor,
    expert_offset: cute.Tensor,
    lane: Int32,
):
    """Warp 0 of a CTA: per local expert, its row tiles' inclusive prefix (`tile_end`), its token
    count and its packed-row offset (exclusive prefix of the counts); the caller syncs."""
    count = counts[lane]
    tiles = (count + block_tokens - 1) // block_tokens
    tiles_inclusive, rows_inclusive = lane_inclusive_sums((tiles, count), lane)
    tile_end[lane] = tiles_inclusive
    expert_count[lane] = count
    expert_offset[lane] = rows_inclusive - count


@cute.jit
def lane_inclusive_sums(values: tuple, lane: Int32) -> tuple:
    """Each of `values` summed over lanes 0..lane of the warp (a Hillis-Steele scan, the values' shuffles side by
    side at each step)."""
    sums = list(values)
    for shift in cutlass.range_constexpr(5):
        ups = [cute.arch.shuffle_sync_up(value, offset=1 << shift) for value in sums]
        if lane >= (1 << shift):
            sums = [value + up for value, up in zip(sums, ups)]
    return tuple(sums)


@cute.jit
def cta_stage_count(
    tile_end: cute.Tensor, items_per_row_tile: cutlass.Constexpr, k_stages: cutlass.Constexpr, cta: Int32, grid: Int32
):
    """Flat (item, K stage) steps of persistent CTA `cta` of `grid`: it takes items cta, cta + grid, ..."""
    total_items = tile_end[NUM_LOCAL_EXPERTS - 1] * items_per_row_tile
    my_items = cutlass.Int32(0)
    if cta < total_items:
        my_items = (total_items - cta + grid - 1) // grid
    return my_items * k_stages


@cute.jit
def take_walk_slot(slots: cute.Tensor, walk_groups: Int32, walk_slot: cute.Tensor):
    """Thread 0 of a three-CTA GEMM1 CTA: where the SM ids are dense (`%nsmid` is the grid's SM count and fits the kept
    buffer), draw this CTA's slot on its SM from the kept counter slots[smid]. A draw takes the word before an add of
    1, mod WALK_SLOT_ROUND; a CTA that draws WALK_SLOT_ROUND - 1 draws once more. The three CTAs of an SM thus take the
    first three values after the word's start that are not 3 mod 4, which are 0, 1 and 2 in some order whatever the
    word held: no call zeroes the buffer, and a word that anything left misaligned still gives every slot once. One
    redraw suffices: between a CTA's two draws the SM's other two CTAs take at most two values. Keep the slot in
    walk_slot[0]; elsewhere keep -1 (the walk then groups by CTA index). The CTA's threads read it after a barrier."""
    slot = Int32(-1)
    nsmid = cute.arch.nsmid()
    if nsmid == walk_groups and nsmid <= WALK_SLOT_WORDS:
        word = (slots.iterator + cute.arch.smid()).llvm_ptr
        # A mask, not %: the word passes 2**31 after 2**29 calls, where a signed remainder would turn negative.
        slot = cute.arch.atomic_add(word, Int32(1), scope="gpu") & (WALK_SLOT_ROUND - 1)
        if slot == WALK_SLOT_ROUND - 1:
            slot = cute.arch.atomic_add(word, Int32(1), scope="gpu") & (WALK_SLOT_ROUND - 1)
    walk_slot[0] = slot


@cute.jit
def locate_row_tile(
    row_tile: Int32,
    block_tokens: cutlass.Constexpr,
    tile_end: cute.Tensor,
    expert_count: cute.Tensor,
    expert_offset: cute.Tensor,
):
    """(local expert, first row within its list, valid rows, first packed row) of a row tile:
    the expert is the number of experts whose tiles end at or before it (binary lifting)."""
    expert = cutlass.Int32(0)
    for step_log in cutlass.range_constexpr(5):
        step = 16 >> step_log
        if tile_end[expert + step - 1] <= row_tile:
            expert = expert + step
    count = expert_count[expert]
    first_tile = tile_end[expert] - (count + block_tokens - 1) // block_tokens
    first_row = (row_tile - first_tile) * block_tokens
    valid_rows = cutlass.min(count - first_row, block_tokens)
    return expert, first_row, valid_rows, expert_offset[expert] + first_row


@cute.jit
def slot_token(
    expert_tokens: cute.Tensor, expert: Int32, first_row: Int32, valid_rows: Int32, token_slot: Int32
):
    """The token in `token_slot` of a row tile (0 past the tile's valid rows, where nothing reads it)."""
    token = cutlass.Int32(0)
    if token_slot < valid_rows:
        token = expert_tokens[expert, first_row + token_slot]
    return token


# ------------------------------------------------------------------------------------------------
# the kernel
# ------------------------------------------------------------------------------------------------


def stage_layouts(cfg: StreamingGemmConfig) -> tuple:
    """The shared-memory layouts of a streaming GEMM's pipeline, in elements (fp8 x and bf16 C alike): weights (bytes
    of a K block row, rows, K block of the stage, stage), activations (the same with the row tile's tokens), activation
    scales, weight block scales and the epilogue's partial sums. Called while a launch is traced."""
    ns, bt = cfg.num_stages, cfg.block_tokens
    w_layout = cute.make_layout(
        (BLOCK, ITEM_ROWS, BLOCKS_PER_STAGE, ns),
        stride=(1, BLOCK, ITEM_ROWS * BLOCK, BLOCKS_PER_STAGE * ITEM_ROWS * BLOCK),
    )
    x_layout = cute.make_layout(
        (BLOCK, bt, BLOCKS_PER_STAGE, ns), stride=(1, BLOCK, bt * BLOCK, BLOCKS_PER_STAGE * bt * BLOCK)
    )
    x_scale_layout = cute.make_layout((bt, BLOCKS_PER_STAGE, ns), stride=(1, bt, BLOCKS_PER_STAGE * bt))
    w_scale_layout = cute.make_layout(
        (BLOCKS_PER_STAGE, M_TILES, ns), stride=(1, BLOCKS_PER_STAGE, M_TILES * BLOCKS_PER_STAGE)
    )
    scratch_layout = cute.make_layout((bt, ITEM_ROWS, NUM_WARPS), stride=(1, bt, ITEM_ROWS * bt))
    return w_layout, x_layout, x_scale_layout, w_scale_layout, scratch_layout


def copy_atoms() -> tuple:
    """The streaming GEMMs' cp.async atoms, as `StreamingGemm.load_stage` takes them: 16 B of fp8, of bf16 and of fp32
    through L2 only, and 4 B of fp32 (the activation scales) through L1. Called while a kernel is traced."""
    return (
        cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Float8E4M3FN, num_bits_per_copy=128
        ),
        cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.BFloat16, num_bits_per_copy=128
        ),
        cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float32, num_bits_per_copy=128),
        cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), Float32, num_bits_per_copy=32),
    )


def launch_persistent(
    kernel, link: ChainLink, num_ctas: Int32, shared_storage, stream, cooperative: bool, threads: int = NUM_THREADS
) -> None:
    """Launch `kernel` (the kernel applied to its arguments) as a persistent grid of `num_ctas` CTAs (the host's,
    `PersistentGemmConfig.grid`) of `threads` threads (128, or 160 with the WGMMA GEMM1's producer warp) at `link` of
    the call's chain; `cooperative` where its CTAs meet (`routing.route_then_meet`: a GEMM1 that routes, the fused
    GEMMs). Every persistent GEMM launches through here, while its `launch` is traced."""
    kernel.launch(
        grid=[num_ctas, 1, 1],
        block=[threads, 1, 1],
        smem=shared_storage.size_in_bytes(),
        stream=stream,
        use_pdl=link.waits,
        cooperative=cooperative,
    )


class LinkedGemm:
    """An expert GEMM of a configuration at its place in the call's chain of launches (chain.py)."""

    def __init__(self, config, link: ChainLink = NO_CHAIN):
        self.cfg = config
        self.link = link

    def with_link(self, link: ChainLink):
        """The same GEMM at `link` of a chain of programmatic dependent launches."""
        return type(self)(self.cfg, link)

    def load_location(self, base, stride, s, tile_end, expert_count, expert_offset, expert_tokens, tidx, bases_args=()):
        """What the load side carries for the item of flat stage `s` of the CTA's walk base, base + stride, ...
        (the CTA and the grid, or a claimed item and 0): `locate_load`'s location followed by the thread's copy
        offsets of the item (the class's `item_bases`, given `bases_args` besides the item). Called while a kernel
        is traced; every streaming GEMM locates its items through here."""
        located = self.locate_load(base, stride, s, tile_end, expert_count, expert_offset, expert_tokens, tidx)
        item = base + (s // self.cfg.k_stages) * stride
        return (*located, *self.item_bases(located, item, *bases_args, tidx))

    @cute.jit
    def locate_load(
        self,
        base: Int32,
        stride: Int32,
        s: Int32,
        tile_end: cute.Tensor,
        expert_count: cute.Tensor,
        expert_offset: cute.Tensor,
        expert_tokens: cute.Tensor,
        tidx: Int32,
    ):
        """(expert, valid rows, GEMM1: this thread's token / GEMM2: the first packed row) of the item of
        flat stage `s`: located when the load of the item's first K stage is issued and kept in registers
        for its other K stages (locating it at every K stage puts binary searches over shared memory and the
        token's reload from global memory on the stage's critical path, ncu). For
        the configurations with `gemm1`, `k_stages`, `items_per_row_tile`, `block_tokens` and
        `threads_per_token` (this file's and `wgmma_gemm1.py`'s)."""
        cfg = self.cfg
        item = base + (s // cfg.k_stages) * stride
        expert, first_row, valid_rows, packed_row0 = locate_row_tile(
            item // cfg.items_per_row_tile, cfg.block_tokens, tile_end, expert_count, expert_offset
        )
        if cutlass.const_expr(cfg.gemm1):
            row_source = slot_token(expert_tokens, expert, first_row, valid_rows, tidx // cfg.threads_per_token)
        else:
            row_source = packed_row0
        return expert, valid_rows, row_source


class StreamingGemm(LinkedGemm):
    """Both expert GEMMs; `config.gemm1` picks operands and epilogue.

    GEMM1: x = hidden_states [T, 7168] e4m3 gathered by token, x_scale = [56, T],
           w = W13 [32, 4096, 7168], w_scale = [32, 32, 56], out = C [rows, 2048] bf16.
    GEMM2: x = C [rows, 2048] bf16 (packed rows), x_scale unused (C is unscaled),
           w = W2 [32, 7168, 2048], w_scale = [32, 56, 16], out = O [rows, 7168] fp32.
    """

    @cute.jit
    def launch(
        self,
        x: cute.Tensor,
        x_scale: cute.Tensor,
        w: cute.Tensor,
        w_scale: cute.Tensor,
        out: cute.Tensor,
        counts: cute.Tensor,
        expert_tokens: cute.Tensor,
        num_ctas: Int32,
        stream,
        routing=None,
        routed=None,
        counts_out=None,
    ):
        """`routing`: None, or (GEMM1 up to 1024 tokens) `routing.route_then_meet`'s tuple: the grid
        routes the tokens before its schedule. `routed` (GEMM2 with `weights_before_wait`): the kept count of routed
        tokens that GEMM1's grid completes (`counters.kept_routed`). `counts_out` (GEMM1): where CTA 0 copies
        the call's final counts (`schedule_tables`)."""
        cfg = self.cfg
        SharedStorage = cfg.shared_storage()
        w_layout, x_layout, x_scale_layout, w_scale_layout, scratch_layout = stage_layouts(cfg)

        kernel = self.kernel(
            x, x_scale, w, w_scale, out, counts, expert_tokens,
            w_layout, x_layout, x_scale_layout, w_scale_layout, scratch_layout, SharedStorage, routing, routed,
            counts_out,
        )  # fmt: skip
        launch_persistent(kernel, self.link, num_ctas, SharedStorage, stream, cooperative=routing is not None)

    @cute.kernel
    def kernel(
        self,
        x: cute.Tensor,
        x_scale: cute.Tensor,
        w: cute.Tensor,
        w_scale: cute.Tensor,
        out: cute.Tensor,
        counts: cute.Tensor,
        expert_tokens: cute.Tensor,
        w_layout: cute.Layout,
        x_layout: cute.Layout,
        x_scale_layout: cute.Layout,
        w_scale_layout: cute.Layout,
        scratch_layout: cute.Layout,
        SharedStorage: cutlass.Constexpr,
        routing,
        routed,
        counts_out,
    ):
        # With weights_before_wait, `griddepcontrol.wait` comes once the first stages' weights are on their way.
        enter(self.link, wait=not self.cfg.weights_before_wait)
        cfg = self.cfg
        bt = cfg.block_tokens
        ns = cfg.num_stages
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_id = tidx // 32
        lane = tidx % 32
        group = lane // 4  # MMA row group: weight rows g, g + 8; token g of an n8 tile
        quad = lane % 4  # MMA thread in group: K bytes 16 q .. 16 q + 15 of a 64-wide chunk

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        w_stages = storage.w_stages.get_tensor(w_layout)
        x_stages = storage.x_stages.get_tensor(x_layout)
        x_scales = storage.x_scales.get_tensor(x_scale_layout)
        w_scales = storage.w_scales.get_tensor(w_scale_layout)
        scratch = storage.scratch.get_tensor(scratch_layout)
        if cutlass.const_expr(routing is not None):
            choices = None
            if cutlass.const_expr(cfg.routing_per_cta):
                choices = storage.routing_choices.get_tensor(cute.make_layout(ROUTING_WARPS * TOP_K))
            route_then_meet(routing, counts, expert_tokens, cta, grid, tidx, choices)
        if cutlass.const_expr(cfg.weights_before_wait):
            # The counts are final once every routing CTA has added its tokens (before GEMM1 completes).
            if tidx == 0:
                wait_until_routed(routed, expert_tokens.shape[1])
            cute.arch.sync_threads()
        tile_end, expert_count, expert_offset, total_stages = schedule_tables(
            storage, counts, bt, cfg.items_per_row_tile, cfg.k_stages, cta, grid, warp_id, lane, counts_out
        )
        # The CTA's items: base, base + stride, ...
        base, stride = cta, grid

        g2s_16, g2s_16_x, g2s_16_f32, g2s_4_f32 = copy_atoms()

        # Each item is located once per side (located at every K stage, binary searches over shared memory and
        # the token's reload from global memory would sit on the stage's critical path). The next load's item:
        # (expert, valid rows, GEMM1: this thread's token, GEMM2: the first packed row) and its copies' per-thread
        # offsets, located when the load of its first K
        # stage is issued; the prologue's stages all belong to the CTA's first item. The computed item takes
        # its valid rows from there at its first K stage and locates its first packed row in its epilogue.
        located = self.load_location(
            base, stride, Int32(0), tile_end, expert_count, expert_offset, expert_tokens, tidx, (w_scale.layout,)
        )
        valid_rows = Int32(0)

        # ---- prologue: the first ns - 1 stages (with weights_before_wait: their weights and scales, then the
        # programmatic wait, then their activations; stage p's copies all land in commit group p or earlier) ----
        early = cfg.weights_before_wait
        for p in cutlass.range_constexpr(ns - 1):
            if p < total_stages:
                self.load_stage(
                    p, p, located, x, x_scale, w, w_scale, w_stages, x_stages, x_scales, w_scales, g2s_16, g2s_16_x,
                    g2s_16_f32, g2s_4_f32, tidx, activations=not early,
                )
            if cutlass.const_expr(not early):
                cute.arch.cp_async_commit_group()
        if cutlass.const_expr(early):
            cute.arch.griddepcontrol_wait()
            for p in cutlass.range_constexpr(ns - 1):
                if p < total_stages:
                    self.load_stage(
                        p, p, located, x, x_scale, w, w_scale, w_stages, x_stages, x_scales, w_scales, g2s_16,
                        g2s_16_x, g2s_16_f32, g2s_4_f32, tidx, weights=False,
                    )
                cute.arch.cp_async_commit_group()

        acc = cute.make_rmem_tensor((M_TILES * cfg.n_tiles * 4,), Float32)
        block_acc = cute.make_rmem_tensor((M_TILES * cfg.n_tiles * 4,), Float32)
        acc.fill(0.0)

        for s in cutlass.range(total_stages, unroll=1):
            # Stage s has landed once at most ns - 2 younger groups are pending; the barrier also
            # tells every thread that all warps are done with the slot the next load overwrites.
            cute.arch.cp_async_wait_group(ns - 2)
            cute.arch.sync_threads()
            if s + ns - 1 < total_stages:
                if (s + ns - 1) % cfg.k_stages == 0:
                    located = self.load_location(
                        base, stride, s + ns - 1, tile_end, expert_count, expert_offset, expert_tokens, tidx,
                        (w_scale.layout,),
                    )  # fmt: skip
                self.load_stage(
                    s + ns - 1, (s + ns - 1) % ns, located, x, x_scale, w, w_scale, w_stages, x_stages, x_scales,
                    w_scales, g2s_16, g2s_16_x, g2s_16_f32, g2s_4_f32, tidx,
                )
            cute.arch.cp_async_commit_group()

            valid_rows = self.compute_stage(
                s, base + (s // cfg.k_stages) * stride, located, valid_rows, acc, block_acc, w_stages, x_stages,
                x_scales, w_scales, scratch, out, tile_end, expert_count, expert_offset, warp_id, group, quad, tidx,
            )  # fmt: skip
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def compute_stage(
        self, s: Int32, item: Int32, located, valid_rows: Int32, acc: cute.Tensor, block_acc: cute.Tensor,
        w_stages: cute.Tensor, x_stages: cute.Tensor, x_scales: cute.Tensor, w_scales: cute.Tensor,
        scratch: cute.Tensor, out: cute.Tensor, tile_end: cute.Tensor, expert_count: cute.Tensor,
        expert_offset: cute.Tensor, warp_id: Int32, group: Int32, quad: Int32, tidx: Int32,
    ) -> Int32:  # fmt: skip
        """The compute side of flat stage `s` of `item`: its MMAs, and at the item's last K stage its epilogue. Returns
        the item's valid rows, which it takes from the load side's `located` at the item's first K stage: the load
        side located this item when it issued its first stage and has not moved on (k_stages >= num_stages);
        packed_row0 waits for the epilogue, a branch of its own (a location here predicated rather than branched
        around would be issued at every stage)."""
        cfg = self.cfg
        k_stage = s % cfg.k_stages
        if k_stage == 0:
            valid_rows = located[1]
            acc.fill(0.0)
        self.compute_block(
            s % cfg.num_stages, warp_id, group, quad, valid_rows, w_stages, x_stages, x_scales, w_scales, acc,
            block_acc,
        )  # fmt: skip
        if k_stage == cfg.k_stages - 1:
            _, _, _, packed_row0 = self.locate(item // cfg.items_per_row_tile, tile_end, expert_count, expert_offset)
            self.epilogue(
                acc, scratch, out, item % cfg.items_per_row_tile, packed_row0, valid_rows, warp_id, group, quad, tidx
            )
        return valid_rows

    @cute.jit
    def item_bases(self, located, item: Int32, w_scale_layout: cute.Layout, tidx: Int32):
        """(weights, activations, weight scales): this thread's element offsets of the item's first K stage, at
        its first weight row and 16-B chunk, at its token's row (GEMM1) or packed row (GEMM2), and at its m tile's
        block-scale row. Computed when the item is located and carried with the location, so that a stage's copy
        is base + the stage's K offset + a constant, instead of ~10 instructions per copy that rebuild its 64-bit
        address from expert, row and K at every stage."""
        cfg = self.cfg
        expert, _, row_source = located[0], located[1], located[2]
        chunks_per_row = STAGE_K // CHUNK
        w_row = item_weight_row(cfg.gemm1, item % cfg.items_per_row_tile, tidx // chunks_per_row)
        w_base = (expert * cfg.weight_rows + w_row) * cfg.k + (tidx % chunks_per_row) * CHUNK
        x_chunk_elems = CHUNK if cutlass.const_expr(cfg.gemm1) else CHUNK // 2
        x_row = row_source if cutlass.const_expr(cfg.gemm1) else row_source + tidx // cfg.threads_per_token
        x_base = x_row * cfg.k + (tidx % cfg.threads_per_token) * x_chunk_elems
        # Thread m < M_TILES loads m tile m's block scales; the others' offset stays in range, unused.
        scale_row = item_weight_scale_row(cfg.gemm1, item % cfg.items_per_row_tile, tidx % M_TILES)
        w_scale_base = cute.crd2idx((expert, scale_row, 0), w_scale_layout)
        return w_base, x_base, w_scale_base

    @cute.jit
    def locate(self, row_tile: Int32, tile_end: cute.Tensor, expert_count: cute.Tensor, expert_offset: cute.Tensor):
        return locate_row_tile(row_tile, self.cfg.block_tokens, tile_end, expert_count, expert_offset)

    @cute.jit
    def load_stage(
        self,
        s: Int32,
        slot: Int32,
        located,
        x: cute.Tensor,
        x_scale: cute.Tensor,
        w: cute.Tensor,
        w_scale: cute.Tensor,
        w_stages: cute.Tensor,
        x_stages: cute.Tensor,
        x_scales: cute.Tensor,
        w_scales: cute.Tensor,
        g2s_16: cute.CopyAtom,
        g2s_16_x: cute.CopyAtom,
        g2s_16_f32: cute.CopyAtom,
        g2s_4_f32: cute.CopyAtom,
        tidx: Int32,
        weights: cutlass.Constexpr = True,
        activations: cutlass.Constexpr = True,
    ):
        """Issue the cp.async copies of flat stage `s` of this CTA (weights, activations, scales); `located`
        is `locate_load`'s (expert, valid rows, token or first packed row) and `item_bases`' three offsets for the
        stage's item. `weights` (with their block scales) and `activations` (with theirs) choose the parts."""
        if cutlass.const_expr(weights):
            self.load_weights(s, slot, located, w, w_stages, g2s_16, tidx)
        if cutlass.const_expr(activations):
            self.load_activations(
                s, slot, located, x, x_scale, x_stages, x_scales, g2s_16, g2s_16_x, g2s_4_f32, tidx
            )
        if cutlass.const_expr(weights):
            self.load_weight_scales(s, slot, located, w_scale, w_scales, g2s_16_f32, tidx)

    @cute.jit
    def load_weights(self, s: Int32, slot: Int32, located, w: cute.Tensor, w_stages: cute.Tensor, g2s_16, tidx: Int32):
        """`load_stage`'s weight copies."""
        cfg = self.cfg
        k_stage = s % cfg.k_stages
        # ---- weights: 32 rows x 512 bytes; one warp reads one row's 512 contiguous bytes ----
        chunks_per_row = STAGE_K // CHUNK  # 32
        rows_per_pass = NUM_THREADS // chunks_per_row  # 4
        # Copy i reads row tidx / 32 + 4 i: item_weight_row(.., 4 i) rows past the thread's first one (16 % 4 == 0:
        # the gate half starts at a whole pass), K at the stage's offset.
        w_stage = w.iterator + cute.assume(located[3] + k_stage * STAGE_K, divby=CHUNK)
        for i in cutlass.range_constexpr(ITEM_ROWS * chunks_per_row // NUM_THREADS):
            linear = i * NUM_THREADS + tidx
            row = linear // chunks_per_row
            chunk = linear % chunks_per_row
            k_block = chunk // FP8_CHUNKS_PER_BLOCK_ROW
            in_block = chunk % FP8_CHUNKS_PER_BLOCK_ROW
            source = cute.make_tensor(
                w_stage + item_weight_row(cfg.gemm1, 0, i * rows_per_pass) * cfg.k, cute.make_layout(CHUNK)
            )
            cute.copy(
                g2s_16,
                source,
                cute.local_tile(w_stages[None, row, k_block, slot], (CHUNK,), (fp8_chunk_slot(in_block, row),)),
            )

    @cute.jit
    def load_activations(
        self, s: Int32, slot: Int32, located, x: cute.Tensor, x_scale: cute.Tensor, x_stages: cute.Tensor,
        x_scales: cute.Tensor, g2s_16, g2s_16_x, g2s_4_f32, tidx: Int32,
    ):  # fmt: skip
        """`load_stage`'s activation copies (and GEMM1's activation scales)."""
        cfg = self.cfg
        k_stage = s % cfg.k_stages
        valid_rows, row_source = located[1], located[2]
        chunks_per_row = STAGE_K // CHUNK  # 32
        # ---- activations: token t = tidx / threads_per_token, its chunks strided by that ----
        tpt = cfg.threads_per_token
        token_slot = tidx // tpt
        sub = tidx % tpt
        if token_slot < valid_rows:
            x_elems = CHUNK if cutlass.const_expr(cfg.gemm1) else CHUNK // 2
            x_stage = x.iterator + cute.assume(located[4] + k_stage * STAGE_K, divby=x_elems)
            if cutlass.const_expr(cfg.gemm1):
                token = row_source
                for i in cutlass.range_constexpr(chunks_per_row // tpt):
                    x_chunk = sub + i * tpt
                    x_k_block = x_chunk // FP8_CHUNKS_PER_BLOCK_ROW
                    x_in_block = x_chunk % FP8_CHUNKS_PER_BLOCK_ROW
                    x_source = cute.make_tensor(x_stage + i * tpt * CHUNK, cute.make_layout(CHUNK))
                    cute.copy(
                        g2s_16,
                        x_source,
                        cute.local_tile(
                            x_stages[None, token_slot, x_k_block, slot],
                            (CHUNK,),
                            (fp8_chunk_slot(x_in_block, token_slot),),
                        ),
                    )
                # activation scales of the stage's 4 K blocks: x_scale is [56, T] (transposed)
                if sub < BLOCKS_PER_STAGE:
                    cute.copy(
                        g2s_4_f32,
                        cute.local_tile(x_scale[k_stage * BLOCKS_PER_STAGE + sub, None], (1,), (token,)),
                        cute.local_tile(x_scales[None, sub, slot], (1,), (token_slot,)),
                    )
            else:
                bf16_chunk = CHUNK // 2  # bf16 elements per 16 B
                bf16_chunks_per_row = STAGE_K // bf16_chunk  # 64
                for i in cutlass.range_constexpr(bf16_chunks_per_row // tpt):
                    x_chunk = sub + i * tpt
                    x_k_block = x_chunk // BF16_CHUNKS_PER_BLOCK_ROW
                    x_in_block = x_chunk % BF16_CHUNKS_PER_BLOCK_ROW
                    x_source = cute.make_tensor(x_stage + i * tpt * bf16_chunk, cute.make_layout(bf16_chunk))
                    cute.copy(
                        g2s_16_x,
                        x_source,
                        cute.local_tile(
                            x_stages[None, token_slot, x_k_block, slot],
                            (bf16_chunk,),
                            (bf16_chunk_slot(x_in_block, token_slot),),
                        ),
                    )

    @cute.jit
    def load_weight_scales(
        self, s: Int32, slot: Int32, located, w_scale: cute.Tensor, w_scales: cute.Tensor, g2s_16_f32, tidx: Int32
    ):
        """`load_stage`'s weight block-scale copies."""
        cfg = self.cfg
        k_stage = s % cfg.k_stages
        # ---- weight block scales of the stage's 4 K blocks (16 B per scale row) ----
        if tidx < M_TILES:  # thread m loads the scales of m tile m
            scale_source = cute.make_tensor(
                w_scale.iterator + cute.assume(located[5] + k_stage * BLOCKS_PER_STAGE, divby=BLOCKS_PER_STAGE),
                cute.make_layout(BLOCKS_PER_STAGE),
            )
            cute.copy(g2s_16_f32, scale_source, w_scales[None, tidx, slot])

    @cute.jit
    def compute_block(
        self,
        slot: Int32,
        warp_id: Int32,
        group: Int32,
        quad: Int32,
        valid_rows: Int32,
        w_stages: cute.Tensor,
        x_stages: cute.Tensor,
        x_scales: cute.Tensor,
        w_scales: cute.Tensor,
        acc: cute.Tensor,
        block_acc: cute.Tensor,
    ):
        """This warp's K block (warp_id) of the stage in `slot`: block_acc = W_kb X_kb^T, then
        acc += block_acc * (x scale of the token x weight scale of the m tile)."""
        cfg = self.cfg
        use_bf16 = not cfg.gemm1
        block_acc.fill(0.0)
        for half in cutlass.range_constexpr(2):  # 64-wide K chunks of the block
            # A fragments of both m tiles (this thread's 16 bytes of rows g and g + 8), converted once
            # for all n tiles: a_frags[(mt * 4 + j) * 4 + r] is register a_r of MMA j.
            a_frags = cute.make_rmem_tensor((M_TILES * 4 * 4,), Int32)
            for mt in cutlass.range_constexpr(M_TILES):
                row_g = mt * 16 + group
                row_g8 = row_g + 8
                words_g = lds_shared(
                    w_stages[None, row_g, warp_id, slot].iterator
                    + fp8_chunk_slot(fp8_thread_chunk(half, quad), row_g) * CHUNK,
                    4,
                )
                words_g8 = lds_shared(
                    w_stages[None, row_g8, warp_id, slot].iterator
                    + fp8_chunk_slot(fp8_thread_chunk(half, quad), row_g8) * CHUNK,
                    4,
                )
                for j in cutlass.range_constexpr(4):
                    for r in cutlass.range_constexpr(4):
                        row_offset, high = A_REGISTER_SOURCES[r]
                        word = (words_g, words_g8)[row_offset // 8][j]
                        a_frags[(mt * 4 + j) * 4 + r] = _e4m3x2_to_mma_input(word, high, use_bf16)
            for nt in cutlass.range_constexpr(cfg.n_tiles):
                if nt * 8 < valid_rows:
                    token_slot = nt * 8 + group
                    x_row = x_stages[None, token_slot, warp_id, slot]
                    b_words = cute.make_rmem_tensor((8,), Int32)  # b_words[2 j + r]: register b_r of MMA j
                    if cutlass.const_expr(cfg.gemm1):
                        x_words = lds_shared(
                            x_row.iterator + fp8_chunk_slot(fp8_thread_chunk(half, quad), token_slot) * CHUNK, 4
                        )
                        for j in cutlass.range_constexpr(4):
                            for r in cutlass.range_constexpr(2):
                                b_words[2 * j + r] = e4m3x2_to_f16x2(x_words[j], B_REGISTER_HIGH_HALF[r])
                    else:
                        # bf16 elements 64 half + 16 q .. + 15: words 4 c .. 4 c + 3 from chunk c; word
                        # 2 j + r holds elements 16 q + 4 j + 2 r, + 1, exactly the K slots of b_r of MMA j
                        for c in cutlass.range_constexpr(2):
                            chunk = bf16_chunk_slot(bf16_thread_chunk(half, quad, c), token_slot)
                            x_words = lds_shared(x_row.iterator + chunk * (CHUNK // 2), 4)
                            for w in cutlass.range_constexpr(4):
                                b_words[4 * c + w] = x_words[w]
                    for mt in cutlass.range_constexpr(M_TILES):
                        for j in cutlass.range_constexpr(4):
                            a_base = (mt * 4 + j) * 4
                            base = (mt * cfg.n_tiles + nt) * 4
                            d0, d1, d2, d3 = _mma_16816(
                                a_frags[a_base], a_frags[a_base + 1], a_frags[a_base + 2], a_frags[a_base + 3],
                                b_words[2 * j], b_words[2 * j + 1],
                                block_acc[base + 0], block_acc[base + 1], block_acc[base + 2], block_acc[base + 3],
                                use_bf16,
                            )
                            block_acc[base + 0] = d0
                            block_acc[base + 1] = d1
                            block_acc[base + 2] = d2
                            block_acc[base + 3] = d3

        # ---- promotion (per 128-wide block): acc += block_acc * (x scale * w scale) ----
        for nt in cutlass.range_constexpr(cfg.n_tiles):
            if nt * 8 < valid_rows:
                for mt in cutlass.range_constexpr(M_TILES):
                    w_block_scale = w_scales[warp_id, mt, slot]
                    for i in cutlass.range_constexpr(4):
                        index = (mt * cfg.n_tiles + nt) * 4 + i
                        if cutlass.const_expr(cfg.gemm1):
                            _, token_slot = accumulator_coords(mt, nt, i, group, quad)
                            scale = x_scales[token_slot, warp_id, slot] * w_block_scale
                        else:
                            scale = w_block_scale
                        acc[index] = acc[index] + block_acc[index] * scale

    @cute.jit
    def epilogue(
        self,
        acc: cute.Tensor,
        scratch: cute.Tensor,
        out: cute.Tensor,
        n_tile: Int32,
        packed_row0: Int32,
        valid_rows: Int32,
        warp_id: Int32,
        group: Int32,
        quad: Int32,
        tidx: Int32,
    ):
        """Sum the 4 warps' partial sums in warp order, then write C = silu(gate) * up (GEMM1, bf16)
        or O (GEMM2, fp32) for the item's valid tokens."""
        cfg = self.cfg
        bt = cfg.block_tokens
        for nt in cutlass.range_constexpr(cfg.n_tiles):
            if nt * 8 < valid_rows:
                for mt in cutlass.range_constexpr(M_TILES):
                    for i in cutlass.range_constexpr(4):
                        row, token_slot = accumulator_coords(mt, nt, i, group, quad)
                        scratch[token_slot, row, warp_id] = acc[(mt * cfg.n_tiles + nt) * 4 + i]
        cute.arch.sync_threads()
        if cutlass.const_expr(cfg.gemm1):
            for i in cutlass.range_constexpr(GEMM1_ITEM_COLUMNS * bt // NUM_THREADS):
                linear = i * NUM_THREADS + tidx
                token_slot = linear // GEMM1_ITEM_COLUMNS
                column = linear % GEMM1_ITEM_COLUMNS
                if token_slot < valid_rows:
                    up = scratch[token_slot, column, 0]
                    gate = scratch[token_slot, GEMM1_ITEM_COLUMNS + column, 0]
                    for wp in cutlass.range_constexpr(1, NUM_WARPS):
                        up = up + scratch[token_slot, column, wp]
                        gate = gate + scratch[token_slot, GEMM1_ITEM_COLUMNS + column, wp]
                    out[packed_row0 + token_slot, n_tile * GEMM1_ITEM_COLUMNS + column] = swiglu_bf16(gate, up)
        else:
            for i in cutlass.range_constexpr(ITEM_ROWS * bt // NUM_THREADS):
                linear = i * NUM_THREADS + tidx
                token_slot = linear // ITEM_ROWS
                row = linear % ITEM_ROWS
                if token_slot < valid_rows:
                    total = scratch[token_slot, row, 0]
                    for wp in cutlass.range_constexpr(1, NUM_WARPS):
                        total = total + scratch[token_slot, row, wp]
                    out[packed_row0 + token_slot, n_tile * ITEM_ROWS + row] = total
