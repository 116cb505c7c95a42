"""How fast one grid of CTAs can stream fp8 expert weights from DRAM on this GPU, by copy form, with nothing else to do.

    uv run kernels/moe/probes/weight_stream_probe.py [--items 264,384,528] [--repeats 30]

Why: the MoE's one row below 3.0 TB/s is 1 token (kernels/moe/NOTES.md, Open directions): ~88 MB of two experts' weights in
38.3 us (2.28 TB/s) where the bar asks 29.4 us, and GEMM1 alone streams its 58.7 MB at ~2.6 TB/s after the routing.
Whether the `mma.sync` GEMMs' copy form (16-B `cp.async` of 32 weight rows x 512 B per K stage, four stages, two CTAs
per SM) or the work around it sets that rate decides what a 1-token design can reach. This times copy forms alone,
each reading 229,376-byte items (32 rows of 7168 B: one GEMM1 item) into a shared-memory ring and discarding them:

- `rows`: the GEMM's form: K stage s of an item is 512 B of each of its 32 rows (16-B `cp.async.cg`, a warp per
  row's 512 B), stages-1 stages in flight, a CTA barrier per stage;
- `contiguous`: the same copies and barriers, but K stage s is the item's bytes [16 KB s, 16 KB (s + 1)): what
  reading whole rows in order would give;
- `bulk`: the contiguous stages as one `cp.async.bulk` each, issued by thread 0 onto the slot's mbarrier;
- `bulk_rows`: the `rows` stages as 32 bulk copies of 512 B (one per row, warp 0's lanes) onto the slot's mbarrier;
- `after a load`: thread 0 first loads a word of a buffer that the L2 flush evicted and the CTA's item addresses add
  it (zero): the least any routed stream waits before its first request (the routing reads its logits first).

Each form runs at its CTAs per SM (grid = SMs x that), CTA c reading items c, c + grid, ..., over buffers of --items
items: 264 is one item per CTA at two CTAs per SM (as GEMM1's 256 items at 1 token), 384 is the 88 MB of two experts'
W13 and W2 (the 1-token row's 2-expert trial), 528 two items per CTA.
Timed like the runner (`hopperbench.timing.time_cold_l2`: CUPTI kernel span, L2 flushed before every call, medians of
--repeats); a torch copy of the same buffer (reads and writes) is the last row. Exits 2 without CUDA or on bad
arguments, with one line on stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from hopperbench.devcheck import load_folder_module
from hopperbench.paths import REPO_ROOT

# The geometry of the `mma.sync` GEMMs whose copies the `rows` form repeats, from the kernel itself.
gemm = load_folder_module(REPO_ROOT / "kernels" / "moe", "moe_solution", "streaming_gemm")

ROW_BYTES = gemm.HIDDEN  # one W13 row (K = hidden size) of fp8 weights
ITEM_ROWS = gemm.ITEM_ROWS  # weight rows per GEMM1 item
ITEM_BYTES = ROW_BYTES * ITEM_ROWS
ROW_STAGE_BYTES = gemm.STAGE_K  # K bytes of each row per K stage
STAGE_BYTES = ITEM_ROWS * ROW_STAGE_BYTES  # 16 KB
STAGES_PER_ITEM = ITEM_BYTES // STAGE_BYTES  # 14
THREADS = gemm.NUM_THREADS
CHUNK = gemm.CHUNK  # bytes per `cp.async`
COPIES_PER_THREAD = STAGE_BYTES // (CHUNK * THREADS)  # 8
FORMS = ("rows", "contiguous", "bulk", "bulk_rows")

assert ROW_BYTES % ROW_STAGE_BYTES == 0 and STAGE_BYTES % (CHUNK * THREADS) == 0


def stage_chunk_offset(form: str, stage, chunk):
    """Byte offset inside an item of 16-B chunk `chunk` (0 .. STAGE_BYTES / 16 - 1) of K stage `stage`. `rows`: the
    32 chunks of one row's 512 B are consecutive chunks (a warp's copies cover one row); else the stage's bytes in
    order. Plain arithmetic, so the kernel traces it and the tests call it with ints."""
    if form == "rows":
        row_chunks = ROW_STAGE_BYTES // CHUNK
        return (chunk // row_chunks) * ROW_BYTES + stage * ROW_STAGE_BYTES + (chunk % row_chunks) * CHUNK
    return stage * STAGE_BYTES + chunk * CHUNK


def bulk_row_offset(stage, row):
    """Byte offset inside an item of row `row`'s 512 B of K stage `stage` (the `bulk_rows` form's copy of lane row)."""
    return row * ROW_BYTES + stage * ROW_STAGE_BYTES


@dataclass(frozen=True)
class ProbeConfig:
    form: str
    stages: int = 4
    ctas_per_sm: int = 2
    # Thread 0 first loads a word of a cold buffer, and the CTA's item addresses depend on it: a stream that can start
    # only after one dependent DRAM round trip, as a routed expert's weights can start only after the routing's loads.
    dependent_start: bool = False

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {', '.join(FORMS)}, got {self.form!r}")
        if self.stages < 2 or self.ctas_per_sm < 1:
            raise ValueError(f"need stages >= 2 and ctas_per_sm >= 1, got {self.stages} and {self.ctas_per_sm}")
        if self.ctas_per_sm * (self.smem_bytes() + gemm.SMEM_RESERVED_PER_CTA) > gemm.SMEM_PER_SM:
            raise ValueError(
                f"{self.ctas_per_sm} CTAs of {self.stages} x 16-KB stages do not fit one SM's shared memory"
            )

    def smem_bytes(self) -> int:
        return self.stages * STAGE_BYTES + 8 * self.stages  # the ring and one mbarrier per slot

    @property
    def label(self) -> str:
        start = ", after a load" if self.dependent_start else ""
        return f"{self.form}, {self.stages} stages, {self.ctas_per_sm} CTA/SM{start}"


class _StreamProbe:
    """A flat loop over (item, K stage) of the CTA's items, stages-1 stages in flight, one CTA barrier per stage (where
    the GEMMs' warps would consume the stage); the data is never read."""

    def __init__(self, config: ProbeConfig):
        self.config = config
        self.bulk = config.form.startswith("bulk")

    @cute.jit
    def __call__(self, buffer: cute.Tensor, start: cute.Tensor, ctas: cutlass.Int32, stream):
        self.kernel(buffer, start).launch(
            grid=[ctas, 1, 1], block=[THREADS, 1, 1], smem=self.config.smem_bytes() + 128, stream=stream
        )

    @cute.kernel
    def kernel(self, buffer: cute.Tensor, start: cute.Tensor):
        stages = self.config.stages
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(stages * STAGE_BYTES), byte_alignment=128)
        full = smem.allocate_array(cutlass.Int64, stages)
        shift = smem.allocate_array(cutlass.Int32, 1)
        items = buffer.shape[0] // ITEM_BYTES
        my_items = (items - cta + ctas - 1) // ctas
        steps = my_items * STAGES_PER_ITEM
        first_item = cta
        if cutlass.const_expr(self.config.dependent_start):
            if tidx == 0:
                shift[0] = start[cta % start.shape[0]]  # zero: the items do not move, but their addresses wait for it
            cute.arch.sync_threads()
            first_item = cta + shift[0]
        if cutlass.const_expr(self.bulk):
            if tidx == 0:
                for slot in cutlass.range_constexpr(stages):
                    cute.arch.mbarrier_init(full + slot, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
        for step in cutlass.range_constexpr(stages - 1):
            if step < steps:
                self.issue(buffer, ring, full, first_item, ctas, step, tidx)
            if cutlass.const_expr(not self.bulk):
                cute.arch.cp_async_commit_group()
        for step in cutlass.range(steps, unroll=1):
            if cutlass.const_expr(self.bulk):
                cute.arch.mbarrier_wait(full + step % stages, (step // stages) % 2)
            else:
                cute.arch.cp_async_wait_group(stages - 2)
            # Every thread is past stage step - 1, whose slot the next issue refills.
            cute.arch.sync_threads()
            if step + stages - 1 < steps:
                self.issue(buffer, ring, full, first_item, ctas, step + stages - 1, tidx)
            if cutlass.const_expr(not self.bulk):
                cute.arch.cp_async_commit_group()
        if cutlass.const_expr(not self.bulk):
            cute.arch.cp_async_wait_group(0)

    @cute.jit
    def issue(self, buffer, ring, full, first_item, ctas, step, tidx):
        stages = self.config.stages
        item = first_item + (step // STAGES_PER_ITEM) * ctas
        stage = step % STAGES_PER_ITEM
        slot = step % stages
        base = item * ITEM_BYTES
        slot_base = ring.iterator + slot * STAGE_BYTES
        if cutlass.const_expr(self.config.form == "bulk"):
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(full + slot, STAGE_BYTES)
                self.bulk_copy(slot_base, buffer.iterator + base + stage * STAGE_BYTES, STAGE_BYTES, full + slot)
        elif cutlass.const_expr(self.config.form == "bulk_rows"):
            if tidx < ITEM_ROWS:
                if tidx == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(full + slot, STAGE_BYTES)
                cute.arch.sync_warp()  # the bytes are expected before any copy can complete
                source = buffer.iterator + base + bulk_row_offset(stage, tidx)
                self.bulk_copy(slot_base + tidx * ROW_STAGE_BYTES, source, ROW_STAGE_BYTES, full + slot)
        else:
            copy = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Uint8, num_bits_per_copy=CHUNK * 8
            )
            for j in cutlass.range_constexpr(COPIES_PER_THREAD):
                chunk = j * THREADS + tidx
                offset = base + stage_chunk_offset(self.config.form, stage, chunk)
                source = cute.make_tensor(buffer.iterator + cute.assume(offset, divby=CHUNK), cute.make_layout(CHUNK))
                destination = cute.local_tile(ring, (CHUNK,), (slot * (STAGE_BYTES // CHUNK) + chunk,))
                cute.copy(copy, source, destination)

    @cute.jit
    def bulk_copy(self, destination, source, num_bytes: cutlass.Constexpr, barrier):
        cute.arch.inline_ptx(
            f"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{{$r0}}], [{{$r1}}], {num_bytes}, [{{$r2}}];",
            read_only_args=[
                cutlass.Int32(destination.toint()),
                cutlass.Int64(source.toint()),
                cutlass.Int32(barrier.toint()),
            ],
        )


def compiled_probe(config: ProbeConfig) -> Callable:
    """The probe for sm_90a as a TVM-FFI function (needs no GPU): (uint8 buffer, int32 zeros, CTAs)."""
    buffer = make_fake_compact_tensor(cutlass.Uint8, (cute.sym_int(),), assumed_align=128)
    start = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    return cute.compile(
        _StreamProbe(config), buffer, start, 0, make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi --gpu-arch sm_90a",
    )  # fmt: skip


CONFIGS = (
    ProbeConfig("rows"),
    ProbeConfig("contiguous"),
    ProbeConfig("bulk"),
    ProbeConfig("bulk_rows"),
    ProbeConfig("rows", stages=6),
    ProbeConfig("bulk", stages=6),
    ProbeConfig("bulk", stages=12, ctas_per_sm=1),
    ProbeConfig("rows", dependent_start=True),
    ProbeConfig("bulk", stages=12, ctas_per_sm=1, dependent_start=True),
)


def _counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"takes positive counts separated by commas, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=_counts, default=[264, 384, 528], help="items per buffer (229,376 B each)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        print("weight_stream_probe: --repeats must be >= 1", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("weight_stream_probe: needs a CUDA device", file=sys.stderr)
        return 2
    from hopperbench.timing import empty_kernel_span_ms, time_cold_l2

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    start = torch.zeros(4096, dtype=torch.int32, device="cuda")  # evicted by every call's L2 flush, like routing logits
    print(f"empty-kernel span {1e3 * empty_kernel_span_ms(device='cuda'):.2f} us; medians of {args.repeats}")
    print(f"{'form':<36} {'items':>6} {'MB':>7} {'span us':>8} {'TB/s':>6}")
    for config in CONFIGS:
        probe = compiled_probe(config)
        for items in args.items:
            buffer = torch.randint(0, 256, (items * ITEM_BYTES,), dtype=torch.uint8, device="cuda")
            call = (buffer, start, sms * config.ctas_per_sm)
            span_us = 1e3 * statistics.median(time_cold_l2(probe, call, 3, args.repeats))
            megabytes = buffer.numel() / 1e6
            print(f"{config.label:<36} {items:>6} {megabytes:>7.1f} {span_us:>8.2f} {megabytes / span_us:>6.2f}")
    for items in args.items:
        source = torch.randint(0, 256, (items * ITEM_BYTES,), dtype=torch.uint8, device="cuda")
        target = torch.empty_like(source)
        span_us = 1e3 * statistics.median(time_cold_l2(target.copy_, (source,), 3, args.repeats))
        megabytes = source.numel() / 1e6
        print(f"{'torch copy (read + write: 2x MB)':<36} {items:>6} {megabytes:>7.1f} {span_us:>8.2f} "
              f"{2 * megabytes / span_us:>6.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
