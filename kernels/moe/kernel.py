"""FP8 block-scale MoE for SM90 in CuTe-DSL: `moe_fp8_block_scale_ds_routing_topk8_ng8_kg4_e32_h7168_i2048`.

A call moves ~44 MB of e4m3 weights per active local expert, so up to ~1000 tokens it is bound by DRAM and
above by the FP8 MMAs. Every call is the kernels of `host.py` (or `fused_gemms.py`) in one TVM-FFI call, chained
by programmatic dependent launches, on per-expert counters that the previous call's combine left at zero. Both
expert GEMMs are persistent weight streams over every SM. The variant is chosen from T alone (`variant_for`):

- T <= EARLY_W2_MAX_TOKENS (TINY_T_EARLY_W2, three kernels): every GEMM1 CTA routes the few tokens itself;
  GEMM1 + SwiGLU and GEMM2 on `mma.sync` (weights on the m16 side), GEMM2 issuing its first weights before its
  programmatic wait; then the combine.
- T < WGMMA_GEMM1_MIN_TOKENS (FUSED_T, two kernels): both `mma.sync` GEMMs in one cooperative kernel whose CTAs
  take GEMM2 items as soon as their expert's GEMM1 items are done, so that W2 streams while GEMM1 ends.
- T <= FEW_TOKENS_MAX (FEW_TOKENS, three kernels): GEMM1 on FP8 WGMMA and GEMM2 on bf16 WGMMA (e4m3 weights
  converted in registers); from here the WGMMA's 64-row items no longer leave SMs without weights to stream.
- T <= MEDIUM_T_MAX_TOKENS (MEDIUM_T, four kernels): 32-token GEMM1 tiles fed by a producer warp, three CTAs per
  SM, walking the SMs by L2-partition rank (`l2_partitions.py`); C rewritten as f16 times a power of two per row
  (`c_to_f16.py`) for an f16 WGMMA GEMM2 at three CTAs per SM.
- above (LARGE_T, five kernels): a routing grid first, then 64-token GEMM1 tiles (each expert has hundreds of
  tokens; a tile of 64 reads its weights half as often), otherwise as MEDIUM_T.

Up to MEDIUM_T_MAX_TOKENS GEMM1's cooperative grid routes the tokens itself, so that its weight stream starts
without waiting for a second launch. Destination passing, definition order, no host sync (but once per device,
at the first call of 193-1024 tokens, the L2 partition probe), no data-dependent host logic, graph-safe. Each
variant is compiled once (dynamic T) on first use; `compile_only()` compiles all of them. NOTES.md has the design.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from . import counters, fused_gemms, host, l2_partitions
from .host import Workspaces
from .inputs import MAX_TOKENS, MoeShapeError, check_inputs
from .streaming_gemm import WALK_SLOT_WORDS, StreamingGemm, StreamingGemmConfig
from .wgmma_gemm1 import WgmmaGemm1, WgmmaGemm1Config
from .wgmma_gemm2 import WgmmaGemm2, WgmmaGemm2Config

__all__ = [
    "EARLY_W2_MAX_TOKENS",
    "FEW_TOKENS_MAX",
    "GPU_ARCH",
    "MAX_TOKENS",
    "MEDIUM_T_MAX_TOKENS",
    "MoeShapeError",
    "StreamingVariant",
    "WGMMA_GEMM1_MIN_TOKENS",
    "Workspaces",
    "compile_only",
    "compiled_for",
    "make_run",
    "run",
    "run_keeping_workspaces",
    "variant_for",
]

GPU_ARCH = "sm_90a"
# Row tiles of 16 tokens and 8-token GEMM2 tiles while an active local expert gets few tokens (at T = 80
# the synthesized routing gives 17-21 active experts 12-20 tokens at most: 20-27 tiles of 8 tokens,
# `kernels/moe/probes/moe_routing_stats.py`); four 8-token GEMM2 stages hold more weight bytes in flight than three of 16.
FEW_TOKENS_MAX = 192
# Below this, few experts are active and WGMMA's 64-row items halve the CTAs that stream them: the WGMMA
# GEMM1 measured 0.86x at T = 1, 0.90x at 7 and 0.97x at 32, but 1.015x at 52-62, 1.05x at 80 (NOTES.md).
WGMMA_GEMM1_MIN_TOKENS = 33
# GEMM1's 64-token tiles measured 0.98x at T = 901 (it depends on how many tokens the busiest experts get)
# and 1.15-1.17x at 11948 and 14107; between them, off the list (`tools/time_axes.py`), 0.99-1.07x at 1024,
# 1.05-1.09x at 1536 and 1.02-1.08x at 2048.
MEDIUM_T_MAX_TOKENS = 1024
# The early-W2 variant up to here (one token per routing warp), where every GEMM1 CTA routes the tokens itself; from
# the next count to WGMMA_GEMM1_MIN_TOKENS - 1 the fused GEMMs, which measured 1.043x and 1.049x (medians) off the list
# at 5 and 6 tokens over this variant (NOTES.md).
EARLY_W2_MAX_TOKENS = 4
assert EARLY_W2_MAX_TOKENS < WGMMA_GEMM1_MIN_TOKENS  # both variants below are TINY_T with switches
NUM_STAGES = 4


@dataclass(frozen=True)
class StreamingVariant:
    """One compiled streaming configuration: tokens per row tile and pipeline depth of GEMM1, and of
    GEMM2 where they differ (the packed rows do not depend on the tiles, so each GEMM may have its own)."""

    block_tokens: int
    num_stages: int = NUM_STAGES
    gemm2_block_tokens: int | None = None  # None: block_tokens
    gemm2_num_stages: int | None = None  # None: num_stages
    wgmma_gemm1: bool = False  # GEMM1 on FP8 warpgroup MMA (wgmma_gemm1.py) instead of mma.sync
    wgmma_gemm2: bool = False  # GEMM2 on bf16 warpgroup MMA (wgmma_gemm2.py); needs wgmma_gemm1
    gemm1_scratch_in_stage: bool = False  # wgmma_gemm1.WgmmaGemm1Config's scratch_in_stage
    routing_in_gemm1: bool = False  # no routing kernel: GEMM1's cooperative grid routes first
    gemm2_weights_before_wait: bool = False  # the `mma.sync` GEMM2 issues its first weights before its wait
    combine_loads_first: bool = False  # the combine issues all of a thread's loads before using one
    routing_per_cta: bool = False  # up to 4 tokens every GEMM1 CTA routes them all, no meeting
    gemm1_ctas_per_sm: int = 2  # the WGMMA GEMM1's max_ctas_per_sm (the `mma.sync` GEMM1 keeps two)
    gemm1_smid_walk: bool = False  # the WGMMA GEMM1's smid_walk
    gemm1_producer_warp: bool = False  # the WGMMA GEMM1's producer_warp
    gemm1_partition_walk: bool = False  # the WGMMA GEMM1's partition_walk
    gemm2_dynamic_items: bool = False  # the `mma.sync` GEMM2's StreamingGemmConfig dynamic_items
    f16_c: bool = False  # C rewritten as f16 times a power of two per row for an f16 WGMMA GEMM2
    gemm2_ctas_per_sm: int = 2  # the WGMMA GEMM2's WgmmaGemm2Config max_ctas_per_sm
    fused_gemms: bool = False  # both `mma.sync` GEMMs in one cooperative kernel (`fused_gemms.py`)

    def __post_init__(self) -> None:
        if self.wgmma_gemm2 and not self.wgmma_gemm1:
            # The WGMMA GEMM2 reads C in the column order only the WGMMA GEMM1 writes.
            raise ValueError("wgmma_gemm2 needs wgmma_gemm1")
        if (self.gemm1_scratch_in_stage or self.gemm1_producer_warp) and not self.wgmma_gemm1:
            raise ValueError("gemm1_scratch_in_stage and gemm1_producer_warp need wgmma_gemm1")
        if self.gemm1_partition_walk and not (self.gemm1_producer_warp and self.gemm1_smid_walk):
            raise ValueError("gemm1_partition_walk needs gemm1_producer_warp and gemm1_smid_walk")
        if self.gemm1_producer_warp and not self.routing_in_gemm1:
            raise ValueError("gemm1_producer_warp needs routing_in_gemm1")  # the only GEMM1 built with its guard
        if self.gemm2_weights_before_wait and (self.wgmma_gemm2 or not self.routing_in_gemm1):
            # It waits on the kept count of routed tokens that only a routing GEMM1 completes.
            raise ValueError("gemm2_weights_before_wait needs the mma.sync GEMM2 and routing_in_gemm1")
        if self.routing_per_cta and (self.wgmma_gemm1 or not self.routing_in_gemm1):
            raise ValueError("routing_per_cta needs the mma.sync GEMM1 and routing_in_gemm1")
        if self.gemm2_dynamic_items and (self.wgmma_gemm2 or not self.routing_in_gemm1):
            # Its claim counter is a word of the kept routed-count buffer (`streaming_gemm.claim_item`).
            raise ValueError("gemm2_dynamic_items needs the mma.sync GEMM2 and routing_in_gemm1")
        if (self.f16_c or self.gemm2_ctas_per_sm != 2) and not self.wgmma_gemm2:
            raise ValueError("f16_c and gemm2_ctas_per_sm are the WGMMA GEMM2's")
        if self.fused_gemms and not (self.routing_in_gemm1 and self.gemm2_dynamic_items and not self.wgmma_gemm1):
            # Its GEMM2 phase claims its items and its grid meets after the routing (`fused_gemms.FusedExpertGemms`).
            raise ValueError("fused_gemms needs the mma.sync GEMMs, routing_in_gemm1 and gemm2_dynamic_items")
        if (self.gemm1_ctas_per_sm != 2 or self.gemm1_smid_walk) and not self.wgmma_gemm1:
            # The `mma.sync` GEMM1 keeps two CTAs per SM and walks over the CTA index.
            raise ValueError("gemm1_ctas_per_sm and gemm1_smid_walk are the WGMMA GEMM1's")
        if self.gemm1_smid_walk and not self.routing_in_gemm1:
            # Its slots need every CTA resident at once: GEMM1's cooperative launch, which only a routing GEMM1 has.
            raise ValueError("gemm1_smid_walk needs routing_in_gemm1")

    def gemm1(self) -> StreamingGemmConfig | WgmmaGemm1Config:
        if self.wgmma_gemm1:
            return WgmmaGemm1Config(
                block_tokens=self.block_tokens,
                num_stages=self.num_stages,
                permuted_c=self.wgmma_gemm2,
                scratch_in_stage=self.gemm1_scratch_in_stage,
                max_ctas_per_sm=self.gemm1_ctas_per_sm,
                smid_walk=self.gemm1_smid_walk,
                producer_warp=self.gemm1_producer_warp,
                partition_walk=self.gemm1_partition_walk,
            )
        return StreamingGemmConfig(
            gemm1=True,
            block_tokens=self.block_tokens,
            num_stages=self.num_stages,
            routing_per_cta=self.routing_per_cta,
        )

    def make_gemm1(self) -> StreamingGemm | WgmmaGemm1:
        config = self.gemm1()
        return WgmmaGemm1(config) if isinstance(config, WgmmaGemm1Config) else StreamingGemm(config)

    def gemm2(self) -> StreamingGemmConfig | WgmmaGemm2Config:
        block_tokens = self.gemm2_block_tokens or self.block_tokens
        num_stages = self.gemm2_num_stages or self.num_stages
        if self.wgmma_gemm2:
            return WgmmaGemm2Config(
                block_tokens=block_tokens,
                num_stages=num_stages,
                f16_c=self.f16_c,
                max_ctas_per_sm=self.gemm2_ctas_per_sm,
            )
        return StreamingGemmConfig(
            gemm1=False,
            block_tokens=block_tokens,
            num_stages=num_stages,
            weights_before_wait=self.gemm2_weights_before_wait,
            dynamic_items=self.gemm2_dynamic_items,
        )

    def make_gemm2(self) -> StreamingGemm | WgmmaGemm2:
        config = self.gemm2()
        return WgmmaGemm2(config) if isinstance(config, WgmmaGemm2Config) else StreamingGemm(config)


# GEMM2's shared memory per CTA fits two CTAs per SM in every variant: on `mma.sync` 103 KB (8 x 4),
# on WGMMA ~80 KB (8 x 4); three at 32 x 2 (~66 KB). So does GEMM1's: ~98 KB at 64 x 3 with the epilogue
# tile in a token stage.
# Up to MEDIUM_T_MAX_TOKENS GEMM1 is the call's first kernel and routes the tokens itself: its stream starts ~6 us
# earlier than after a routing kernel, when the host's launch of a second kernel would only reach the GPU.
# Up to FEW_TOKENS_MAX the combine issues all of a thread's loads before using one; above it its 92 registers per thread
# would cut its CTAs per SM from 16 to 5 where a thread has about one row to load anyway (0.97x at 11948-14107 tokens).
# GEMM2's CTAs claim their items after the first from a kept counter: they become resident as GEMM1's retire, so which
# of them share an SM is not known, and a fixed walk's extra items would end some SMs microseconds after the rest. The
# fused GEMMs' GEMM2 phase at 5-32 tokens, whose CTAs come to it as their GEMM1 items end, claims its items the same way.
# TINY_T itself is the base of the variants below 33 tokens and the chained form that the tests compare the fused
# GEMMs with bit for bit.
TINY_T = StreamingVariant(
    block_tokens=16,
    gemm2_block_tokens=8,
    gemm2_num_stages=4,
    routing_in_gemm1=True,
    combine_loads_first=True,
    gemm2_dynamic_items=True,
)
# Up to EARLY_W2_MAX_TOKENS GEMM2 reads its schedule once the routed count is complete and issues its first stages'
# weights before its programmatic wait, so that W2 is in flight when GEMM1 ends (1.037x at 1 token). With more tokens
# GEMM1's CTAs retire over many microseconds and the early copies compete with them for DRAM (~1.00x at 7-32 tokens).
# Up to 4 tokens (one per warp) every GEMM1 CTA routes them all and ranks them in token order instead of meeting the
# grid on CTA 0's routing (1.040x at 1 token): the routing is cheaper than the grid meeting.
# Its GEMM2 walks a fixed round robin: with 1-2 experts and at most two items per CTA, claiming items gains nothing
# (1.003x at 1 token).
TINY_T_EARLY_W2 = dataclasses.replace(
    TINY_T, gemm2_weights_before_wait=True, routing_per_cta=True, gemm2_dynamic_items=False
)
# From EARLY_W2_MAX_TOKENS + 1 to WGMMA_GEMM1_MIN_TOKENS - 1 both GEMMs run in one cooperative kernel whose CTAs go on to
# GEMM2 items as soon as their expert's GEMM1 items are all done (`fused_gemms.py`): DRAM streams W2 while the last
# GEMM1 items finish instead of idling through the hand-over between two kernels (1.024-1.068x at 7-32 tokens over the
# two chained kernels, NOTES.md). GEMM1 on 8-token row tiles as GEMM2, four stages, two CTAs per SM.
FUSED_T = dataclasses.replace(TINY_T, block_tokens=8, fused_gemms=True)
# From 33 tokens both GEMMs are on WGMMA (the bf16 WGMMA GEMM2 1.02x over the `mma.sync` one at 52-62 tokens).
FEW_TOKENS = dataclasses.replace(TINY_T, wgmma_gemm1=True, wgmma_gemm2=True, gemm2_dynamic_items=False)
# Above 192 tokens GEMM2 converts each W2 once per 32-token tile into WGMMA's registers. Its C is f16 times a power of
# two per row, so that a pair of e4m3 weights takes one conversion instead of four (no gain at 52-80 tokens, hence only
# here), in two stages at three CTAs per SM: at 8 warps per SM this GEMM2 is bound by each warp's chain of loads,
# conversions and MMAs (ncu), and a third CTA hides it.
# Its GEMM1 runs 3 stages at three CTAs per SM, the epilogue tile in the stage just consumed (~74 KB, 87 registers a
# thread), and walks round robin over slot x 132 + SM rank with a kept slot draw: over the CTA index the H200 places
# CTAs 0-23 three each on 8 SMs, which then run a round behind. A fifth warp issues its stages (the weights by TMA, the
# token rows by coalesced cp.async, two rows per copy) on per-slot full and empty mbarriers, so no CTA-wide barrier ends
# a K stage. Its walk takes the SMs by their rank with one L2 partition's SMs first (measured once per device,
# `l2_partitions.partition_ranks`) and an expert's items weight tile by weight tile, so that the CTAs reading one weight
# tile share a partition: the fabric between the two partitions bounds this GEMM1 at 901 tokens (ncu: 86.7 % of its
# throughput with a walk by SM id, 75.2 % with this one).
MEDIUM_T = StreamingVariant(
    block_tokens=32,
    num_stages=3,
    gemm2_block_tokens=32,
    gemm2_num_stages=2,
    wgmma_gemm1=True,
    wgmma_gemm2=True,
    routing_in_gemm1=True,
    gemm1_scratch_in_stage=True,
    gemm1_ctas_per_sm=3,
    gemm1_smid_walk=True,
    gemm1_producer_warp=True,
    gemm1_partition_walk=True,
    f16_c=True,
    gemm2_ctas_per_sm=3,
)
# Above MEDIUM_T_MAX_TOKENS GEMM1 reads each expert's weights once per 64 tokens, and the routing is a
# grid of its own (T warps over the SMs; GEMM1's grid would route 4 x its CTAs tokens at a time). Its ~98 KB a CTA fit
# two per SM, and without the routing its launch is not cooperative, so it walks over the CTA index. Its stages end on a
# CTA-wide barrier: the producer warp locates one token slot per lane, and needs the routing grid's cooperative launch.
LARGE_T = dataclasses.replace(
    MEDIUM_T,
    block_tokens=64,
    routing_in_gemm1=False,
    gemm1_ctas_per_sm=2,
    gemm1_smid_walk=False,
    gemm1_producer_warp=False,
    gemm1_partition_walk=False,
)
VARIANTS = (TINY_T_EARLY_W2, FUSED_T, FEW_TOKENS, MEDIUM_T, LARGE_T)


def variant_for(num_tokens: int) -> StreamingVariant:
    """The streaming variant for a batch of `num_tokens` tokens."""
    if num_tokens < 1:
        raise MoeShapeError(f"seq_len must be >= 1, got {num_tokens}")
    if num_tokens <= EARLY_W2_MAX_TOKENS:
        return TINY_T_EARLY_W2
    if num_tokens < WGMMA_GEMM1_MIN_TOKENS:
        return FUSED_T
    if num_tokens <= FEW_TOKENS_MAX:
        return FEW_TOKENS
    if num_tokens <= MEDIUM_T_MAX_TOKENS:
        return MEDIUM_T
    return LARGE_T


_COMPILED: dict[tuple[str, StreamingVariant], Callable] = {}


def _compile(arch: str, variant: StreamingVariant) -> Callable:
    # The launches of host.py with the variant's two streaming GEMMs (grids: persistent CTAs), or of the fused GEMMs.
    if variant.fused_gemms:
        return fused_gemms.compile_fused(fused_gemms.FusedMoeHost(variant.make_gemm1(), variant.make_gemm2()), arch)
    return host.compile_host(
        host.MoeHostSm90(
            variant.make_gemm1(),
            variant.make_gemm2(),
            routing_in_gemm1=variant.routing_in_gemm1,
            combine_loads_first=variant.combine_loads_first,
        ),
        arch,
    )


def compiled_for(variant: StreamingVariant, arch: str = GPU_ARCH) -> Callable:
    """The compiled launcher of `variant` for `arch` (compiled on first use; needs no GPU)."""
    key = (arch, variant)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = _compile(arch, variant)
    return fn


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the variants, the zeroing of new counter and slot buffers (the ranked walk buffer twice as long) and
    the L2 partition probe's kernels for `arch` without touching a GPU (for CI and warm-up: no call compiles lazily
    afterwards)."""
    return (
        *(compiled_for(variant, arch) for variant in VARIANTS),
        counters.compiled_zero(arch),
        counters.compiled_zero(arch, WALK_SLOT_WORDS),
        counters.compiled_zero(arch, 2 * WALK_SLOT_WORDS),
        *l2_partitions.compiled_kernels(arch),
    )


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _NUM_SMS.get(index)
    if count is None:
        count = _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def persistent_ctas(config: StreamingGemmConfig | WgmmaGemm1Config | WgmmaGemm2Config, num_sms: int) -> int:
    """Grid of a persistent streaming GEMM: every SM holds as many CTAs as shared memory allows."""
    return num_sms * config.ctas_per_sm()


@functools.cache
def _grids(variant: StreamingVariant, num_sms: int) -> tuple[int, int]:
    """(GEMM1, GEMM2) persistent grids; cached, since building the configurations costs ~0.5 ms. The fused GEMMs run on
    one grid in GEMM2's shared memory, which holds GEMM1's."""
    if variant.fused_gemms:
        return (persistent_ctas(variant.gemm2(), num_sms),) * 2
    return persistent_ctas(variant.gemm1(), num_sms), persistent_ctas(variant.gemm2(), num_sms)


def make_run(choose: Callable[[int], StreamingVariant]) -> Callable[..., None]:
    """The definition's destination-passing `run` with `choose` as the map from T to the streaming
    variant: `kernel.py`'s own `run`, and each candidate's."""

    def run(
        routing_logits,
        routing_bias,
        hidden_states,
        hidden_states_scale,
        gemm1_weights,
        gemm1_weights_scale,
        gemm2_weights,
        gemm2_weights_scale,
        local_expert_offset,
        routed_scaling_factor,
        output,
    ) -> None:
        """Destination-passing entry: fills `output` [T, 7168] bf16 (every row)."""
        run_keeping_workspaces(
            routing_logits,
            routing_bias,
            hidden_states,
            hidden_states_scale,
            gemm1_weights,
            gemm1_weights_scale,
            gemm2_weights,
            gemm2_weights_scale,
            local_expert_offset,
            routed_scaling_factor,
            output,
            choose=choose,
        )

    return run


def run_keeping_workspaces(
    routing_logits,
    routing_bias,
    hidden_states,
    hidden_states_scale,
    gemm1_weights,
    gemm1_weights_scale,
    gemm2_weights,
    gemm2_weights_scale,
    local_expert_offset,
    routed_scaling_factor,
    output,
    choose: Callable[[int], StreamingVariant] = variant_for,
) -> Workspaces | None:
    """`run`, returning the call's workspaces (None for T = 0), so that a device check can tell a wrong
    GEMM1 from a wrong GEMM2. `choose` maps T to the variant; a candidate passes its own."""
    inputs = (
        routing_logits,
        routing_bias,
        hidden_states,
        hidden_states_scale,
        gemm1_weights,
        gemm1_weights_scale,
        gemm2_weights,
        gemm2_weights_scale,
        local_expert_offset,
        routed_scaling_factor,
    )
    check_inputs(*inputs[:9], output)
    num_tokens = routing_logits.shape[0]
    if num_tokens == 0:
        return None
    variant = choose(num_tokens)
    device = routing_logits.device
    workspaces = Workspaces.allocate(num_tokens, device)
    gemm1_ctas, gemm2_ctas = _grids(variant, _num_sms(device))
    kept = counters.kept_counts(device, GPU_ARCH)
    kept_routed = counters.kept_routed(device, GPU_ARCH) if variant.routing_in_gemm1 else None
    kept_slots = None
    if variant.gemm1_smid_walk:
        kept_slots = counters.kept_walk_slots(device, GPU_ARCH, ranked=variant.gemm1_partition_walk)
    # The fused GEMMs' readiness words, zeroed by the kernel itself (`fused_gemms.py`).
    ready = torch.empty(fused_gemms.READY_WORDS, dtype=torch.int32, device=device) if variant.fused_gemms else None
    host.launch(
        compiled_for(variant), inputs, output, workspaces, gemm1_ctas, gemm2_ctas, kept, kept_routed, kept_slots, ready
    )
    return workspaces


run = make_run(variant_for)
