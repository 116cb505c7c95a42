"""The least time any DSA kernel can take on this GPU: a bare gather of a workload's selected cache rows, against its floor.

    uv run kernels/dsa_attention/probes/dsa_gather_probe.py [--workloads 0,1,13,11,9] [--ctas 132] [--repeats 30]

Why: the DSA bar is latency / floor <= 2.0 (geometric mean over the 23 workloads), floor = the workload's minimal
bytes at 4.3 TB/s plus the CUPTI span of an empty kernel; `kernel.py` is at about 3.4 (kernels/dsa_attention/NOTES.md).
Any kernel must read each token's 2048 row ids and then the rows they name; this
times only that chain, with nothing else (no Q, no compute, no partials, no merge, no output), so its span / floor is
a lower bound of what a real kernel's can be, per workload.

One CTA per SM (256 threads; --ctas takes fewer, e.g. `kernel.py`'s T x splits); the workload's T x 2048 (token, slot)
pairs are split into equal runs, one per CTA. A CTA loads its run's row ids (one per thread), puts them in shared
memory, then issues every 16-B `cp.async` of its valid rows at once (the 1024-B ckv part and the 128-B kpe part of each
row; padding skipped) and waits for them: all of its bytes in flight together, more than any pipelined kernel keeps. Inputs: the runner's synthesized inputs of each
workload (seed 0, trial 0). Timed like the runner (`hopperbench.timing.time_cold_l2`: CUPTI span, L2 flushed before
every call, medians of --repeats); the floor is `hopperbench.floors`' with the empty-kernel span measured here, and the
last column is `kernel.py`'s span on the same inputs in the same protocol. Exits 2 without CUDA or on bad arguments,
with one line on stderr.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from hopperbench.devcheck import load_folder_module
from hopperbench.paths import REPO_ROOT

ours = load_folder_module(REPO_ROOT / "kernels" / "dsa_attention", "dsa_solution", "kernel")

TOPK = ours.TOPK
CKV_BYTES = 2 * ours.CKV_DIM  # bf16
KPE_BYTES = 2 * ours.KPE_DIM
ROW_BYTES = CKV_BYTES + KPE_BYTES
CHUNK = 16
CHUNKS_PER_ROW = ROW_BYTES // CHUNK  # 72: 64 ckv chunks, then 8 kpe chunks
CKV_CHUNKS = CKV_BYTES // CHUNK
THREADS = 256
MAX_ROWS_PER_CTA = 128  # 147 KB of rows: 8 tokens on 132 SMs need 125
SMEM_BYTES = MAX_ROWS_PER_CTA * ROW_BYTES + MAX_ROWS_PER_CTA * 4


def rows_per_cta(pairs: int, ctas: int) -> int:
    """The run of (token, slot) pairs each CTA gathers."""
    return math.ceil(pairs / ctas)


def chunk_source(row_id, chunk):
    """(tensor, byte offset) of 16-B chunk `chunk` (0..71) of cache row `row_id`: 0 = the ckv cache, 1 = the kpe cache.
    Plain arithmetic, written branch-free, so that the kernel traces it and the tests call it with ints."""
    kpe = chunk // CKV_CHUNKS
    return kpe, (1 - kpe) * (row_id * CKV_BYTES + chunk * CHUNK) + kpe * (
        row_id * KPE_BYTES + (chunk - CKV_CHUNKS) * CHUNK
    )


class _BareGather:
    @cute.jit
    def __call__(self, ckv: cute.Tensor, kpe: cute.Tensor, indices: cute.Tensor, ctas: cutlass.Int32, stream):
        self.kernel(ckv, kpe, indices).launch(
            grid=[ctas, 1, 1], block=[THREADS, 1, 1], smem=SMEM_BYTES + 128, stream=stream
        )

    @cute.kernel
    def kernel(self, ckv: cute.Tensor, kpe: cute.Tensor, indices: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        smem = cutlass.memory.SmemAllocator()
        rows = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(MAX_ROWS_PER_CTA * ROW_BYTES), byte_alignment=128)
        row_ids = smem.allocate_tensor(cutlass.Int32, cute.make_layout(MAX_ROWS_PER_CTA), byte_alignment=16)
        pairs = indices.shape[0]
        run = (pairs + ctas - 1) // ctas
        first = cta * run
        count = cutlass.min(run, pairs - first)
        if tidx < count:
            row_ids[tidx] = indices[first + tidx]
        cute.arch.sync_threads()
        copy = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Uint8, num_bits_per_copy=CHUNK * 8
        )
        for j in cutlass.range(tidx, count * CHUNKS_PER_ROW, THREADS, unroll=1):
            row = j // CHUNKS_PER_ROW
            chunk = j % CHUNKS_PER_ROW
            row_id = row_ids[row]
            if row_id >= 0:
                kpe_part, offset = chunk_source(row_id, chunk)
                destination = cute.local_tile(rows, (CHUNK,), (j,))
                if kpe_part == 0:
                    source = cute.make_tensor(ckv.iterator + cute.assume(offset, divby=CHUNK), cute.make_layout(CHUNK))
                    cute.copy(copy, source, destination)
                else:
                    source = cute.make_tensor(kpe.iterator + cute.assume(offset, divby=CHUNK), cute.make_layout(CHUNK))
                    cute.copy(copy, source, destination)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)


def compiled_gather() -> Callable:
    """The bare gather for sm_90a as a TVM-FFI function (needs no GPU): (uint8 ckv rows, uint8 kpe rows, int32 flat
    row ids, CTAs)."""
    ckv, kpe = (make_fake_compact_tensor(cutlass.Uint8, (cute.sym_int(),), assumed_align=16) for _ in range(2))
    int32 = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=16)
    return cute.compile(
        _BareGather(), ckv, kpe, int32, 0, make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi --gpu-arch sm_90a",
    )  # fmt: skip


def _indices(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part]
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"takes workload indices separated by commas, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", type=_indices, default=[0, 1, 13, 11, 9], help="indices of the workload list")
    parser.add_argument("--ctas", type=int, default=0, help="gathering CTAs, one per SM at most (0: every SM)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.ctas < 0:
        print("dsa_gather_probe: --repeats must be >= 1 and --ctas >= 0", file=sys.stderr)
        return 2
    import torch

    from hopperbench.floors import floor
    from hopperbench.synth import make_inputs
    from hopperbench.timing import empty_kernel_span_ms, time_cold_l2
    from hopperbench.workloads import load_workloads

    workloads = load_workloads("dsa_attention")
    if max(args.workloads) >= len(workloads):
        print(
            f"dsa_gather_probe: the list has {len(workloads)} workloads, got index {max(args.workloads)}",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        print("dsa_gather_probe: needs a CUDA device", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas = args.ctas or sms
    if ctas > sms:
        print(f"dsa_gather_probe: at most {sms} CTAs (one per SM), got {ctas}", file=sys.stderr)
        return 2
    gather = compiled_gather()
    t_lat_us = 1e3 * empty_kernel_span_ms(device="cuda")
    print(f"empty-kernel span {t_lat_us:.2f} us; the gather on {ctas} CTAs; medians of {args.repeats}")
    print(f"{'index':>5} {'T':>3} {'rows':>6} {'distinct':>8} {'floor us':>8} {'gather us':>9} {'gather/floor':>12} "
          f"{'ours us':>8} {'ours/floor':>10}")  # fmt: skip
    for index in args.workloads:
        workload = workloads[index]
        inputs = make_inputs("dsa_attention", workload, 0, 0, "cuda")
        indices = inputs["sparse_indices"]
        if rows_per_cta(indices.numel(), ctas) > MAX_ROWS_PER_CTA:
            print(
                f"dsa_gather_probe: workload {index} has more rows than {ctas} CTAs of {MAX_ROWS_PER_CTA} hold",
                file=sys.stderr,
            )
            return 2
        ckv = inputs["ckv_cache"].view(torch.uint8).reshape(-1)
        kpe = inputs["kpe_cache"].view(torch.uint8).reshape(-1)
        flat = indices.to(torch.int32).reshape(-1).contiguous()
        gather_us = 1e3 * statistics.median(time_cold_l2(gather, (ckv, kpe, flat, ctas), 3, args.repeats))
        output = torch.empty_like(inputs["q_nope"])
        lse = torch.empty(inputs["q_nope"].shape[:2], dtype=torch.float32, device="cuda")
        call = (*inputs.values(), output, lse)
        ours_us = 1e3 * statistics.median(time_cold_l2(ours.run, call, 3, args.repeats))
        workload_floor = floor("dsa_attention", workload.axes, t_lat_us=t_lat_us, inputs=inputs)
        valid = indices[indices >= 0]
        print(
            f"{index:>5} {indices.shape[0]:>3} {valid.numel():>6} {torch.unique(valid).numel():>8} "
            f"{workload_floor.floor_us:>8.2f} {gather_us:>9.2f} {gather_us / workload_floor.floor_us:>12.2f} "
            f"{ours_us:>8.2f} {ours_us / workload_floor.floor_us:>10.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
