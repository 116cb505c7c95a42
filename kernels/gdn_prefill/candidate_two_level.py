"""GDN prefill candidate v2.0 ("two-level"): `kernel.py` with `two_level.py` (the prepass over every
chunk at once, then the short sequential state pass) where it takes the chunked kernel, above
`kernel.TOKEN_SERIAL_MAX_TOKENS` tokens.

Why and the prediction: NOTES.md, "Design v2: the kernel plan" and "Candidate v2.0". The chunk step
on the sequential path drops from seven barrier-separated phases (~4.5-5.5 us) to three (predicted
~1-1.5 us), for one more launch, a prepass of 32 CTAs per chunk slot and the workspaces' traffic:
1377 tokens in one sequence ~122 -> ~45 us, 8192 tokens in 20-57 sequences ~150-245 -> ~100-120 us
(the prepass ~60-90 us of it); one-chunk sequences gain nothing and pay the extra launch (the
41-134-token rows say how much).
"""

from __future__ import annotations

from typing import Callable

from . import chunked, kernel, token_serial, two_level
from .token_serial import GdnShapeError, resolve_scale

__all__ = ["GdnShapeError", "compile_only", "path_for", "resolve_scale", "run"]


def compile_only(arch: str = token_serial.GPU_ARCH) -> tuple[Callable, Callable, Callable]:
    """Compile the token-serial kernel, both passes of the two-level form and the chunked kernel
    (beyond the slots) for `arch` without a GPU."""
    return token_serial.compile_only(arch), two_level.compile_only(arch), chunked.compile_only(arch)


def path_for(num_tokens: int, num_seqs: int):
    """The module whose `run` serves the batch: `kernel.py`'s threshold, the two-level form above it
    while its chunk slots fit 32-bit workspace offsets (~2M tokens), the chunked kernel beyond."""
    if num_tokens <= kernel.TOKEN_SERIAL_MAX_TOKENS:
        return token_serial
    return two_level if two_level.num_slots(num_tokens, num_seqs) <= two_level.MAX_SLOTS else chunked


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.run`'s contract, with the two-level form above the token-serial threshold."""
    path_for(q.shape[0], new_state.shape[0]).run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
