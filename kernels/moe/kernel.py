"""FP8 block-scale MoE for SM90 in CuTe-DSL: `moe_fp8_block_scale_ds_routing_topk8_ng8_kg4_e32_h7168_i2048`.

v2.18 (v1 promoted 2026-11-29; its GEMM2 configurations deepened by candidate v1.1 "deep stream",
1.15x over v1; every launch after the first a programmatic dependent of the one before (v1.4,
`chain.py`); the per-expert counters kept zeroed between calls (v1.5 "clean counters",
`counters.py`) and GEMM1 + SwiGLU on FP8 warpgroup MMA from WGMMA_GEMM1_MIN_TOKENS (v2.0,
`wgmma_gemm1.py`), both promoted in session 9; GEMM2 at two CTAs per SM above 192 tokens (v1.6,
1.29x at T = 901); GEMM2 on bf16 warpgroup MMA (v2.1, `wgmma_gemm2.py`, session 10: 1.22x at
T = 901, 1.02x at 52-62 tokens) and weight streaming at every T (1.51x and 1.65x at 14107 and 11948
tokens over v0's grouped pipeline, which it replaced); in session 11 the 33-64-token variant up to
FEW_TOKENS_MAX (v2.3, 1.06x at 80 tokens) and 64-token GEMM1 tiles above MEDIUM_T_MAX_TOKENS (v2.2,
1.15x / 1.17x at 11948 / 14107 tokens; the threshold from an off-list sweep); in session 15 each
streaming GEMM locating a work item once instead of twice per K stage (v2.4, candidate v2.7: 1.10x over
the 19, 1.01-1.19x per workload); in session 19 the `mma.sync` GEMMs below WGMMA_GEMM1_MIN_TOKENS issuing each
K stage from per-item address bases (v2.5, candidate v2.13: 1.060x on those six workloads, every trial faster),
and the warpgroup-MMA GEMMs from there doing the same (v2.6, candidate v2.14: 1.020x on those 13 workloads, 1.069x
at 901 tokens, every trial faster); in session 20 no routing kernel up to MEDIUM_T_MAX_TOKENS, GEMM1's
cooperative grid routing the tokens itself (v2.7, candidate v2.16: 1.038x on the six workloads below 33 tokens,
1.022x on the 17 up to 1024); in session 22 GEMM2's first weights issued before its programmatic wait up to
EARLY_W2_MAX_TOKENS (v2.21: 1.037x at 1 token) and no release kernel, the combine zeroing the kept counters (v2.22:
1.006x over the 19, 90 of 95 trials faster); in session 23 the combine's loads issued before their first use up to
FEW_TOKENS_MAX (v2.25: 1.007x on those 16 workloads, 79 of 80 trials faster) and up to 4 tokens every GEMM1 CTA
routing the tokens itself, no grid meeting (v2.26: 1.040x at 1 token); in session 24 at 7-8 tokens GEMM1 at three CTAs
per SM walking its items in paired rounds, so that most SMs never end on a lone CTA (v2.29: 1.024x at 7 tokens); in
session 25 that walk grouped by SM id (v2.32: 1.016x at 7 tokens) and from 7 to 32 tokens GEMM2's items after the
first claimed from a kept counter (v2.34: 1.011x at 7 tokens, 1.010-1.014x at 14-32); in session 27 above 192 tokens
C rewritten as f16 times a power of two per row so that GEMM2 multiplies f16, in two stages at three CTAs per SM (v2.39
and v2.40: 1.047x at 901 tokens, 1.069x / 1.074x at 11948 / 14107); in session 28 from 193 to MEDIUM_T_MAX_TOKENS
GEMM1 in 3 stages at three CTAs per SM walking its items by SM id (v2.41 and v2.42: 1.043x at 901 tokens, 5 of 5
trials faster); in session 30 that GEMM1's stages issued by a producer warp on per-slot mbarriers, no CTA-wide barrier
per K stage (v2.52: 1.011x at 901 tokens by the ratio of medians, paired 1.023x, 5 of 5 trials faster); in session 31
that GEMM1 walking by the SMs' L2-partition ranks with an expert's items weight tile by weight tile (v2.56: 1.034x at
901 tokens by the ratio of medians, paired 1.067x, 5 of 5 trials faster); in session 32 from 5 to 32 tokens both
`mma.sync` GEMMs in one cooperative kernel whose CTAs go on to GEMM2 items as soon as their expert's GEMM1 items are
done (`fused_gemms.py`; v2.57: 1.028x at 7 tokens by the ratio of medians, paired 1.030x, 5 of 5 trials faster,
1.024-1.068x at 14-32 tokens; NOTES.md). Destination passing,
definition order, no host sync (but once per device, at the first call of 193-1024 tokens: the L2 partition probe), no
data-dependent host logic, graph-safe.

Every call is the kernels of `host.py` in one TVM-FFI call, chained by programmatic dependent launches, on
counters the previous call on the stream left at zero: up to MEDIUM_T_MAX_TOKENS three (GEMM1 + SwiGLU, which
first routes the tokens, meets on a kept count and copies the final counts out, GEMM2, and the combine, which also
zeroes the kept counters for the next call), above it four (the routing grid first); above FEW_TOKENS_MAX one more
between the GEMMs, the rewrite of C as f16 (`c_to_f16.py`); from EARLY_W2_MAX_TOKENS + 1 to WGMMA_GEMM1_MIN_TOKENS - 1
two (both GEMMs in one cooperative kernel, `fused_gemms.py`, and the combine). Both GEMMs are persistent
weight streams; the variant is chosen from T alone (a shape):

- GEMM1 on `mma.sync` below WGMMA_GEMM1_MIN_TOKENS (its 32-row items keep twice as many CTAs
  streaming one or two experts' weights) and on FP8 WGMMA from there (which removes its issue bound).
  From EARLY_W2_MAX_TOKENS + 1 to WGMMA_GEMM1_MIN_TOKENS - 1 its row tiles are 8 tokens of 4 stages, in the fused
  kernel, whose GEMM2 phase (the same tiles and stages) starts an expert's items once its GEMM1 items are done.
  Otherwise row tiles of 16 tokens up to FEW_TOKENS_MAX, 32 up to MEDIUM_T_MAX_TOKENS (at T = 901 the
  synthesized routing gives 20-27 active experts ~40 tokens each, up to ~180: ~1.8 row tiles per
  expert; NOTES.md), 64 above, where each expert has hundreds of tokens and a tile of 64 reads its
  weights half as often (three stages, its epilogue tile in the stage just consumed: two CTAs per SM). The 32-token
  tiles take 3 stages, the epilogue tile in a stage too, at three CTAs per SM, their round robin over slot x SMs +
  the SM's rank (the same kept slot draw), so that every SM holds an equal share of the items whatever the placement;
  the rank puts one L2 partition's SMs first and an expert's row tiles of one weight tile are adjacent items, so that
  the CTAs reading a weight tile at once share a partition (`l2_partitions.py`: the first call at these sizes on a
  device measures which SMs share one, tens of ms by estimate, and synchronises; a CUDA-graph capture that makes the
  buffer walks by SM id).
- GEMM2 (whose 16-bit activation stages are twice GEMM1's) gets 8-token tiles with 4 stages at two CTAs per SM up
  to FEW_TOKENS_MAX, 32-token tiles with 2 stages at three CTAs per SM above. It runs on 16-bit WGMMA with the e4m3
  weights converted in registers wherever GEMM1 is on WGMMA (GEMM1 then stores C in the column order it reads):
  bf16 up to FEW_TOKENS_MAX, above it f16 on C rewritten as f16 times a power of two per row (one conversion per pair
  of weights instead of four; the same products up to that power but for elements below 2^-31 of their row's amax,
  and the same output bit for bit in every case tested). Up to EARLY_W2_MAX_TOKENS it issues its first stages'
  weights before its programmatic wait (only C waits for GEMM1); from there to WGMMA_GEMM1_MIN_TOKENS its CTAs claim
  their items after the first from a kept counter (`streaming_gemm.claim_item`).

Each configuration is compiled once (dynamic T) on first use and cached; `compile_only()` compiles
all of them.
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
# `tools/moe_routing_stats.py`): v2.3 measured this variant 1.06x at T = 80 over 16-token GEMM2 tiles on
# `mma.sync`, whose three stages held fewer weight bytes in flight than these four.
FEW_TOKENS_MAX = 192
# Below this, one or two experts are active and WGMMA's 64-row items halve the CTAs that stream them:
# in session 9's run the WGMMA GEMM1 was 0.86x at T = 1, 0.90x at 7 and 0.97x at 32 (1.02x at 14-16),
# and 1.015x (geometric mean) at 52-62, 1.05x at 80 and 1.29x at 901.
WGMMA_GEMM1_MIN_TOKENS = 33
# GEMM1's 64-token tiles measured 0.98x at T = 901 (trials +5.6 %, -5.4 %, -1.2 %: it depends on how
# many tokens the busiest experts get) and 1.15-1.17x at 11948 and 14107; between them, off the list
# (`tools/time_axes.py`, session 11), 0.99-1.07x at 1024, 1.05-1.09x at 1536 and 1.02-1.08x at 2048.
MEDIUM_T_MAX_TOKENS = 1024
# The early-W2 variant up to here, where every GEMM1 CTA routes the tokens itself (v2.26); from the next count to
# WGMMA_GEMM1_MIN_TOKENS - 1 the fused GEMMs (v2.18), which measured 1.043x and 1.049x (medians) off the list at 5 and
# 6 tokens over this variant (`results/checks/2026-12-01_moe_fused_gemms_session32_sweep.txt`).
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
    routing_in_gemm1: bool = False  # no routing kernel: GEMM1's cooperative grid routes first (v2.16)
    gemm2_weights_before_wait: bool = False  # the `mma.sync` GEMM2 issues its first weights before its wait (v2.21)
    combine_loads_first: bool = False  # the combine issues all of a thread's loads before using one (v2.25)
    routing_per_cta: bool = False  # up to 4 tokens every GEMM1 CTA routes them all, no meeting (v2.26)
    gemm1_ctas_per_sm: int = 2  # the WGMMA GEMM1's max_ctas_per_sm (v2.41; the `mma.sync` one's v2.29 until v2.18)
    gemm1_smid_walk: bool = False  # the WGMMA GEMM1's smid_walk (v2.42; the `mma.sync` one's v2.32 until v2.18)
    gemm1_producer_warp: bool = False  # the WGMMA GEMM1's producer_warp (v2.52)
    gemm1_partition_walk: bool = False  # the WGMMA GEMM1's partition_walk (v2.56)
    gemm2_dynamic_items: bool = False  # the `mma.sync` GEMM2's StreamingGemmConfig dynamic_items (v2.34)
    f16_c: bool = False  # C rewritten as f16 times a power of two per row for an f16 WGMMA GEMM2 (v2.39)
    gemm2_ctas_per_sm: int = 2  # the WGMMA GEMM2's WgmmaGemm2Config max_ctas_per_sm (v2.40)
    fused_gemms: bool = False  # both `mma.sync` GEMMs in one cooperative kernel (`fused_gemms.py`, v2.18)

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
            # The `mma.sync` GEMM1 keeps two CTAs per SM over the CTA index since the fused GEMMs (v2.18).
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
# Up to MEDIUM_T_MAX_TOKENS GEMM1 is the call's first kernel and routes the tokens itself (v2.16: its stream
# starts ~6 us earlier, where the host's launch of a second kernel would have reached the GPU).
# Up to FEW_TOKENS_MAX the combine issues all of a thread's loads before using one (v2.25: 1.007x over the 16 workloads
# up to 192 tokens, 79 of 80 trials faster); above it its 92 registers per thread would cut its CTAs per SM from 16 to 5
# where a thread has about one row to load anyway (v2.24: 0.97x at 11948 and 14107 tokens).
# GEMM2's CTAs claim their items after the first from a kept counter: they become resident as GEMM1's retire, so which
# of them share an SM is not known, and a fixed walk's extra items ended some SMs microseconds after the rest (v2.34:
# 1.011x at 7 tokens, 5 of 5 trials faster; 14-32 tokens 1.010-1.014x; 8 tokens 1.016x); since v2.18 the fused GEMMs'
# GEMM2 phase at 5-32 tokens, whose CTAs come to it as their GEMM1 items end.
TINY_T = StreamingVariant(
    block_tokens=16,
    gemm2_block_tokens=8,
    gemm2_num_stages=4,
    routing_in_gemm1=True,
    combine_loads_first=True,
    gemm2_dynamic_items=True,
)
# Up to EARLY_W2_MAX_TOKENS GEMM2 reads its schedule once the routed count is complete and issues its first stages'
# weights before its programmatic wait (v2.21: 1.037x at 1 token, all five trials faster; 1.007-1.034x off the list at
# 2-6 tokens). Above it GEMM1's CTAs retire over many microseconds and the early copies compete with them for DRAM
# (v2.20: ~1.00x at 7-16 tokens, 0.983x at 32).
# Up to 4 tokens (one per warp) every GEMM1 CTA routes them all and ranks them in token order instead of meeting the
# grid on CTA 0's routing (v2.26: 1 token 1.040x, 5 of 5 trials; off the list 2-4 tokens 1.001-1.040x, 5-6 tokens,
# where the same kernel meets, 0.997-0.998x).
# Its GEMM2 walks a fixed round robin: claims (v2.38) measured 1.003x at 1 token, where GEMM2 mostly has 1-2 experts and
# at most two items per CTA (1.010-1.024x off the list at 2-6 tokens).
TINY_T_EARLY_W2 = dataclasses.replace(
    TINY_T, gemm2_weights_before_wait=True, routing_per_cta=True, gemm2_dynamic_items=False
)
# From EARLY_W2_MAX_TOKENS + 1 to WGMMA_GEMM1_MIN_TOKENS - 1 both GEMMs run in one cooperative kernel whose CTAs go on to
# GEMM2 items as soon as their expert's GEMM1 items are all done (`fused_gemms.py`; v2.57: 7 tokens 1.028x by the ratio of
# medians, paired 1.030x, 5 of 5 trials faster; 14 / 15 / 16 / 32 tokens 1.068 / 1.024 / 1.057 / 1.026x; medians
# 1.043-1.059x off the list at 5, 6, 8 and 24 tokens): GEMM1 on 8-token row tiles as GEMM2, four stages, two CTAs per
# SM. It replaced v2.29 / v2.32's GEMM1 at three CTAs per SM walking paired rounds by SM id at 7-8 tokens (removed with
# its walk, NOTES session 32) and TINY_T's two chained kernels at 9-32 tokens (TINY_T stays: the base of the variants
# here and the chained reference that the tests compare the fused GEMMs with bit for bit).
FUSED_T = dataclasses.replace(TINY_T, block_tokens=8, fused_gemms=True)
# From 33 tokens both GEMMs are on WGMMA (v2.0, v2.1: 1.02x over the `mma.sync` GEMM2 at 52-62).
FEW_TOKENS = dataclasses.replace(TINY_T, wgmma_gemm1=True, wgmma_gemm2=True, gemm2_dynamic_items=False)
# Above 192 tokens GEMM2 converts each W2 once per 32-token tile into WGMMA's registers (v2.1: 1.22x
# at 901 over v1.6's `mma.sync` 16 x 3), and every larger T streams too (1.51-1.65x over v0's grouped
# pipeline at 11948 and 14107 tokens). Its C is f16 times a power of two per row (v2.39: one conversion per pair of
# weights; 1.019x at 901 tokens, 1.026-1.027x at 11948 / 14107; at 52-80 tokens, 8-token tiles, no gain), in two
# stages at three CTAs per SM (v2.40: ncu found this GEMM2 bound by each warp's chain of loads, conversions and MMAs at
# 8 warps per SM; 1.047x at 901, 1.069x / 1.074x at 11948 / 14107 over v2.13, every trial faster).
# Its GEMM1 runs 3 stages at three CTAs per SM, the epilogue tile in the stage just consumed (~74 KB, 87 registers a
# thread), and walks round robin over slot x 132 + SM id with v2.32's kept slot draw (v2.41 and v2.42: the third CTA
# shortened GEMM1 ~5 %, but over the CTA index the H200's placement of CTAs 0-23 three each on 8 SMs left those SMs a
# round behind on 2 of 5 routings at 901 tokens (0.975x, 0.993x); by SM id 1.043x at 901, 5 of 5 trials faster, and
# medians 1.02-1.08x off the list at 256-1024 tokens). A fifth warp issues its stages (the weights by TMA, the token
# rows by coalesced cp.async) on per-slot full and empty mbarriers, so no CTA-wide barrier ends a K stage (v2.52: 901
# tokens 1.011x by the ratio of medians, paired median 1.023x, 5 of 5 trials faster; medians 1.015-1.022x off the list
# at 256-1024 tokens; v2.51, one token row per producer lane, lost 0.849x on its uncoalesced copies). Its walk takes the
# SMs by their rank with one L2 partition's SMs first (measured once per device, `l2_partitions.partition_ranks`) and
# an expert's items weight tile by weight tile, so that the CTAs reading one weight tile share a partition: the fabric
# between the two partitions bounded this GEMM1 at 901 tokens (ncu: 86.7 % -> 75.2 %; v2.56: 901 tokens 1.034x by the
# ratio of medians, paired median 1.067x, 5 of 5 trials faster; medians 0.996 / 1.026 / 1.058x at 256 / 512 / 1024).
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
# Above MEDIUM_T_MAX_TOKENS GEMM1 reads each expert's weights once per 64 tokens (v2.2), and the routing is a
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
