"""GDN's WY-prepass path (kernels/gdn_prefill/wy_prepass.py, kernel.py's from 512 tokens or a mean length of 160;
candidates v4.0 and v4.1): a prepass kernel computes each chunk's state-free half (gates, P, T) into a workspace,
and the chain of chunks, on 16- or 32-row V slices, reads it.

CPU: the workspace slots of every chunk of every sequence are distinct and within the allocation, and the
prepass's rule for finding a slot's (sequence, chunk) (the last sequence whose first slot is at or below it)
inverts them, for random splits with empty sequences; the chain's width rule; every configuration compiles for
sm_90a; candidate v4.2 (candidate_lean_prepass.py) takes its lean key side exactly where kernel.py takes this
path. GPU (marked `gpu`): in every configuration (both widths, with and without v4.2's lean key side) the output
and new state equal `chunked.py`'s bit for bit (the same operations and roundings in other kernels), on fresh
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
    # Narrow up to four sequences, where its 64 CTAs per sequence fit one wave of two per SM (session 13's A/B).
    assert wy_prepass.NARROW_MAX_SEQS == 4
    configs = []
    monkeypatch.setattr(wy_prepass, "run_with_config", lambda config, *args: configs.append(config))
    wy_prepass.run(*([None] * 11), torch.empty(num_seqs, 8, 128, 128))
    assert configs == [wy_prepass.WyPrepassConfig(rows)]
    assert configs[0] in wy_prepass.CONFIGS  # compiled by compile_only


# Every configuration the path runs, and candidate v4.2's lean key side at both widths.
ALL_CONFIGS = [*wy_prepass.CONFIGS, *(wy_prepass.WyPrepassConfig(c.slice_rows, True) for c in wy_prepass.CONFIGS)]


def test_compiles_every_config_for_sm90a_without_gpu():
    compiled = wy_prepass.compile_only("sm_90a")
    assert len(compiled) == 2 and all(callable(fn) for fn in compiled) and compiled[0] is not compiled[1]
    assert wy_prepass.compile_only("sm_90a") == compiled  # cached
    lean = [wy_prepass.compiled_for("sm_90a", config) for config in ALL_CONFIGS[2:]]
    assert all(callable(fn) for fn in lean) and not set(lean) & set(compiled)


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
@pytest.mark.parametrize("config", ALL_CONFIGS, ids=str)
def test_outputs_and_states_are_chunked_py_bit_for_bit(case, config):
    two_kernels = functools.partial(wy_prepass.run_with_config, config)
    assert cases.bitwise_mismatch(case, [chunked.run, two_kernels], "cuda", seed=47) is None


lean_candidate = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "candidate_lean_prepass")


@pytest.mark.parametrize(("num_tokens", "num_seqs", "lean"), [(41, 1, None), (511, 8, None), (341, 2, 16), (512, 57, 32)])
def test_lean_candidate_runs_the_lean_key_side_exactly_where_kernel_py_takes_the_wy_prepass_path(
    num_tokens, num_seqs, lean, monkeypatch
):
    calls = []
    monkeypatch.setattr(wy_prepass, "run_with_config", lambda config, *args: calls.append(config))
    monkeypatch.setattr(lean_candidate.kernel, "run", lambda *args: calls.append("kernel.run"))
    lean_candidate.run(torch.empty(num_tokens, 4, 128), *([None] * 10), torch.empty(num_seqs, 8, 128, 128))
    assert calls == (["kernel.run"] if lean is None else [wy_prepass.WyPrepassConfig(lean, lean_prepass=True)])
