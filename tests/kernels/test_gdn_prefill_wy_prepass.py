"""GDN's WY-prepass path (kernels/gdn_prefill/wy_prepass.py, kernel.py's from three sequences above a mean length
of 500, with the lean key side): a prepass kernel computes each chunk's state-free half (gates, P, T) into a workspace,
and the chain of chunks, on 16- or 32-row V slices, reads it.

CPU: the workspace slots of every chunk of every sequence are distinct and within the allocation, and the
prepass's rule for finding a slot's (sequence, chunk) (the last sequence whose first slot is at or below it)
inverts them, for random splits with empty sequences; the chain's width rule; both configurations compile for
sm_90a. GPU (marked `gpu`): in both configurations (16- and 32-row chain slices) the output and new state equal
`chunked.py`'s 32-row kernel's bit for bit (the same operations and roundings in other kernels), on fresh
inputs with and without a state, one and many sequences, lengths off the chunk size; the contest-rule checks of
every check case are test_gdn_prefill_kernel.py's (the path is in its SOLUTIONS), the CUDA-graph replay with new
bounds included.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from hopperbench.devcheck import load_folder_module, load_module_by_path
from hopperbench.paths import REPO_ROOT
from tests.kernels.compile_checks import assert_compiles_and_caches

wy_prepass = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "wy_prepass")
chunked = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "chunked")
cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CHUNK = wy_prepass.CHUNK


def _sequence_of_slot(starts: list[int], slot: int) -> int:
    """The prepass's search, in Python: the last sequence whose first slot is <= `slot` (0 if none)."""
    found = 0
    for seq, start in enumerate(starts):
        if wy_prepass.chunk_slot(start, 0, seq) <= slot:
            found = seq
    return found


@pytest.mark.parametrize("seed", range(6))
def test_chunk_slots_are_distinct_in_bounds_and_found_again(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([0, 0, 1, 63, 64, 65, 127, 128, 200, rng.randrange(1, 700)]) for _ in range(rng.randrange(1, 40))]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    total = sum(lengths)
    slots = wy_prepass.num_chunk_slots(total, len(lengths))
    owner = {}
    for seq, (start, length) in enumerate(zip(starts, lengths)):
        for chunk in range(-(-length // CHUNK)):
            slot = wy_prepass.chunk_slot(start, chunk, seq)
            assert 0 <= slot < slots
            assert slot not in owner, f"slot {slot} of ({seq}, {chunk}) is also {owner[slot]}'s"
            owner[slot] = (seq, chunk)
    for slot in range(slots):
        seq = _sequence_of_slot(starts, slot)
        chunk = slot - wy_prepass.chunk_slot(starts[seq], 0, seq)
        is_chunk = 0 <= chunk and chunk * CHUNK < lengths[seq]
        assert is_chunk == (slot in owner)
        if is_chunk:
            assert owner[slot] == (seq, chunk)


@pytest.mark.parametrize(("num_seqs", "rows"), [(1, 16), (4, 16), (5, 32), (57, 32)])
def test_chain_width_is_chosen_from_the_sequence_count(num_seqs, rows, monkeypatch):
    # Narrow up to four sequences, where its 64 CTAs per sequence fit one wave of two per SM (NOTES.md).
    assert wy_prepass.NARROW_MAX_SEQS == 4
    configs = []
    monkeypatch.setattr(wy_prepass, "run_with_config", lambda config, *args: configs.append(config))
    wy_prepass.run(*([None] * 11), torch.empty(num_seqs, 8, 128, 128))
    assert configs == [wy_prepass.WyPrepassConfig(rows)]
    assert configs[0] in wy_prepass.CONFIGS  # compiled by compile_only


def test_compiles_every_config_for_sm90a_without_gpu():
    assert_compiles_and_caches(wy_prepass.compile_only, 2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("one_sequence_off_chunk", (1377,), True, 0.0, "mamba2"),
        cases.CheckCase("many_with_empty", (0, 41, 64, 0, 129, 3, 300, 65), False, 0.0, "mamba2"),
        cases.CheckCase("state_and_scale", (200, 77, 512), True, 0.1, "mamba2"),
        cases.CheckCase("short_below_the_threshold", (5, 70, 0, 33), True, 0.0, "fast_decay"),
        # every chunk slow: this key side is unpaired (plane 0 is chunked.py's T), accurate_inverse.py
        cases.CheckCase("slow_chunks", (300, 1377), True, 0.0, "slow_decay"),
    ],
    ids=lambda case: case.name,
)
@pytest.mark.parametrize("config", wy_prepass.CONFIGS, ids=str)
def test_outputs_and_states_are_chunked_py_bit_for_bit(case, config):
    wide_chunked = functools.partial(chunked.run_kernel, chunked._Chunked)
    two_kernels = functools.partial(wy_prepass.run_with_config, config)
    assert cases.bitwise_mismatch(case, [wide_chunked, two_kernels], "cuda", seed=47) is None

