"""GDN candidate v2.2 (kernels/gdn_prefill/candidate_narrow_chunked.py): `chunked.py`'s kernel on 16-row V slices
where `kernel.py` takes the chunked path for at most four sequences.

CPU: the dispatch (which inputs get the narrow kernel, which `kernel.run`); it compiles for sm_90a. GPU (marked
`gpu`): the narrow kernel's output and new state equal `chunked.py`'s bit for bit (each value sees the same
operations in the same order; the slice only selects which V rows a CTA computes) on fresh inputs with and without
a state, one to four sequences, lengths off the chunk size, and beyond the dispatch's range (many sequences, long
ones); the contest-rule checks of every check case are test_gdn_prefill_kernel.py's (the candidate is in its
SOLUTIONS), the CUDA-graph replay with new bounds included.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hopperbench.devcheck import load_folder_module, load_module_by_path
from hopperbench.paths import REPO_ROOT

candidate = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "candidate_narrow_chunked")
chunked = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "chunked")
cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("num_tokens", "num_seqs", "narrow"),
    [(40, 1, False), (41, 1, True), (159, 1, True), (160, 1, False), (300, 3, True), (401, 4, True),
     (401, 5, False), (511, 8, False), (512, 2, False)],
)  # fmt: skip
def test_narrow_kernel_only_where_kernel_py_takes_chunked_for_few_sequences(num_tokens, num_seqs, narrow, monkeypatch):
    calls = []
    monkeypatch.setattr(candidate.chunked, "run_kernel", lambda kernel, *args: calls.append(kernel.__name__))
    monkeypatch.setattr(candidate.kernel, "run", lambda *args: calls.append("kernel.run"))
    candidate.run(torch.empty(num_tokens, 4, 128), *([None] * 10), torch.empty(num_seqs, 8, 128, 128))
    assert calls == (["_NarrowChunked"] if narrow else ["kernel.run"])


def test_narrow_kernel_is_chunked_py_on_16_rows():
    assert candidate._NarrowChunked.slice_rows == 16 and candidate._NarrowChunked().num_slices == 8
    assert chunked._Chunked.slice_rows == 32


def test_compiles_for_sm90a_without_gpu():
    compiled = candidate.compile_only("sm_90a")
    assert len(compiled) == 5 and all(callable(fn) for fn in compiled)
    assert candidate.compile_only("sm_90a") == compiled  # cached


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("one_sequence_off_chunk", (397,), True, 0.0, "mamba2"),
        cases.CheckCase("four_with_empty", (0, 141, 64, 130), False, 0.0, "mamba2"),
        cases.CheckCase("state_and_scale", (200, 77, 3), True, 0.1, "fast_decay"),
        cases.CheckCase("many_and_long", (0, 41, 64, 0, 129, 3, 300, 65, 1377), True, 0.0, "mamba2"),
    ],
    ids=lambda case: case.name,
)
def test_outputs_and_states_are_chunked_py_bit_for_bit(case):
    narrow = functools.partial(chunked.run_kernel, candidate._NarrowChunked)
    assert cases.bitwise_mismatch(case, [chunked.run, narrow], "cuda", seed=53) is None
