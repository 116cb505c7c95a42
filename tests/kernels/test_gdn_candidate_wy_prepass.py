"""GDN candidates v4.0 (kernels/gdn_prefill/candidate_wy_prepass.py) and v4.1 (candidate_wy_prepass_narrow.py, the
same on 16-row V slices): a prepass kernel computes each chunk's state-free half (gates, P, T) into a workspace,
and the chain of chunks reads it.

CPU: the workspace slots of every chunk of every sequence are distinct and within the allocation, and the
prepass's rule for finding a slot's (sequence, chunk) (the last sequence whose first slot is at or below it)
inverts them, for random splits with empty sequences; the candidate compiles for sm_90a. GPU (marked `gpu`):
`run_two_kernels`' output and new state equal `chunked.py`'s bit for bit (the same operations and roundings in another
kernel), on fresh inputs with and without a state, one and many sequences, lengths off the chunk size; the
contest-rule checks of every check case are test_gdn_prefill_kernel.py's (the candidate is in its
SOLUTIONS), the CUDA-graph replay with new bounds included.
"""

from __future__ import annotations

import random

import pytest
import torch

from hopperbench.devcheck import load_folder_module, load_module_by_path
from hopperbench.paths import REPO_ROOT

candidate = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "candidate_wy_prepass")
narrow = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "candidate_wy_prepass_narrow")
chunked = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "chunked")
cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CHUNK = candidate.CHUNK


def _sequence_of_slot(starts: list[int], slot: int) -> int:
    """The prepass's search, in Python: the last sequence whose first slot is <= `slot` (0 if none)."""
    found = 0
    for seq, start in enumerate(starts):
        if candidate.chunk_slot(start, 0, seq) <= slot:
            found = seq
    return found


@pytest.mark.parametrize("seed", range(6))
def test_chunk_slots_are_distinct_in_bounds_and_found_again(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([0, 0, 1, 63, 64, 65, 127, 128, 200, rng.randrange(1, 700)]) for _ in range(rng.randrange(1, 40))]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    total = sum(lengths)
    slots = candidate.num_chunk_slots(total, len(lengths))
    owner = {}
    for seq, (start, length) in enumerate(zip(starts, lengths)):
        for chunk in range(-(-length // CHUNK)):
            slot = candidate.chunk_slot(start, chunk, seq)
            assert 0 <= slot < slots
            assert slot not in owner, f"slot {slot} of ({seq}, {chunk}) is also {owner[slot]}'s"
            owner[slot] = (seq, chunk)
    for slot in range(slots):
        seq = _sequence_of_slot(starts, slot)
        chunk = slot - candidate.chunk_slot(starts[seq], 0, seq)
        is_chunk = 0 <= chunk and chunk * CHUNK < lengths[seq]
        assert is_chunk == (slot in owner)
        if is_chunk:
            assert owner[slot] == (seq, chunk)


def test_below_the_threshold_it_is_kernel_py(monkeypatch):
    calls = []
    monkeypatch.setattr(candidate.kernel, "run", lambda *args: calls.append("kernel"))
    monkeypatch.setattr(candidate, "two_kernels_with_slices", lambda *args: calls.append("two"))
    for num_tokens in (1, 41, candidate.V4_MIN_TOKENS - 1, candidate.V4_MIN_TOKENS, 8192):
        candidate.run(torch.empty(num_tokens, 4, 128), *([None] * 11))
    assert calls == ["kernel", "kernel", "kernel", "two", "two"]


def test_narrow_entry_is_v4_with_16_row_slices(monkeypatch):
    calls = []
    monkeypatch.setattr(candidate.kernel, "run", lambda *args: calls.append(("kernel", len(args))))
    monkeypatch.setattr(candidate, "compiled_for", lambda arch, rows: calls.append(("two", rows)) or (lambda *a: None))
    monkeypatch.setattr(candidate.token_serial, "check_inputs", lambda *args: None)
    for num_tokens in (41, candidate.V4_MIN_TOKENS):
        state = torch.empty(2, 8, 128, 128)
        narrow.run(torch.empty(num_tokens, 4, 128), *([None] * 10), state)
    narrow.run_two_kernels(torch.empty(41, 4, 128), *([None] * 10), torch.empty(2, 8, 128, 128))
    assert calls == [("kernel", 12), ("two", 16), ("two", 16)]


@pytest.mark.parametrize("module", [candidate, narrow], ids=["v4.0", "v4.1_narrow"])
def test_compiles_for_sm90a_without_gpu(module):
    compiled = module.compile_only("sm_90a")
    assert len(compiled) == 2 and all(callable(fn) for fn in compiled)
    assert module.compile_only("sm_90a") == compiled  # cached


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("one_sequence_off_chunk", (1377,), True, 0.0, "mamba2"),
        cases.CheckCase("many_with_empty", (0, 41, 64, 0, 129, 3, 300, 65), False, 0.0, "mamba2"),
        cases.CheckCase("state_and_scale", (200, 77, 512), True, 0.1, "mamba2"),
        cases.CheckCase("short_below_the_threshold", (5, 70, 0, 33), True, 0.0, "fast_decay"),
    ],
    ids=lambda case: case.name,
)
@pytest.mark.parametrize("module", [candidate, narrow], ids=["v4.0", "v4.1_narrow"])
def test_outputs_and_states_are_chunked_py_bit_for_bit(case, module):
    inputs = cases.make_inputs(case, "cuda", seed=47)
    results = []
    for run in (chunked.run, module.run_two_kernels):
        output, new_state = cases.poisoned_outputs(case, "cuda")
        run(*inputs.values(), output, new_state)
        torch.cuda.synchronize()
        results.append((output, new_state))
    (out0, state0), (out1, state1) = results
    assert torch.isfinite(out0).all() and torch.isfinite(state0).all()
    assert torch.equal(out0, out1), "output"
    assert torch.equal(state0, state1), "new_state"
