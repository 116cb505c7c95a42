"""GDN prefill candidate v1.7 ("longest first"): `kernel.py` with the chunked kernel's grid rows
serving the sequences in order of decreasing length.

Why: the chunked kernel's grid is (8 heads x 4 slices, N), and the hardware starts CTAs in the order
of their block index, so the 32 CTAs of sequence 0 start first and those of sequence N - 1 last. A
CTA's time is its sequence's chunk count times the chunk step. On the 8192-token inputs of 20-57
sequences (1024-1824 CTAs for 264 slots at two CTAs per SM), a long sequence that comes late in the
list starts in the last wave and runs its chain of chunks alone at the end. Serving the longest
sequences first (the LPT rule) leaves only short CTAs for the tail. A model of the dispatch
(kernels/gdn_prefill/NOTES.md, v1.7) follows the measured latencies of the 16 inputs of 8192 tokens
(correlation 0.83) and predicts 1.12-1.39x on them from the order alone.

How: every CTA ranks the sequences by length (ties by index: a strict order, so the ranks are a
permutation whatever `cu_seqlens` holds) and serves the one whose rank is its grid row:
rank(i) = #{j : L_j > L_i, or L_j = L_i and j < i}, one thread per sequence over lengths staged in
shared memory. Only from MIN_RANKED_SEQS to MAX_RANKED_SEQS sequences; otherwise the rows keep the
list order. Below, every CTA starts in the first wave and the order only decides which CTAs share an
SM (the model gives no gain there: 0.87x at 5 sequences); above, every CTA would pay O(N) per thread
for its ranking. The math of each CTA is `chunked.py`'s unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import cutlass
import cutlass.cute as cute

from . import chunked, kernel, token_serial
from .token_serial import GdnShapeError, resolve_scale

__all__ = ["GdnShapeError", "MAX_RANKED_SEQS", "MIN_RANKED_SEQS", "compile_only", "longest_first_order", "resolve_scale", "run"]

MAX_RANKED_SEQS = chunked.NUM_THREADS  # one sequence per thread
# More CTAs than two per SM of a 132-SM H200 (32 per sequence): the grid takes more than one wave.
MIN_RANKED_SEQS = 2 * 132 // (chunked.NUM_V_HEADS * chunked.NUM_SLICES) + 1  # 9
# The ranking's scratch: the lengths, then the selected sequence, in the fp32 diagonal blocks of A.
assert MAX_RANKED_SEQS + 1 <= chunked.CHUNK * chunked.BLOCK


def longest_first_order(lengths: Sequence[int]) -> list[int]:
    """The sequence each grid row serves, by the kernel's ranking rule (for tests and models)."""
    if not MIN_RANKED_SEQS <= len(lengths) <= MAX_RANKED_SEQS:
        return list(range(len(lengths)))
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


class _LongestFirst(chunked._Chunked):
    @cute.jit
    def sequence_of_block(
        self,
        cu_seqlens: cute.Tensor,
        block_y: cutlass.Int32,
        num_seqs: cutlass.Int32,
        tidx: cutlass.Int32,
        scratch: cute.Tensor,
    ) -> cutlass.Int32:
        seq = block_y
        if num_seqs >= MIN_RANKED_SEQS and num_seqs <= MAX_RANKED_SEQS:
            slots = cute.make_tensor(
                cute.recast_ptr(scratch.iterator, dtype=cutlass.Int32), cute.make_layout(MAX_RANKED_SEQS + 1)
            )
            selected = MAX_RANKED_SEQS  # the slot after the lengths
            my_length = cutlass.Int32(0)
            if tidx < num_seqs:
                my_length = cutlass.Int32(cu_seqlens[tidx + 1]) - cutlass.Int32(cu_seqlens[tidx])
                slots[tidx] = my_length
            if tidx == 0:
                slots[selected] = block_y  # stays the identity if no rank matched (cannot happen)
            cute.arch.sync_threads()
            if tidx < num_seqs:
                rank = cutlass.Int32(0)
                for j in cutlass.range(num_seqs, unroll=4):
                    other = slots[j]
                    if other > my_length or (other == my_length and j < tidx):
                        rank += 1
                if rank == block_y:
                    slots[selected] = tidx
            cute.arch.sync_threads()
            seq = slots[selected]
        return seq


def compile_only(arch: str = token_serial.GPU_ARCH) -> tuple[Callable, Callable]:
    """Compile the token-serial kernel and the candidate's chunked kernel for `arch` without a GPU."""
    return token_serial.compile_only(arch), chunked.compiled_for(arch, _LongestFirst)


def run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state) -> None:
    """`kernel.run`'s contract and dispatch, with this candidate's chunked kernel above the threshold."""
    if q.shape[0] <= kernel.TOKEN_SERIAL_MAX_TOKENS:
        token_serial.run(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
    else:
        chunked.run_kernel(_LongestFirst, q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, output, new_state)
