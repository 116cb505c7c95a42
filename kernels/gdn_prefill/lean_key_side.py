"""GDN prefill candidate `cand_lean_key_side`: the WY path with its key side in ~53 KB of shared memory, four CTAs
per SM instead of three.

Why (NOTES.md, the WY path's next levers): above 4000 tokens the key side takes ~45 of ~100 us. ncu at 8192
tokens in 32 sequences: 1280 CTAs in 3.2 waves of three per SM (shared memory, 67 KB each), 0.49 eligible warps
per scheduler, 7.7 cycles per instruction. `wy_prepass._KeySide(t_in_kq=True)` keeps T and the inverse's
scratch (14 KB) in the storage of the fp16 k and q rows, dead once the Gram tiles are computed, and zeroes T
after their barrier (one more barrier): the same operations on the same values, so the workspace and every
output are the standard WY path's bit for bit (a GPU test); 2.4 waves of four CTAs per SM. The chains are
unchanged (kernel.py's for the batch).
"""

from __future__ import annotations

from typing import Callable

from . import kernel, token_serial, wgmma_value_side, wy_prepass
from .token_serial import GPU_ARCH, GdnShapeError, resolve_scale
from .wy_prepass import WyPrepassConfig, _KeySide

__all__ = ["GdnShapeError", "compile_only", "resolve_scale", "run", "run_as_kernel"]


class _LeanWy(wy_prepass.GdnPrefillWyPrepassSm90):
    """`wy_prepass.py`'s launcher (its chain at the configured width) with the lean key side."""

    def key_side(self):
        return _KeySide(t_in_kq=True)


class _LeanWgmma(wgmma_value_side.GdnPrefillWyWgmmaSm90):
    """`wgmma_value_side.py`'s launcher (its WGMMA chain) with the lean key side."""

    def key_side(self):
        return _KeySide(t_in_kq=True)


_COMPILED: dict[tuple[str, WyPrepassConfig | None], Callable] = {}


def compiled_for(arch: str, config: WyPrepassConfig | None) -> Callable:
    """The compiled launcher: the lean key side, then `wy_prepass.py`'s chain at `config`'s width, or the WGMMA
    chain for config None (compiled on first use; needs no GPU)."""
    key = (arch, config)
    fn = _COMPILED.get(key)
    if fn is None:
        launcher = _LeanWgmma() if config is None else _LeanWy(config)
        align = wgmma_value_side.OUTPUT_ALIGN if config is None else 2
        fn = _COMPILED[key] = token_serial.compile_launcher(
            launcher, arch, wy_prepass._workspace_stand_ins(), output_align=align
        )
    return fn


def compile_only(arch: str = GPU_ARCH) -> tuple[Callable, ...]:
    return tuple(compiled_for(arch, config) for config in (*wy_prepass.CONFIGS, None))


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """The WY path at any T (`wy_prepass.run`'s contract) with the lean key side and kernel.py's chain."""
    token_serial.check_inputs(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, output, new_state)
    launcher = compiled_for(GPU_ARCH, kernel.wy_chain_config(new_state.shape[0], output))
    wy_prepass.run_compiled(launcher, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)


def run_as_kernel(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.py`'s dispatch with the lean key side on its WY paths (the candidate side)."""
    path = kernel.path_for(q.shape[0], new_state.shape[0])
    entry = run if path in (wy_prepass, wgmma_value_side) else path.run
    entry(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
