"""GDN prefill candidate v1.8 ("narrow slices"): `kernel.py` with its token-serial path splitting
each head's state into 16 slices of 8 rows (16 lanes per row) instead of 8 slices of 16 rows.

Why: on the short inputs with a state, Kachua's 16-token chunks beat our token steps (0.80x at
<= 40 tokens; ~0.17-0.19 us per token against its ~1.5 us per 16 tokens). The token loop of v0 is
~175 SASS instructions per token per warp (ptxas 12.8: 350 in the loop body unrolled by two), and
with one CTA of four warps per SM a warp issues at most one instruction per cycle: the loop is bound
by issue as much as by its dependency chain (~120 cycles: the state update, a 16-term dot product,
three shuffle levels, the scalar update; measured ~330 cycles per token).

With 16 lanes per row each thread holds 8 columns instead of 16: half the conversions, products and
state updates per token, one more shuffle level per reduction (four instead of three), and twice
the CTAs per (sequence, head) (16 x 8 heads = 128 for one sequence, one per SM, where v0 left half
of the SMs idle). Same math and rounding points as v0 (fp32 throughout); only the tiling changes.
"""

from __future__ import annotations

from typing import Callable

from . import chunked, token_serial
from .token_serial import GdnShapeError, resolve_scale

__all__ = ["GdnShapeError", "TOKEN_SERIAL_MAX_TOKENS", "compile_only", "resolve_scale", "run"]

# kernel.py switches to the chunked kernel above 40 tokens. The candidate keeps its token-serial path
# up to 64, so that the A/B rows of 41-64 tokens say where the threshold goes if it is promoted
# (at ~0.12 us per token it would tie the chunked kernel's ~8.5 us near 48 tokens).
TOKEN_SERIAL_MAX_TOKENS = 64


class _NarrowSlices(token_serial._Recurrence):
    SPLIT = token_serial.RowSplit(lanes_per_row=16)


def compile_only(arch: str = token_serial.GPU_ARCH) -> tuple[Callable, Callable]:
    """Compile the candidate's token-serial kernel and the chunked one for `arch` without a GPU."""
    return token_serial.compiled_for(arch, _NarrowSlices), chunked.compile_only(arch)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.run`'s contract and dispatch, with this candidate's token-serial kernel."""
    if q.shape[0] <= TOKEN_SERIAL_MAX_TOKENS:
        token_serial.run_kernel(_NarrowSlices, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
    else:
        chunked.run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
