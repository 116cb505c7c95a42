"""FP8 block-scale MoE for SM90 in CuTe-DSL: `moe_fp8_block_scale_ds_routing_topk8_ng8_kg4_e32_h7168_i2048`.

v1.6 (v1 promoted 2026-11-29; its GEMM2 configurations deepened by candidate v1.1 "deep stream",
1.15x over v1; every launch after the first a programmatic dependent of the one before (v1.4,
`chain.py`); the per-expert counters kept zeroed between calls (v1.5 "clean counters",
`counters.py`) and GEMM1 + SwiGLU on FP8 warpgroup MMA from WGMMA_GEMM1_MIN_TOKENS (v2.0,
`wgmma_gemm1.py`), both promoted from the first run of 2026-11-30, session 9; GEMM2 at two CTAs per
SM above SMALL_T_MAX_TOKENS too (v1.6, 1.29x at T = 901 in the second run; NOTES.md): the routing and
combine kernels of the grouped pipeline around weight-streaming expert GEMMs.
Destination passing, definition order, no host sync, no data-dependent host logic, graph-safe. The
path is chosen from T alone (a shape):

- T <= STREAMING_MAX_TOKENS: the five kernels of `host.py` in one TVM-FFI call, chained by
  programmatic dependent launches: the routing grid on counters the previous call on the stream
  left at zero, GEMM1 + SwiGLU, GEMM2, the combine, and a one-CTA kernel that copies the counters
  out and zeroes them. Both GEMMs are persistent weight streams; GEMM1 on `mma.sync` below
  WGMMA_GEMM1_MIN_TOKENS (its 32-row items keep twice as many CTAs streaming one or two experts'
  weights) and on WGMMA from there (which removes its issue bound: 1.29x at T = 901). Row tiles
  of 16 tokens up to SMALL_T_MAX_TOKENS, 32 above (so that at T ~ 900, ~28 tokens per expert, most
  experts' weights are streamed once). GEMM2 (whose bf16 activation stages are twice GEMM1's) gets
  tiles and stages that still fit two CTAs per SM: 8-token tiles with 4 stages up to FEW_TOKENS_MAX,
  16-token tiles with 3 stages above. With few tokens per expert its weight stream is bound by the
  bytes in flight over the latency; at ~28 tokens per expert (T ~ 900) by the latency of each
  warp's chain of conversions and MMAs, which a second CTA per SM hides.
- Larger T: the grouped-GEMM pipeline (`grouped_pipeline.run`, v0), whose 64 x 128 tiles do more
  MMA work per weight byte.

Each configuration is compiled once (dynamic T) on first use and cached; `compile_only()` compiles
all of them.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from . import counters, grouped_pipeline, host
from .grouped_pipeline import GPU_ARCH, MAX_TOKENS, MoeShapeError
from .host import Workspaces
from .streaming_gemm import StreamingGemm, StreamingGemmConfig
from .wgmma_gemm1 import WgmmaGemm1, WgmmaGemm1Config
from .wgmma_gemm2 import WgmmaGemm2, WgmmaGemm2Config

__all__ = [
    "FEW_TOKENS_MAX",
    "GPU_ARCH",
    "MAX_TOKENS",
    "MoeShapeError",
    "SMALL_T_MAX_TOKENS",
    "STREAMING_MAX_TOKENS",
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

# Row tiles of 16 tokens while an expert expects few tokens (T / 32 per expert under uniform
# routing: <= 6 at T = 192), 32 tokens above. Beyond STREAMING_MAX_TOKENS v0 takes over. Up to
# FEW_TOKENS_MAX an active local expert gets ~1-8 tokens under the contest's routing, so GEMM2's
# 8-token tiles rarely stream an expert's weights twice.
FEW_TOKENS_MAX = 64
# Below this, one or two experts are active and WGMMA's 64-row items halve the CTAs that stream them:
# in session 9's run the WGMMA GEMM1 was 0.86x at T = 1, 0.90x at 7 and 0.97x at 32 (1.02x at 14-16),
# and 1.015x (geometric mean) at 52-62, 1.05x at 80 and 1.29x at 901.
WGMMA_GEMM1_MIN_TOKENS = 33
SMALL_T_MAX_TOKENS = 192
STREAMING_MAX_TOKENS = 2048
NUM_STAGES = 4
# Used when no device is visible (compile_only on CPU); run() asks the device.
DEFAULT_NUM_SMS = 132


@dataclass(frozen=True)
class StreamingVariant:
    """One compiled streaming configuration: tokens per row tile and pipeline depth of GEMM1, and of
    GEMM2 where they differ (the packed rows do not depend on the tiles, so each GEMM may have its own)."""

    block_tokens: int
    num_stages: int = NUM_STAGES
    gemm2_block_tokens: int | None = None  # None: block_tokens
    gemm2_num_stages: int | None = None  # None: num_stages
    chained: bool = False  # programmatic dependent launches between the call's kernels (chain.py)
    self_cleaning: bool = False  # counters kept zeroed between calls, no zeroing launch (counters.py)
    wgmma_gemm1: bool = False  # GEMM1 on FP8 warpgroup MMA (wgmma_gemm1.py) instead of mma.sync
    wgmma_gemm2: bool = False  # GEMM2 on bf16 warpgroup MMA (wgmma_gemm2.py); needs wgmma_gemm1
    gemm2_overlapped: bool = False  # wgmma_gemm2.WgmmaGemm2Config's overlapped; needs wgmma_gemm2

    def __post_init__(self) -> None:
        if self.wgmma_gemm2 and not self.wgmma_gemm1:
            # The WGMMA GEMM2 reads C in the column order only the WGMMA GEMM1 writes.
            raise ValueError("wgmma_gemm2 needs wgmma_gemm1")
        if self.gemm2_overlapped and not self.wgmma_gemm2:
            raise ValueError("gemm2_overlapped needs wgmma_gemm2")

    def gemm1(self) -> StreamingGemmConfig | WgmmaGemm1Config:
        if self.wgmma_gemm1:
            return WgmmaGemm1Config(
                block_tokens=self.block_tokens, num_stages=self.num_stages, permuted_c=self.wgmma_gemm2
            )
        return StreamingGemmConfig(gemm1=True, block_tokens=self.block_tokens, num_stages=self.num_stages)

    def make_gemm1(self) -> StreamingGemm | WgmmaGemm1:
        config = self.gemm1()
        return WgmmaGemm1(config) if isinstance(config, WgmmaGemm1Config) else StreamingGemm(config)

    def gemm2(self) -> StreamingGemmConfig | WgmmaGemm2Config:
        block_tokens = self.gemm2_block_tokens or self.block_tokens
        num_stages = self.gemm2_num_stages or self.num_stages
        if self.wgmma_gemm2:
            return WgmmaGemm2Config(block_tokens=block_tokens, num_stages=num_stages, overlapped=self.gemm2_overlapped)
        return StreamingGemmConfig(gemm1=False, block_tokens=block_tokens, num_stages=num_stages)

    def make_gemm2(self) -> StreamingGemm | WgmmaGemm2:
        config = self.gemm2()
        return WgmmaGemm2(config) if isinstance(config, WgmmaGemm2Config) else StreamingGemm(config)


# GEMM2's shared memory per CTA: 103 KB (8 x 4) and 108 KB (16 x 3), two CTAs per SM each, i.e. 8
# and 6 weight stages in flight per SM where 16-token tiles with 4 stages (141 KB) allow one CTA, 4.
# Every variant is chained and self-cleaning: the span of a call then equals its kernels' busy time
# and no call starts with a tiny zeroing launch and its host gap (sessions 8 and 9).
TINY_T = StreamingVariant(
    block_tokens=16, gemm2_block_tokens=8, gemm2_num_stages=4, chained=True, self_cleaning=True
)
FEW_TOKENS = dataclasses.replace(TINY_T, wgmma_gemm1=True)
SMALL_T = StreamingVariant(
    block_tokens=16, gemm2_block_tokens=16, gemm2_num_stages=3, chained=True, self_cleaning=True, wgmma_gemm1=True
)
# MEDIUM_T's GEMM2 is SMALL_T's: its own 32-token tiles with 4 stages (192 KB) fit one CTA per SM,
# and the second CTA is worth converting each W2 twice at ~28 tokens per expert (v1.6: 1.29x at 901).
MEDIUM_T = StreamingVariant(
    block_tokens=32, gemm2_block_tokens=16, gemm2_num_stages=3, chained=True, self_cleaning=True, wgmma_gemm1=True
)
VARIANTS = (TINY_T, FEW_TOKENS, SMALL_T, MEDIUM_T)


def variant_for(num_tokens: int) -> StreamingVariant | None:
    """The streaming variant for a batch of `num_tokens` tokens, or None for the grouped pipeline (v0)."""
    if num_tokens < 1:
        raise MoeShapeError(f"seq_len must be >= 1, got {num_tokens}")
    if num_tokens < WGMMA_GEMM1_MIN_TOKENS:
        return TINY_T
    if num_tokens <= FEW_TOKENS_MAX:
        return FEW_TOKENS
    if num_tokens <= SMALL_T_MAX_TOKENS:
        return SMALL_T
    if num_tokens <= STREAMING_MAX_TOKENS:
        return MEDIUM_T
    return None


_COMPILED: dict[tuple[str, StreamingVariant], Callable] = {}


def _compile(arch: str, variant: StreamingVariant) -> Callable:
    # The launches of host.py with the variant's two streaming GEMMs (grids: persistent CTAs).
    return host.compile_host(
        host.MoeHostSm90(
            variant.make_gemm1(),
            variant.make_gemm2(),
            variant.chained,
            variant.self_cleaning,
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
    """Compile the streaming variants, the grouped pipeline and the zeroing of a new counter buffer
    for `arch` without touching a GPU (for CI and warm-up: no call compiles lazily afterwards)."""
    return (
        *(compiled_for(variant, arch) for variant in VARIANTS),
        grouped_pipeline.compiled_for(arch),
        counters.compiled_zero(arch),
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
    """(GEMM1, GEMM2) persistent grids; cached, since building the configurations costs ~0.5 ms."""
    return persistent_ctas(variant.gemm1(), num_sms), persistent_ctas(variant.gemm2(), num_sms)


def make_run(choose: Callable[[int], StreamingVariant | None]) -> Callable[..., None]:
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
    choose: Callable[[int], StreamingVariant | None] = variant_for,
) -> Workspaces | None:
    """`run`, returning the streaming path's workspaces (None for T = 0 and the grouped path), so that a
    device check can tell a wrong GEMM1 from a wrong GEMM2. `choose` maps T to the streaming variant
    (None: the grouped pipeline); a candidate passes its own."""
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
    grouped_pipeline._check_inputs(*inputs[:9], output)
    num_tokens = routing_logits.shape[0]
    if num_tokens == 0:
        return None
    variant = choose(num_tokens)
    if variant is None:
        grouped_pipeline.run(*inputs, output)
        return None
    device = routing_logits.device
    workspaces = Workspaces.allocate(num_tokens, device)
    gemm1_ctas, gemm2_ctas = _grids(variant, _num_sms(device))
    kept = counters.kept_counts(device, GPU_ARCH) if variant.self_cleaning else None
    host.launch(compiled_for(variant), inputs, output, workspaces, gemm1_ctas, gemm2_ctas, kept)
    return workspaces


assert MAX_TOKENS >= STREAMING_MAX_TOKENS


run = make_run(variant_for)
