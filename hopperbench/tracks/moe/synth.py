"""Inputs of the MoE track (`moe_fp8_block_scale_ds_routing_topk8_ng8_kg4_e32_h7168_i2048`), on the
machinery of `hopperbench.synth` (the contest's actual random inputs were plain randn, which makes
the reference numerically meaningless, see the block scales):
- `routing_logits` randn fp32; `routing_bias` N(0, 0.1^2) bf16 (small, like a trained
  load-balancing bias: it shifts selection without dominating it).
- fp8 tensors (`hidden_states`, `gemm1_weights`, `gemm2_weights`): randn clamped to [-2, 2]
  then cast to e4m3, as flashinfer-bench does for random fp8.
- Block scales: U[0.5, 1.5] times a per-tensor base, not randn (randn scales are half
  negative and made the contest's reference outputs ~1e4 with ~1e4 errors still passing).
  The bases make each GEMM map unit-variance inputs to std ~ its gain: gemm1
  `GEMM1_GAIN / sqrt(7168)`, gemm2 `GEMM2_GAIN / sqrt(2048)`, hidden 1. Measured on
  CPU (seq_len 80): outputs of tokens with a local expert have std ~11 and 92 % of them
  exceed 1 in magnitude, so the MoE rule (|err| <= 1 or rel <= 0.3 on 90 %) rejects an
  all-zero output (62 % of elements off) or swapped hidden-scale blocks (44 % off).
- `local_expert_offset`, `routed_scaling_factor`: from the workload.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hopperbench.synth import Recipe, SynthContext, randn, random_fp8, uniform
from hopperbench.workloads import WorkloadSpec

ROUTING_BIAS_STD = 0.1
GEMM1_GAIN = 4.0
GEMM2_GAIN = 2.0


def absent_optional_inputs(workload: WorkloadSpec) -> set[str]:
    """No optional inputs."""
    return set()


def _block_scale(base: Callable[[SynthContext], float]) -> Callable[[SynthContext, str], torch.Tensor]:
    def make(ctx: SynthContext, name: str) -> torch.Tensor:
        return uniform(ctx, name, 0.5, 1.5).mul_(base(ctx))

    return make


RECIPE: Recipe = {
    "routing_logits": randn,
    "routing_bias": lambda ctx, name: randn(ctx, name, ROUTING_BIAS_STD),
    "hidden_states": random_fp8,
    "hidden_states_scale": _block_scale(lambda ctx: 1.0),
    "gemm1_weights": random_fp8,
    "gemm1_weights_scale": _block_scale(lambda ctx: GEMM1_GAIN / math.sqrt(ctx.definition.const_axes["hidden_size"])),
    "gemm2_weights": random_fp8,
    "gemm2_weights_scale": _block_scale(
        lambda ctx: GEMM2_GAIN / math.sqrt(ctx.definition.const_axes["intermediate_size"])
    ),
}
