"""kernels/gdn_prefill/context_parallel.py (kernel.py's path for one long sequence): the WY path with long
sequences split into segments, summarised, scanned and re-walked from their scanned states.

CPU: it compiles for sm_90a with each chain and caches; the segment length rule; the chain for a segment count;
the slot kernel's rule (on Python ints) against cp_model's work list. GPU (marked `gpu`): the contest rule
against the reference with segments short enough that sequences split at chunk and partial-chunk edges, around
empty sequences, with and without a state and with decays near 1 (the default length's cases are
test_gdn_prefill_kernel.py's: the module is in its SOLUTIONS).
"""

from __future__ import annotations

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT
from tests.kernels.compile_checks import assert_compiles_and_caches

cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
device_check = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/probes/device_check_gdn.py", "device_check_gdn")
context_parallel = device_check.load_kernel_module("context_parallel")
cp_model = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/cp_model.py", "gdn_cp_model")
reference_run = cases.load_reference_run()
CHUNK = context_parallel.CHUNK


def test_compiles_with_every_chain_for_sm90a_without_gpu():
    assert_compiles_and_caches(context_parallel.compile_only, 3)


@pytest.mark.parametrize(
    ("num_tokens", "segment_tokens"), [(1, 64), (1377, 64), (8192, 512), (20000, 1216), (32768, 2048), (65536, 4096)]
)
def test_segment_length_is_whole_chunks_cutting_the_call_in_16_to_31_segments(num_tokens, segment_tokens):
    """One sequence of 8K / 32K / 64K tokens in 16 segments (FlashInfer's SM90 split on H200 too), 17 at 20000."""
    assert context_parallel.segment_tokens_for(num_tokens) == segment_tokens
    if num_tokens >= context_parallel.CP_SEGMENTS * CHUNK:
        segments = cp_model.segment_count(num_tokens, segment_tokens, 2 * segment_tokens)
        assert context_parallel.CP_SEGMENTS <= segments < 2 * context_parallel.CP_SEGMENTS


@pytest.mark.parametrize(("num_segments", "wgmma"), [(1, False), (4, False), (14, False), (15, True), (57, True)])
def test_the_segments_chain_is_the_wy_paths_for_that_many_sequences(num_segments, wgmma):
    wgmma_value_side, wy_prepass = context_parallel.wgmma_value_side, context_parallel.wy_prepass
    output = torch.empty(16, dtype=torch.bfloat16)
    config = wgmma_value_side.chain_config(num_segments, output)
    assert config == (None if wgmma else wy_prepass.config_for(num_segments))
    assert (num_segments >= wgmma_value_side.WGMMA_CHAIN_MIN_SEQS) == wgmma
    # An output off a 16-B boundary takes wy_prepass.py's chain, as wgmma_value_side.run does.
    assert wgmma_value_side.chain_config(num_segments, output[1:]) == wy_prepass.config_for(num_segments)


def _slot_bounds(bounds: list[int], total_tokens: int, segment_tokens: int) -> tuple[list[int], list[int]]:
    """`_SegmentBounds`' per-slot rule, on Python ints: slot i's first token, or the end of the sequence found
    by the search for a slot with no segment (its start before its first slot); then the last end. And per slot
    1 if the scan reads its summary (a segment of its sequence other than the last), else 0."""
    num_seqs = len(bounds) - 1
    clamp = [min(max(b, 0), total_tokens) for b in bounds]
    ends = [max(clamp[s + 1], clamp[s]) for s in range(num_seqs)]
    num_slots = cp_model.segment_bound(num_seqs, total_tokens, segment_tokens)
    firsts = [cp_model.segment_bound(s, clamp[s], segment_tokens) for s in range(num_seqs)]
    seg_cu, summarized = [], []
    for slot in range(num_slots):
        seq = max(s for s in range(num_seqs) if firsts[s] <= slot) if firsts[0] <= slot else 0
        count = cp_model.segment_count(ends[seq] - clamp[seq], segment_tokens, 2 * segment_tokens)
        index = slot - firsts[seq]
        seg_cu.append(clamp[seq] + max(index, 0) * segment_tokens if index < count else ends[seq])
        summarized.append(int(0 <= index < count - 1))
    return seg_cu + [ends[-1]], summarized


@pytest.mark.parametrize(
    ("lengths", "segment_tokens"),
    [((134,), 64), ((300, 0, 129, 5, 640, 0), 64), ((0, 0, 700), 128), ((64,) * 9, 64), (cases.MANY_130, 64)],
)
def test_slot_bounds_make_every_segment_a_sequence_of_the_virtual_batch(lengths, segment_tokens):
    """The virtual batch's bounds are non-decreasing; each segment of cp_model's work list is the sequence of
    its slot, every other slot is empty, and each sequence's last segment is at first slot + count - 1 (where
    `_FinalStates` reads it). Exactly the segments the scan reads (every one of a sequence but its last) are
    summarized."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    total = bounds[-1]
    seg_cu, summarized = _slot_bounds(bounds, total, segment_tokens)
    assert all(x <= y for x, y in zip(seg_cu, seg_cu[1:])) and seg_cu[-1] == total
    segments = {seg.slot: seg for seg in cp_model.work_list(bounds, total, segment_tokens)}
    for slot in range(len(seg_cu) - 1):
        seg = segments.get(slot)
        assert (seg_cu[slot], seg_cu[slot + 1]) == ((seg.start, seg.end) if seg else (seg_cu[slot], seg_cu[slot]))
        assert summarized[slot] == int(seg is not None and not seg.is_last)
    for seq, n in enumerate(lengths):
        count = cp_model.segment_count(n, segment_tokens, 2 * segment_tokens)
        if count:
            last = segments[cp_model.segment_bound(seq, bounds[seq], segment_tokens) + count - 1]
            assert (last.seq, last.end) == (seq, bounds[seq + 1])
    assert sum(summarized) == sum(max(cp_model.segment_count(n, segment_tokens, 2 * segment_tokens) - 1, 0) for n in lengths)


SPLIT_CASES = (
    # (case, segment tokens): splits at 64-token segments (134 = 64 + 64 + 6), around empty sequences, of one
    # long sequence among short ones with decays near 1 (its state must survive every segment), without a state.
    (cases.CheckCase("len134_state", (134,), True, 0.0, "mamba2"), 64),
    (cases.CheckCase("mixed_empty_state", (300, 0, 129, 5, 640, 0), True, 0.05, "mamba2"), 64),
    (cases.CheckCase("mixed_empty_nostate_fast", (300, 0, 129, 5, 640, 0), False, 0.0, "fast_decay"), 128),
    (cases.CheckCase("long_plus_short_slow", cases.LONG_PLUS_SHORT, True, 0.05, "slow_decay"), 256),
    (cases.CheckCase("long4096_slow", (4096,), True, 0.0, "slow_decay"), 192),
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("case", "segment_tokens"), SPLIT_CASES, ids=lambda x: getattr(x, "name", str(x)))
def test_split_sequences_match_reference(case, segment_tokens):
    inputs = cases.make_inputs(case, "cuda", seed=len(case.lengths) + segment_tokens)
    state_before = None if inputs["state"] is None else inputs["state"].clone()
    output, new_state = cases.poisoned_outputs(case, "cuda")
    context_parallel.run(*inputs.values(), output, new_state, segment_tokens=segment_tokens)
    result = cases.compare(output, new_state, *reference_run(*inputs.values()))
    assert result.passed, result
    if state_before is not None:
        assert torch.equal(inputs["state"], state_before), "run modified its input state"


def test_run_rejects_a_segment_length_off_the_chunk_grid():
    case = cases.CheckCase("len134_state", (134,), True, 0.0, "mamba2")
    inputs = cases.make_inputs(case, "cpu")
    output, new_state = cases.poisoned_outputs(case, "cpu")
    with pytest.raises(context_parallel.GdnShapeError, match="multiple of 64"):
        context_parallel.run(*inputs.values(), output, new_state, segment_tokens=100)
