"""Which SM each CTA of a persistent grid lands on: why the MoE's three-CTA GEMM1 walks by SM id, not by CTA index.

    uv run kernels/moe/probes/cta_placement.py [--ctas-per-sm 3] [--smem-bytes N] [--repeats 10]

A walk over the CTA index that splits the items of each group of CTAs {g, g + S, g + 2S} (S = grid / ctas-per-sm)
between them assumes the block scheduler puts a group on one SM. This
launches, cooperatively as GEMM1 is, grids of SMs x ctas-per-sm CTAs of 128 threads holding the given dynamic shared
memory (default: the three-CTA GEMM1's, MEDIUM_T's), records `%smid` of every CTA, and prints per launch how
many groups {g + k S} share one SM (on an H200: none; hence the walks by SM id). Exits 2 without CUDA, with one line
on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from hopperbench.devcheck import load_folder_module
from hopperbench.paths import REPO_ROOT

THREADS = 128


def groups_on_one_sm(smids: Sequence[int], ctas_per_sm: int) -> int:
    """How many of the S = len(smids) / ctas_per_sm groups {c, c + S, ...} have all their CTAs on one SM, that SM
    holding no CTA of another group."""
    sms = len(smids) // ctas_per_sm
    group_of_sm: dict[int, set[int]] = {}
    for cta, smid in enumerate(smids):
        group_of_sm.setdefault(smid, set()).add(cta % sms)
    whole = 0
    for group in range(sms):
        places = {smids[group + k * sms] for k in range(ctas_per_sm)}
        whole += len(places) == 1 and group_of_sm[places.pop()] == {group}
    return whole


class _Probe:
    """CTA c writes its SM id into out[c]; a cooperative launch with `smem_bytes` of dynamic shared memory per CTA."""

    def __init__(self, smem_bytes: int):
        self.smem_bytes = smem_bytes

    @cute.jit
    def __call__(self, out: cute.Tensor, stream):
        self.kernel(out).launch(
            grid=[out.shape[0], 1, 1], block=[THREADS, 1, 1], smem=self.smem_bytes, stream=stream, cooperative=True
        )

    @cute.kernel
    def kernel(self, out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        if tidx == 0:
            out[cta] = cute.arch.smid()


def _probe(smem_bytes: int):
    """The compiled probe for sm_90a (needs no GPU)."""
    out = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(_Probe(smem_bytes), out, stream, options="--enable-tvm-ffi --gpu-arch sm_90a")


def three_cta_gemm1_smem_bytes() -> int:
    """The dynamic shared memory of `kernel.py`'s three-CTA GEMM1 (MEDIUM_T's, on WGMMA)."""
    # kernels/ is not a package: its folder is loaded as one, as the harness does (the same module test_moe_kernel.py
    # gets, so no second compile cache).
    kernel = load_folder_module(REPO_ROOT / "kernels" / "moe", "moe_solution", "kernel")
    return kernel.MEDIUM_T.gemm1().smem_bytes()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctas-per-sm", type=int, default=3)
    parser.add_argument("--smem-bytes", type=int, help="default: kernel.py's three-CTA GEMM1's")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--print-smids", action="store_true", help="also print every CTA's SM id")
    args = parser.parse_args(argv)
    if args.smem_bytes is None:
        args.smem_bytes = three_cta_gemm1_smem_bytes()
    import torch

    if not torch.cuda.is_available():
        print("cta_placement: needs a CUDA device", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    probe = _probe(args.smem_bytes)
    print(f"{sms} SMs, {args.ctas_per_sm} CTAs per SM of {THREADS} threads, {args.smem_bytes} B of shared memory each")
    for repeat in range(args.repeats):
        out = torch.full((sms * args.ctas_per_sm,), -1, dtype=torch.int32, device="cuda")
        probe(out)
        torch.cuda.synchronize()
        smids = out.tolist()
        whole = groups_on_one_sm(smids, args.ctas_per_sm)
        print(f"launch {repeat}: {whole} of {sms} groups {{c + k {sms}}} on one SM each; first CTAs' SMs {smids[:6]}")
        if args.print_smids:
            print(f"  SM of each CTA: {smids}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
