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
- above (GROUPED_T, six kernels): a routing grid first, then the token rows gathered by expert into grouped buffers
  (`gather_rows.py`), and both GEMMs the compute-bound grouped ones (`grouped_wgmma.py`, `grouped_gemm2.py`:
  warp-specialised, TMA, two MMA warpgroups on 128 x 128 tiles, one CTA per SM); C -> f16 and the combine as MEDIUM_T.

Up to MEDIUM_T_MAX_TOKENS GEMM1's cooperative grid routes the tokens itself, so that its weight stream starts
without waiting for a second launch. A variant (`StreamingVariant`) is a few named choices: the GEMMs' `Engine`, the
`Routing`'s place, the `mma.sync` GEMM2's `Handover`, the WGMMA GEMM1's `Gemm1Feed`, the WGMMA GEMM2's `Gemm2Form`, and plain tile sizes and
stages. Destination passing, definition order, no host sync, no data-dependent host logic, graph-safe. `warm_up()`
is what a process runs once per device before its first call (the L2 partition map; without it MEDIUM_T's GEMM1 walks
by SM id). Each variant is compiled once (dynamic T) on first use; `compile_only()` compiles all of them. NOTES.md has
the design.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch

from . import counters, fused_gemms, host, l2_partitions
from .grouped_wgmma import TILE_M as GROUPED_TILE_M
from .grouped_gemm2 import TILE_T as GROUPED_GEMM2_TILE_T
from .grouped_gemm2 import GroupedGemm2, GroupedGemm2Config
from .grouped_wgmma import GroupedGemm1, GroupedGemm1Config
from .host import Workspaces
from .inputs import MAX_TOKENS, MoeShapeError, check_inputs
from .routing import ROUTING_WARPS
from .streaming_gemm import WALK_SLOT_WORDS, StreamingGemm, StreamingGemmConfig
from .wgmma_gemm1 import Gemm1Feed, WgmmaGemm1, WgmmaGemm1Config
from .wgmma_gemm2 import WgmmaGemm2, WgmmaGemm2Config

__all__ = [
    "EARLY_W2_MAX_TOKENS",
    "FEW_TOKENS_MAX",
    "GPU_ARCH",
    "Engine",
    "Gemm1Feed",
    "Gemm2Form",
    "Handover",
    "MAX_TOKENS",
    "MEDIUM_T_MAX_TOKENS",
    "MoeShapeError",
    "Routing",
    "StreamingVariant",
    "WGMMA_GEMM1_MIN_TOKENS",
    "Workspaces",
    "compile_only",
    "compiled_for",
    "make_run",
    "run",
    "run_keeping_workspaces",
    "variant_for",
    "warm_up",
]

GPU_ARCH = "sm_90a"
# Row tiles of 16 tokens and 8-token GEMM2 tiles while an active local expert gets few tokens (at T = 80
# the synthesized routing gives 17-21 active experts 12-20 tokens at most: 20-27 tiles of 8 tokens,
# `kernels/moe/probes/moe_routing_stats.py`); four 8-token GEMM2 stages hold more weight bytes in flight than three of 16.
FEW_TOKENS_MAX = 192
# Below this, few experts are active and WGMMA's 64-row items halve the CTAs that stream them: the WGMMA
# GEMM1 measured 0.86x at T = 1, 0.90x at 7 and 0.97x at 32, but 1.015x at 52-62, 1.05x at 80 (NOTES.md).
WGMMA_GEMM1_MIN_TOKENS = 33
# MEDIUM_T up to here: it runs 901 tokens in 0.32 ms (1.39x the floor), where GROUPED_T takes 0.44 ms at 1025. Above,
# GROUPED_T: 1.12x at 1025 tokens and 2.0x at 14107 over streaming GEMMs with 64-token GEMM1 tiles, which measured
# 0.99-1.07x of MEDIUM_T's 32-token tiles at 1024 (NOTES.md, "Compute-bound path").
MEDIUM_T_MAX_TOKENS = 1024
# The early-W2 variant up to here (one token per routing warp), where every GEMM1 CTA routes the tokens itself; from
# the next count to WGMMA_GEMM1_MIN_TOKENS - 1 the fused GEMMs, which measured 1.043x and 1.049x (medians) off the list
# at 5 and 6 tokens over this variant (NOTES.md).
EARLY_W2_MAX_TOKENS = 4
assert EARLY_W2_MAX_TOKENS < WGMMA_GEMM1_MIN_TOKENS  # both variants below are on `mma.sync`
assert EARLY_W2_MAX_TOKENS <= ROUTING_WARPS  # every GEMM1 CTA routes one token per warp
NUM_STAGES = 4


class Engine(Enum):
    """The MMA of both expert GEMMs (one choice: the WGMMA GEMM2 reads C in the column order only the WGMMA GEMM1
    writes, `intermediate_order.py`)."""

    MMA_SYNC = "mma.sync"  # `streaming_gemm.py`: weights on the m16 side, e4m3 converted in registers
    WGMMA = "wgmma"  # `wgmma_gemm1.py` (FP8) and `wgmma_gemm2.py` (bf16 or f16, weights converted in registers)


class Routing(Enum):
    """Where the tokens are routed."""

    # Every GEMM1 CTA routes all the tokens itself (up to ROUTING_WARPS, one per warp) and ranks them in token order;
    # no CTA waits for another (`routing.route_in_every_cta`). The `mma.sync` GEMM1's.
    EVERY_CTA = "every GEMM1 CTA"
    # GEMM1's cooperative grid routes the tokens, then its CTAs meet on the kept routed count (`route_then_meet`).
    GEMM1_GRID = "GEMM1's grid"
    # A routing grid of its own (`routing.RoutingKernel`) before GEMM1, whose launch is then not cooperative.
    ROUTING_GRID = "routing grid"


class Handover(Enum):
    """How the `mma.sync` GEMM2 takes over from GEMM1 (the WGMMA GEMM2 is always CHAINED)."""

    # The next kernel of the chain (a programmatic dependent), walking its items round robin over its CTA index.
    CHAINED = "chained"
    # As CHAINED, but it reads its schedule once the kept routed count is complete and issues its first stages' weights
    # before its programmatic wait (only C waits for GEMM1). Needs GEMM1 to route (EVERY_CTA or GEMM1_GRID).
    EARLY_WEIGHTS = "early weights"
    # Both GEMMs in one cooperative kernel (`fused_gemms.py`): a CTA with no GEMM1 item left claims GEMM2 items from a
    # kept counter and loads an item's C once its expert's GEMM1 items are all done. Needs GEMM1_GRID, and GEMM1's row
    # tiles and stages equal to GEMM2's (one table and one pipeline serve both phases).
    FUSED = "fused"


class Gemm2Form(Enum):
    """How the WGMMA GEMM2 tiles its work (both convert W2 to C's 16-bit type in registers; the `mma.sync` GEMM2 is
    STREAMING)."""

    # `wgmma_gemm2.py`: one warpgroup per CTA on gemm2_block_tokens-token tiles x 64 W2 rows, cp.async stages.
    STREAMING = "streaming"
    # `grouped_gemm2.py`: 128-token tiles x 128 W2 rows, two MMA warpgroups fed by TMA, one CTA per SM; f16 C only.
    GROUPED = "grouped"


@dataclass(frozen=True)
class StreamingVariant:
    """One compiled configuration of a call: the GEMMs' engine, the routing's place, tokens per row tile and pipeline
    depth of each GEMM, and the options of each engine (the defaults are the plain forms)."""

    engine: Engine
    routing: Routing
    block_tokens: int  # GEMM1's row tile
    num_stages: int  # GEMM1's pipeline depth
    gemm2_block_tokens: int
    gemm2_num_stages: int
    handover: Handover = Handover.CHAINED  # `mma.sync` only
    gemm1_feed: Gemm1Feed = Gemm1Feed.WARPGROUP  # WGMMA only: how GEMM1's stages are issued and its items walked
    gemm1_scratch_in_stage: bool = False  # WGMMA only: `WgmmaGemm1Config`'s scratch_in_stage
    f16_c: bool = False  # WGMMA only: C rewritten as f16 times a power of two per row for an f16 GEMM2 (`c_to_f16.py`)
    gemm2_form: Gemm2Form = Gemm2Form.STREAMING  # WGMMA only: how GEMM2 tiles its work
    combine_loads_first: bool = False  # the combine issues all of a thread's loads before using one

    def __post_init__(self) -> None:
        if self.engine is Engine.MMA_SYNC:
            if self.gemm1_feed is not Gemm1Feed.WARPGROUP or self.gemm1_scratch_in_stage or self.f16_c:
                raise ValueError("gemm1_feed, gemm1_scratch_in_stage and f16_c are the WGMMA engine's")
        elif self.handover is not Handover.CHAINED or self.routing is Routing.EVERY_CTA:
            raise ValueError("the WGMMA engine's GEMM2 is chained and its GEMM1 does not route in every CTA")
        if self.handover is Handover.EARLY_WEIGHTS and self.routing is Routing.ROUTING_GRID:
            # It waits on the kept routed count that only a GEMM1 that routes completes.
            raise ValueError("early weights need a GEMM1 that routes")
        if self.handover is Handover.FUSED and self.routing is not Routing.GEMM1_GRID:
            raise ValueError("the fused GEMMs route in their grid and meet")
        if self.gemm1_feed is Gemm1Feed.PRODUCER_WARP and self.routing is not Routing.GEMM1_GRID:
            # Its slot draw needs every CTA resident at once: the cooperative launch that only a routing GEMM1 has.
            raise ValueError("the producer warp's walk needs GEMM1's cooperative grid")
        if self.gemm1_feed is Gemm1Feed.GATHERED_ROWS:
            if self.routing is not Routing.ROUTING_GRID:
                raise ValueError("the row gather reads the counts of a routing grid before GEMM1")
            if self.block_tokens != GROUPED_TILE_M or self.gemm1_scratch_in_stage:
                raise ValueError(f"the grouped GEMM1 has {GROUPED_TILE_M}-row tiles and no epilogue tile in a stage")
        if self.gemm2_form is Gemm2Form.GROUPED:
            if self.engine is not Engine.WGMMA or not self.f16_c:
                raise ValueError("the grouped GEMM2 is a WGMMA GEMM2 on f16 C")
            if self.gemm2_block_tokens != GROUPED_GEMM2_TILE_T:
                raise ValueError(f"the grouped GEMM2 has {GROUPED_GEMM2_TILE_T}-token tiles")

    def gemm1(self) -> StreamingGemmConfig | WgmmaGemm1Config | GroupedGemm1Config:
        if self.gemm1_feed is Gemm1Feed.GATHERED_ROWS:
            return GroupedGemm1Config(self.num_stages)
        if self.engine is Engine.WGMMA:
            return WgmmaGemm1Config(self.block_tokens, self.num_stages, self.gemm1_scratch_in_stage, self.gemm1_feed)
        return StreamingGemmConfig(
            gemm1=True,
            block_tokens=self.block_tokens,
            num_stages=self.num_stages,
            routing_per_cta=self.routing is Routing.EVERY_CTA,
        )

    def make_gemm1(self) -> StreamingGemm | WgmmaGemm1 | GroupedGemm1:
        config = self.gemm1()
        if isinstance(config, GroupedGemm1Config):
            return GroupedGemm1(config)
        return WgmmaGemm1(config) if isinstance(config, WgmmaGemm1Config) else StreamingGemm(config)

    def gemm2(self) -> StreamingGemmConfig | WgmmaGemm2Config | GroupedGemm2Config:
        if self.gemm2_form is Gemm2Form.GROUPED:
            return GroupedGemm2Config(self.gemm2_num_stages)
        if self.engine is Engine.WGMMA:
            return WgmmaGemm2Config(self.gemm2_block_tokens, self.gemm2_num_stages, f16_c=self.f16_c)
        return StreamingGemmConfig(
            gemm1=False,
            block_tokens=self.gemm2_block_tokens,
            num_stages=self.gemm2_num_stages,
            weights_before_wait=self.handover is Handover.EARLY_WEIGHTS,
        )

    def make_gemm2(self) -> StreamingGemm | WgmmaGemm2 | GroupedGemm2:
        config = self.gemm2()
        if isinstance(config, GroupedGemm2Config):
            return GroupedGemm2(config)
        return WgmmaGemm2(config) if isinstance(config, WgmmaGemm2Config) else StreamingGemm(config)

    def make_host(self) -> host.MoeHostSm90 | fused_gemms.FusedMoeHost:
        """The host function of the call's launches (`host.py`, or the fused GEMMs' two)."""
        if self.handover is Handover.FUSED:
            return fused_gemms.FusedMoeHost(self.make_gemm1(), self.make_gemm2())
        return host.MoeHostSm90(
            self.make_gemm1(),
            self.make_gemm2(),
            routing_in_gemm1=self.routing is not Routing.ROUTING_GRID,
            combine_loads_first=self.combine_loads_first,
        )

    def grids(self, num_sms: int) -> tuple[int, int]:
        """(GEMM1, GEMM2) persistent grids. The fused GEMMs run on one grid in their kernel's shared memory (GEMM2's,
        which holds GEMM1's)."""
        if self.handover is Handover.FUSED:
            return (fused_gemms.FusedGemmsConfig(self.gemm2_block_tokens, self.gemm2_num_stages).grid(num_sms),) * 2
        return self.gemm1().grid(num_sms), self.gemm2().grid(num_sms)


# GEMM2's shared memory per CTA fits two CTAs per SM in every variant but GROUPED_T (whose grouped GEMMs take an SM
# each): on `mma.sync` 103 KB (8 x 4), on WGMMA ~80 KB (8 x 4); three at 32 x 2 (~66 KB). So does GEMM1's; three at
# 32 x 3 with the epilogue tile in a token stage (~74 KB).
# Up to MEDIUM_T_MAX_TOKENS GEMM1 is the call's first kernel and routes the tokens itself: its stream starts ~6 us
# earlier than after a routing kernel, when the host's launch of a second kernel would only reach the GPU.
# Up to FEW_TOKENS_MAX the combine issues all of a thread's loads before using one; above it its 92 registers per thread
# would cut its CTAs per SM from 16 to 5 where a thread has about one row to load anyway (0.97x at 11948-14107 tokens).
#
# Up to EARLY_W2_MAX_TOKENS GEMM2 reads its schedule once the routed count is complete and issues its first stages'
# weights before its programmatic wait, so that W2 is in flight when GEMM1 ends (1.037x at 1 token). With more tokens
# GEMM1's CTAs retire over many microseconds and the early copies compete with them for DRAM (~1.00x at 7-32 tokens).
# Up to 4 tokens (one per warp) every GEMM1 CTA routes them all and ranks them in token order instead of meeting the
# grid on CTA 0's routing (1.040x at 1 token): the routing is cheaper than the grid meeting.
# Its GEMM2 walks a fixed round robin: with 1-2 experts and at most two items per CTA, claiming items gains nothing
# (1.003x at 1 token). Row tiles of 16 tokens in GEMM1, of 8 in GEMM2, four stages each, two CTAs per SM.
TINY_T_EARLY_W2 = StreamingVariant(
    Engine.MMA_SYNC,
    Routing.EVERY_CTA,
    block_tokens=16,
    num_stages=NUM_STAGES,
    gemm2_block_tokens=8,
    gemm2_num_stages=NUM_STAGES,
    handover=Handover.EARLY_WEIGHTS,
    combine_loads_first=True,
)
# From EARLY_W2_MAX_TOKENS + 1 to WGMMA_GEMM1_MIN_TOKENS - 1 both GEMMs run in one cooperative kernel whose CTAs go on
# to GEMM2 items as soon as their expert's GEMM1 items are all done (`fused_gemms.py`): DRAM streams W2 while the last
# GEMM1 items finish instead of idling through the hand-over between two kernels (1.024-1.068x at 7-32 tokens over the
# two chained kernels, NOTES.md). GEMM2's CTAs claim their items after the first from a kept counter: they come to it as
# their GEMM1 items end, so a fixed walk's extra items would end some SMs microseconds after the rest. Both GEMMs on
# 8-token row tiles, four stages, two CTAs per SM.
FUSED_T = StreamingVariant(
    Engine.MMA_SYNC,
    Routing.GEMM1_GRID,
    block_tokens=8,
    num_stages=NUM_STAGES,
    gemm2_block_tokens=8,
    gemm2_num_stages=NUM_STAGES,
    handover=Handover.FUSED,
    combine_loads_first=True,
)
# From 33 tokens both GEMMs are on WGMMA (the bf16 WGMMA GEMM2 1.02x over the `mma.sync` one at 52-62 tokens): GEMM1 on
# 16-token tiles, GEMM2 on 8-token tiles (four 8-token GEMM2 stages hold more weight bytes in flight than three of 16).
FEW_TOKENS = StreamingVariant(
    Engine.WGMMA,
    Routing.GEMM1_GRID,
    block_tokens=16,
    num_stages=NUM_STAGES,
    gemm2_block_tokens=8,
    gemm2_num_stages=NUM_STAGES,
    combine_loads_first=True,
)
# Above 192 tokens GEMM2 converts each W2 once per 32-token tile into WGMMA's registers. Its C is f16 times a power of
# two per row, so that a pair of e4m3 weights takes one conversion instead of four (no gain at 52-80 tokens, hence only
# here), in two stages at three CTAs per SM: at 8 warps per SM this GEMM2 is bound by each warp's chain of loads,
# conversions and MMAs (ncu), and a third CTA hides it.
# Its GEMM1 runs 3 stages at three CTAs per SM, the epilogue tile in the stage just consumed (~74 KB, 87 registers a
# thread), fed by a producer warp and walking by partition rank (`Gemm1Feed.PRODUCER_WARP`): over the CTA index the
# H200 places CTAs 0-23 three each on 8 SMs, which then run a round behind; the producer warp's mbarriers let no
# CTA-wide barrier end a K stage; and the fabric between the two L2 partitions bounds this GEMM1 at 901 tokens (ncu:
# 86.7 % of its throughput with a walk by SM id, 75.2 % with the walk by partition rank).
MEDIUM_T = StreamingVariant(
    Engine.WGMMA,
    Routing.GEMM1_GRID,
    block_tokens=32,
    num_stages=3,
    gemm2_block_tokens=32,
    gemm2_num_stages=2,
    gemm1_feed=Gemm1Feed.PRODUCER_WARP,
    gemm1_scratch_in_stage=True,
    f16_c=True,
)
# Above MEDIUM_T_MAX_TOKENS each expert has hundreds of tokens and both GEMMs are bound by their MMAs. The routing is a
# grid of its own (T warps over the SMs; GEMM1's grid would route 4 x its CTAs tokens at a time), the token rows are
# gathered by expert into grouped buffers, and the grouped GEMM1 feeds two MMA warpgroups per SM on 128 x 256 tiles by
# TMA from them in 4 stages (one CTA per SM). Its C is in the column order of MEDIUM_T's GEMM2 and rewritten as f16 as
# there; the grouped GEMM2 reads it by TMA in 128-token tiles (W2 converted once per 128 tokens instead of 32), 4
# stages, one CTA per SM.
GROUPED_T = dataclasses.replace(
    MEDIUM_T,
    routing=Routing.ROUTING_GRID,
    block_tokens=GROUPED_TILE_M,
    num_stages=4,
    gemm2_block_tokens=GROUPED_GEMM2_TILE_T,
    gemm2_num_stages=4,
    gemm1_feed=Gemm1Feed.GATHERED_ROWS,
    gemm1_scratch_in_stage=False,
    gemm2_form=Gemm2Form.GROUPED,
)
VARIANTS = (TINY_T_EARLY_W2, FUSED_T, FEW_TOKENS, MEDIUM_T, GROUPED_T)


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
    return GROUPED_T


_COMPILED: dict[tuple[str, StreamingVariant], Callable] = {}


def _compile(arch: str, variant: StreamingVariant) -> Callable:
    return host.compile_host(variant.make_host(), arch)


def compiled_for(variant: StreamingVariant, arch: str = GPU_ARCH) -> Callable:
    """The compiled launcher of `variant` for `arch` (compiled on first use; needs no GPU)."""
    key = (arch, variant)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = _compile(arch, variant)
    return fn


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    """Compile the variants, the zeroing of new counter and walk buffers and the L2 partition probe's kernels for
    `arch` without touching a GPU (for CI and warm-up: no call compiles lazily afterwards)."""
    return (
        *(compiled_for(variant, arch) for variant in VARIANTS),
        counters.compiled_zero(arch),
        counters.compiled_zero(arch, 2 * WALK_SLOT_WORDS),
        *l2_partitions.compiled_kernels(arch),
    )


def warm_up(device: torch.device | None = None) -> None:
    """Once per device before serving, outside any timed call or CUDA-graph capture: measure which SMs share an L2
    partition (`l2_partitions.partition_ranks`: our own kernels, tens of ms, synchronises) and write the ranks into
    the kept walk buffers of MEDIUM_T's GEMM1, present and future. Calls before it walk by SM id instead: the same
    outputs bit for bit, slower at 193-1024 tokens (NOTES.md). The runner runs it as our side's start-up."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    l2_partitions.partition_ranks(device)
    torch.cuda.synchronize(device)  # no call of another stream still reads a walk buffer written below
    counters.rank_kept_walk_buffers(device)
    torch.cuda.synchronize(device)


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = l2_partitions.device_index(device)
    count = _NUM_SMS.get(index)
    if count is None:
        count = _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


@functools.cache
def _grids(variant: StreamingVariant, num_sms: int) -> tuple[int, int]:
    """`variant.grids`, cached: building the configurations costs ~0.5 ms."""
    return variant.grids(num_sms)


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
    workspaces = Workspaces.allocate(num_tokens, device, gathered_rows=variant.gemm1_feed is Gemm1Feed.GATHERED_ROWS)
    gemm1_ctas, gemm2_ctas = _grids(variant, _num_sms(device))
    kept = counters.kept_counts(device, GPU_ARCH)
    routes = variant.routing is not Routing.ROUTING_GRID
    kept_routed = counters.kept_routed(device, GPU_ARCH) if routes else None
    walks = variant.gemm1_feed is Gemm1Feed.PRODUCER_WARP
    kept_slots = counters.kept_walk_slots(device, GPU_ARCH) if walks else None
    # The fused GEMMs' readiness words, zeroed by the kernel itself (`fused_gemms.py`).
    fused = variant.handover is Handover.FUSED
    ready = torch.empty(fused_gemms.READY_WORDS, dtype=torch.int32, device=device) if fused else None
    host.launch(
        compiled_for(variant), inputs, output, workspaces, gemm1_ctas, gemm2_ctas, kept, kept_routed, kept_slots, ready
    )
    return workspaces


run = make_run(variant_for)
