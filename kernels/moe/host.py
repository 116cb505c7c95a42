"""The host side of `kernel.py`'s variants: one host function that launches the kernels of a call with a
given pair of expert GEMMs, the device workspaces of a call, and the compile-time stand-ins of its arguments.

The launches, all in one TVM-FFI call on the current stream, no host synchronisation, each after the first a
programmatic dependent of the one before (`chain.py`): route (`routing.RoutingKernel`; or, with
`routing_in_gemm1`, no such launch and GEMM1's grid routes first) on counters that the previous call on the
stream left at zero (`counters.py` keeps them), GEMM1 + SwiGLU into `intermediate` (its CTA 0 also copies the
call's final counts into `counts_out`), GEMM2 into `expert_out`, and the weighted combine into `output`
(`combine.CombineKernel`), which reads the counts from `counts_out` and zeroes the kept counters again (no
release kernel of its own). A GEMM2 that multiplies f16 (`f16_c`: `kernel.py` above 192 tokens) gets one
more kernel before it, `c_to_f16.CToF16Kernel`, which rewrites C in place as f16 times a power of two per packed row
(`c_scale`). A GEMM1 on grouped rows (`gathered_rows`: `grouped_wgmma.GroupedGemm1`) gets one kernel before it,
`gather_rows.GatherRowsKernel`, which copies each packed row's token row and scales into the call's grouped buffers
(`a_rows`, `a_rows_scale`: workspaces of that host only), which GEMM1 then reads instead of x. The expert GEMMs
differ between the variants; each takes `launch(a, a_scale, w, w_scale, out, counts, expert_tokens, grid, stream,
routing=None)`, where `grid` is its number of persistent CTAs and `routing` (GEMM1 only) `routing.route_then_meet`'s
tuple (a GEMM1 also takes `counts_out=`, a GEMM2 that issues its first weights before its programmatic wait
`routed=`), and `with_link(link)` for its place in the chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from .c_to_f16 import CToF16Kernel
from .chain import ChainLink, chain_links
from .combine import CombineKernel
from .gather_rows import GatherRowsKernel
from .routing import RoutingKernel
from .shapes import (
    BLOCK,
    GEMM1_OUT,
    HIDDEN,
    HIDDEN_BLOCKS,
    INTERMEDIATE,
    INTERMEDIATE_BLOCKS,
    NUM_EXPERTS,
    NUM_LOCAL_EXPERTS,
    TOP_K,
)
from .standalone import rowmajor
from .streaming_gemm import WALK_SLOT_WORDS

__all__ = [
    "ExpertGemm",
    "MoeHostSm90",
    "Workspaces",
    "compile_host",
    "fake_grouped_rows",
    "fake_tensor_arguments",
    "launch",
]


class ExpertGemm(Protocol):
    def launch(self, a, a_scale, w, w_scale, out, counts, expert_tokens, grid, stream, routing=None) -> None: ...

    def with_link(self, link: ChainLink) -> ExpertGemm: ...


class MoeHostSm90:
    """Host function of the chained kernels with `gemm1` (G1 + SwiGLU) and `gemm2` (G2); one
    compile serves every T (dynamic) and every offset / scaling factor (runtime scalars). The counters
    come zeroed from the previous call and its last kernel (the combine) zeroes them again, so no call starts with
    a tiny zeroing launch and its host gap."""

    def __init__(
        self, gemm1: ExpertGemm, gemm2: ExpertGemm, routing_in_gemm1: bool = False, combine_loads_first: bool = False
    ):
        """`routing_in_gemm1` (`kernel.py` up to 1024 tokens): no routing kernel; GEMM1's cooperative grid
        routes the tokens first (`routing.route_then_meet`), so the call is three launches and GEMM1 the first.
        The combine is always the last; `combine_loads_first`: its loads before their first use. A GEMM1 on
        gathered rows (`cfg.gathered_rows`) brings the row gather between the routing grid and itself."""
        if not (hasattr(gemm1, "with_link") and hasattr(gemm2, "with_link")):
            raise TypeError("the MoE host chains its launches: the expert GEMMs need with_link")
        gathered_rows = gemm1.cfg.gathered_rows
        if gathered_rows and routing_in_gemm1:
            raise ValueError("the row gather reads the routing grid's counts: it needs a routing kernel")
        self.routing_in_gemm1 = routing_in_gemm1
        f16_c = gemm2.cfg.f16_c
        links = list(chain_links(3 + (not routing_in_gemm1) + gathered_rows + f16_c))
        if not routing_in_gemm1:
            self.routing = RoutingKernel(links.pop(0))
        self.gather = GatherRowsKernel(links.pop(0)) if gathered_rows else None
        self.gemm1 = gemm1.with_link(links.pop(0))
        self.c_to_f16 = CToF16Kernel(links.pop(0)) if f16_c else None
        gemm2_link, combine_link = links
        self.gemm2 = gemm2.with_link(gemm2_link)
        self.combine = CombineKernel(combine_link, loads_first=combine_loads_first)

    def kept_words(self) -> tuple[int, ...]:
        """The lengths of the int32 buffers after the stream argument: the kept routed count (routing in GEMM1), then
        the kept walk buffer, slot counters and partition ranks (a GEMM1 that walks by partition rank)."""
        routed = (NUM_LOCAL_EXPERTS,) if self.routing_in_gemm1 else ()
        return routed + ((2 * WALK_SLOT_WORDS,) if self.gemm1.cfg.partition_walk else ())

    @cute.jit
    def __call__(
        self,
        routing_logits: cute.Tensor,
        routing_bias: cute.Tensor,
        hidden_states: cute.Tensor,
        hidden_states_scale: cute.Tensor,
        gemm1_weights: cute.Tensor,
        gemm1_weights_scale: cute.Tensor,
        gemm2_weights: cute.Tensor,
        gemm2_weights_scale: cute.Tensor,
        local_expert_offset: cutlass.Int32,
        routed_scaling_factor: cutlass.Float32,
        output: cute.Tensor,
        counts: cute.Tensor,
        counts_out: cute.Tensor,
        expert_tokens: cute.Tensor,
        slot_expert: cute.Tensor,
        slot_rank: cute.Tensor,
        slot_weight: cute.Tensor,
        intermediate: cute.Tensor,
        expert_out: cute.Tensor,
        c_scale: cute.Tensor,
        gemm1_grid: cutlass.Int32,
        gemm2_grid: cutlass.Int32,
        stream,
        routed=None,  # with routing_in_gemm1: the kept count of routed tokens (`counters.kept_routed`)
        walk_slots=None,  # with a GEMM1 that walks by partition rank: its kept walk buffer (`counters.kept_walk_slots`)
        a_rows=None,  # with the row gather: the grouped rows [8 T, 7168] e4m3 (`Workspaces.a_rows`)
        a_rows_scale=None,  # with the row gather: their scales [56, 8 T] f32
    ):
        # What either routing reads and writes besides the counters: `RoutingKernel`'s grid, or GEMM1's
        # (`routing.route_then_meet`, with the kept count of routed tokens appended).
        routing_args = (
            routing_logits, routing_bias, local_expert_offset, routed_scaling_factor, slot_expert, slot_rank,
            slot_weight,
        )  # fmt: skip
        routing = None
        if cutlass.const_expr(self.routing_in_gemm1):
            routing = (*routing_args, routed)
        else:
            self.routing.launch(routing_args, counts, expert_tokens, stream)
        gemm1_a, gemm1_a_scale = hidden_states, hidden_states_scale
        if cutlass.const_expr(self.gather is not None):
            # GEMM1's grid is the SM count (one CTA per SM), the gather's unit.
            self.gather.launch(
                counts, expert_tokens, hidden_states, hidden_states_scale, a_rows, a_rows_scale, gemm1_grid, stream
            )
            gemm1_a, gemm1_a_scale = a_rows, a_rows_scale
        self.gemm1.launch(
            gemm1_a,
            gemm1_a_scale,
            gemm1_weights,
            gemm1_weights_scale,
            intermediate,
            counts,
            expert_tokens,
            gemm1_grid,
            stream,
            routing,
            counts_out=counts_out,
            **({"walk_slots": walk_slots} if self.gemm1.cfg.partition_walk else {}),
        )
        gemm2_scale = hidden_states_scale  # not read by a GEMM2 on bf16 C (it keeps its kernels' parameters)
        if cutlass.const_expr(self.c_to_f16 is not None):
            self.c_to_f16.launch(counts, intermediate, c_scale, stream)
            gemm2_scale = c_scale
        self.gemm2.launch(
            intermediate,
            gemm2_scale,
            gemm2_weights,
            gemm2_weights_scale,
            expert_out,
            counts,
            expert_tokens,
            gemm2_grid,
            stream,
            **({"routed": routed} if self.gemm2.cfg.weights_before_wait else {}),
        )
        self.combine.launch(
            counts_out, slot_expert, slot_rank, slot_weight, expert_out, output, stream, (counts, routed)
        )


@dataclass(frozen=True)
class Workspaces:
    """The device workspaces of one call (packed GEMM rows: row offset[e] + rank of expert e)."""

    counts: torch.Tensor  # [32] int32: tokens per local expert
    expert_tokens: torch.Tensor  # [32, T] int32: expert_tokens[e, rank] = token
    slot_expert: torch.Tensor  # [T, 8] int32: local expert of each choice, -1 if not local
    slot_rank: torch.Tensor  # [T, 8] int32
    slot_weight: torch.Tensor  # [T, 8] fp32
    intermediate: torch.Tensor  # [8 T, 2048] bf16: C = silu(gate) * up per packed row
    expert_out: torch.Tensor  # [8 T, 7168] fp32: C W2^T per packed row
    c_scale: torch.Tensor  # [8 T] fp32: with an f16 GEMM2, the power of two that undoes each packed row's rewrite
    # With the row gather only (`MoeHostSm90.gather`): GEMM1's A, each packed row's token row and its scales.
    a_rows: torch.Tensor | None = None  # [8 T, 7168] e4m3
    a_rows_scale: torch.Tensor | None = None  # [56, 8 T] fp32 (8 T a multiple of 4, as its tensor map needs)

    @classmethod
    def allocate(cls, num_tokens: int, device: torch.device, gathered_rows: bool = False) -> Workspaces:
        """The workspaces of a call of `num_tokens` tokens; `gathered_rows`: with the grouped rows of the gather."""
        num_rows = TOP_K * num_tokens  # worst case: all 8 chosen experts are local
        grouped = {}
        if gathered_rows:
            grouped = {
                "a_rows": torch.empty(num_rows, HIDDEN, dtype=torch.float8_e4m3fn, device=device),
                "a_rows_scale": torch.empty(HIDDEN_BLOCKS, num_rows, dtype=torch.float32, device=device),
            }
        return cls(
            counts=torch.empty(NUM_LOCAL_EXPERTS, dtype=torch.int32, device=device),  # zeroed by our kernel
            expert_tokens=torch.empty(NUM_LOCAL_EXPERTS, num_tokens, dtype=torch.int32, device=device),
            slot_expert=torch.empty(num_tokens, TOP_K, dtype=torch.int32, device=device),
            slot_rank=torch.empty(num_tokens, TOP_K, dtype=torch.int32, device=device),
            slot_weight=torch.empty(num_tokens, TOP_K, dtype=torch.float32, device=device),
            intermediate=torch.empty(num_rows, INTERMEDIATE, dtype=torch.bfloat16, device=device),
            expert_out=torch.empty(num_rows, HIDDEN, dtype=torch.float32, device=device),
            c_scale=torch.empty(num_rows, dtype=torch.float32, device=device),
            **grouped,
        )


def fake_tensor_arguments() -> tuple:
    """Compile-time stand-ins (symbolic T and packed-row count) for the host function's arguments
    from `routing_logits` through the workspaces, in call order."""
    num_tokens = cute.sym_int()
    num_rows = cute.sym_int()  # packed workspace rows (8 T)

    f32, bf16, fp8, i32 = cutlass.Float32, cutlass.BFloat16, cutlass.Float8E4M3FN, cutlass.Int32
    return (
        rowmajor(f32, (num_tokens, NUM_EXPERTS)),
        rowmajor(bf16, (NUM_EXPERTS,)),
        rowmajor(fp8, (num_tokens, HIDDEN)),
        rowmajor(f32, (HIDDEN_BLOCKS, num_tokens)),
        rowmajor(fp8, (NUM_LOCAL_EXPERTS, GEMM1_OUT, HIDDEN)),
        rowmajor(f32, (NUM_LOCAL_EXPERTS, GEMM1_OUT // BLOCK, HIDDEN_BLOCKS)),
        rowmajor(fp8, (NUM_LOCAL_EXPERTS, HIDDEN, INTERMEDIATE)),
        rowmajor(f32, (NUM_LOCAL_EXPERTS, HIDDEN_BLOCKS, INTERMEDIATE_BLOCKS)),
        0,
        1.0,
        rowmajor(bf16, (num_tokens, HIDDEN)),
        rowmajor(i32, (NUM_LOCAL_EXPERTS,)),
        rowmajor(i32, (NUM_LOCAL_EXPERTS,)),
        rowmajor(i32, (NUM_LOCAL_EXPERTS, num_tokens)),
        rowmajor(i32, (num_tokens, TOP_K)),
        rowmajor(i32, (num_tokens, TOP_K)),
        rowmajor(f32, (num_tokens, TOP_K)),
        rowmajor(bf16, (num_rows, INTERMEDIATE)),
        rowmajor(f32, (num_rows, HIDDEN)),
        rowmajor(f32, (num_rows,)),
    )


def fake_grouped_rows() -> dict[str, Any]:
    """Compile-time stand-ins of the row gather's grouped buffers, by parameter name (`a_rows`, `a_rows_scale`): 8 T
    rows, symbolic and a multiple of 4 (the scales' rows are the innermost dimension of GEMM1's tensor map, whose
    strides are multiples of 16 bytes)."""
    num_rows = cute.sym_int(divisibility=4)
    return {
        "a_rows": make_fake_compact_tensor(
            cutlass.Float8E4M3FN, (num_rows, HIDDEN), stride_order=(1, 0), assumed_align=16
        ),
        "a_rows_scale": make_fake_compact_tensor(
            cutlass.Float32, (HIDDEN_BLOCKS, num_rows), stride_order=(1, 0), assumed_align=16
        ),
    }


def compile_host(host, arch: str) -> Callable:
    """`cute.compile` of a host function (`MoeHostSm90`, `fused_gemms.FusedMoeHost`) for `arch` as a TVM-FFI function
    on the current torch stream: the arguments from `routing_logits` through the workspaces, the two grid parameters
    (runtime scalars), the stream and the host's kept int32 buffers (`kept_words`), then by name the grouped buffers of
    a host with the row gather. Needs no GPU."""
    args = (
        *fake_tensor_arguments(),
        0,
        0,
        make_fake_stream(use_tvm_ffi_env_stream=True),
        *(make_fake_compact_tensor(cutlass.Int32, (words,), assumed_align=16) for words in host.kept_words()),
    )
    grouped = fake_grouped_rows() if isinstance(host, MoeHostSm90) and host.gather is not None else {}
    return cute.compile(host, *args, **grouped, options=f"--enable-tvm-ffi --gpu-arch {arch}")


def launch(
    compiled: Callable,
    inputs: tuple[Any, ...],
    output,
    workspaces: Workspaces,
    gemm1_grid: int,
    gemm2_grid: int,
    kept_counts: torch.Tensor,
    kept_routed: torch.Tensor | None = None,
    kept_walk_slots: torch.Tensor | None = None,
    readiness: torch.Tensor | None = None,
) -> None:
    """One call of a compiled host function: the definition's ten inputs (in order), the output,
    the workspaces and the two grid parameters. It counts in `kept_counts` (zero on entry, left at
    zero; `counters.kept_counts`) and copies the call's counts into `workspaces.counts`; a host that routes
    in GEMM1 also counts the routed tokens in `kept_routed` (`counters.kept_routed`, likewise), and one whose GEMM1
    walks by partition rank draws its CTAs' slots from `kept_walk_slots` (`counters.kept_walk_slots`); the fused GEMMs
    (`fused_gemms.py`) count their done items in the call's `readiness` words. Workspaces with grouped rows (a host with
    the row gather) pass them by name."""
    *tensors, local_expert_offset, routed_scaling_factor = inputs
    grouped = {}
    if workspaces.a_rows is not None:
        grouped = {"a_rows": workspaces.a_rows, "a_rows_scale": workspaces.a_rows_scale}
    compiled(
        *tensors,
        int(local_expert_offset),
        float(routed_scaling_factor),
        output,
        kept_counts,
        workspaces.counts,
        workspaces.expert_tokens,
        workspaces.slot_expert,
        workspaces.slot_rank,
        workspaces.slot_weight,
        workspaces.intermediate,
        workspaces.expert_out,
        workspaces.c_scale,
        gemm1_grid,
        gemm2_grid,
        *(() if kept_routed is None else (kept_routed,)),
        *(() if kept_walk_slots is None else (kept_walk_slots,)),
        *(() if readiness is None else (readiness,)),
        **grouped,
    )
