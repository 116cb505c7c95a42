"""GDN prefill candidate `cand_direct_key_side`: the WY path with `wy_prepass._KeySide(direct=True)`.

Why (NOTES.md, the WY path's key side): above 4000 tokens the key side takes ~44 of ~100 us, latency-bound at
three CTAs of four warps per SM. ncu's stall samples of the key kernel at 8192 tokens in 32 sequences: ~19 % in
finding the slot's sequence (a binary search over `cu_seqlens`, ~5 dependent global loads inside a 32-iteration
loop, before any copy is issued) and ~14 % in converting the staged bf16 k and q rows to fp16, a pass over
shared memory between two barriers that only the Gram tiles read. The direct key side finds the sequence with a
32-ary search of the warp (one or two dependent loads) and computes the Gram tiles with bf16 MMAs straight from
the staged rows. The products are exact either way, so A and P differ from the standard key side's only where
an element of k or q lies below fp16's normal range (2^-14), which the fp16 conversion rounds: the outputs are
compared with the standard path's at a tight tolerance (GPU test), not bit for bit. The chains are kernel.py's.
"""

from __future__ import annotations

from typing import Callable

from . import kernel, token_serial, wgmma_value_side, wy_prepass
from .token_serial import GPU_ARCH, GdnShapeError, resolve_scale
from .wy_prepass import WyPrepassConfig, _KeySide

__all__ = ["GdnShapeError", "compile_only", "resolve_scale", "run", "run_as_kernel"]


class _DirectWy(wy_prepass.GdnPrefillWyPrepassSm90):
    """`wy_prepass.py`'s launcher (its chain at the configured width) with the direct key side."""

    def key_side(self):
        return _KeySide(direct=True)


class _DirectWgmma(wgmma_value_side.GdnPrefillWyWgmmaSm90):
    """`wgmma_value_side.py`'s launcher (its WGMMA chain) with the direct key side."""

    def key_side(self):
        return _KeySide(direct=True)


_COMPILED: dict[tuple[str, WyPrepassConfig | None], Callable] = {}


def compiled_for(arch: str, config: WyPrepassConfig | None) -> Callable:
    """The compiled launcher: the direct key side, then `wy_prepass.py`'s chain at `config`'s width, or the WGMMA
    chain for config None (compiled on first use; needs no GPU)."""
    key = (arch, config)
    fn = _COMPILED.get(key)
    if fn is None:
        launcher = _DirectWgmma() if config is None else _DirectWy(config)
        align = wgmma_value_side.OUTPUT_ALIGN if config is None else 2
        fn = _COMPILED[key] = token_serial.compile_launcher(
            launcher, arch, wy_prepass._workspace_stand_ins(), output_align=align
        )
    return fn


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    return tuple(compiled_for(arch, config) for config in (*wy_prepass.CONFIGS, None))


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """The WY path at any T (`wy_prepass.run`'s contract) with the direct key side and kernel.py's chain."""
    token_serial.check_inputs(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, output, new_state)
    launcher = compiled_for(GPU_ARCH, wgmma_value_side.chain_config(new_state.shape[0], output))
    wy_prepass.run_compiled(launcher, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)


def run_as_kernel(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.py`'s dispatch with the direct key side on its WY paths (the candidate side)."""
    path = kernel.path_for(q.shape[0], new_state.shape[0])
    entry = run if path in (wy_prepass, wgmma_value_side) else path.run
    entry(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
