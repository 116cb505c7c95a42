"""kernels/gdn_prefill/context_parallel.py (candidate `cand_context_parallel`): the WY path with long sequences
split into segments, summarised, scanned and re-walked from their scanned states.

CPU: it compiles for sm_90a at both chain widths and caches; the segment length rule. GPU (marked `gpu`): the
contest rule against the reference with segments short enough that sequences split at chunk and partial-chunk
edges, around empty sequences, with and without a state and with decays near 1 (the default length's cases are
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
reference_run = cases.load_reference_run()
CHUNK = context_parallel.CHUNK


def test_compiles_both_chain_widths_for_sm90a_without_gpu():
    assert_compiles_and_caches(context_parallel.compile_only, 2)


@pytest.mark.parametrize(("num_tokens", "num_seqs"), [(1, 1), (1377, 1), (5709, 2), (8192, 1), (65536, 1), (6600, 41)])
def test_segment_length_is_whole_chunks_and_splits_long_sequences(num_tokens, num_seqs):
    tokens = context_parallel.segment_tokens_for(num_tokens, num_seqs)
    assert tokens % CHUNK == 0 and tokens >= 4 * CHUNK
    assert tokens <= max(4 * CHUNK, num_tokens // 2)  # a sequence holding every token would be split


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
