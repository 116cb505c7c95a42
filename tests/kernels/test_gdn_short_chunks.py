"""kernels/gdn_prefill/short_chunks.py (candidates `cand_short_chunks`, `cand_short_tail`): `chunked.py`'s form on
16-token chunks, for whole short sequences or a sequence's last <= 16 tokens. It compiles for sm_90a without a GPU and
each candidate takes only its rows: the token-serial path's of >= 16 tokens in <= 2 sequences, the chunked path's
(CPU). On the GPU its outputs and states agree with kernel.py's, which chunks differently, to the accuracy of the
chunked form, and its tails equal the chunked path's bit for bit. Checks against the reference: `run` in
test_gdn_prefill_kernel.py (every module of `KERNEL_CHOICES`), `run_tail` here."""

from __future__ import annotations

import zlib

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT
from hopperbench.workloads import load_workloads
from tests.kernels.compile_checks import assert_compiles_and_caches

cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
device_check = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/probes/device_check_gdn.py", "device_check_gdn")
short_chunks = device_check.load_kernel_module("short_chunks")
kernel = short_chunks.kernel

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Relative L2 distance allowed from kernel.py's results: both round every tensor-core operand to fp16 (each within
# ~2e-3 of the exact recurrence on these lengths), at different chunk boundaries; a wrong index or phase is O(1).
CLOSE_RELATIVE_L2 = 5e-3


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(short_chunks.compile_only, 4)


def _relative_l2(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    difference = (ours.float() - theirs.float()).norm()
    return (difference / theirs.float().norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("one_token", (1,), True, 0.0, "mamba2"),
        cases.CheckCase("one_chunk_and_one", (17,), True, 0.1, "mamba2"),
        cases.CheckCase("two_of_twenty", (20, 20), True, 0.0, "slow_decay"),
        cases.CheckCase("empty_among_short", (0, 33, 16, 7), False, 0.0, "fast_decay"),
        cases.CheckCase("one_of_67", (67,), True, 0.0, "mamba2"),
        cases.CheckCase("three_of_hundreds", (200, 130, 61), True, 0.0, "slow_decay"),
    ],
    ids=lambda case: case.name,
)
def test_outputs_and_states_agree_with_kernel(case):
    results = cases.outputs_of_runs(case, [kernel.run, short_chunks.run], "cuda", seed=73)
    for output, new_state in results:
        assert torch.isfinite(output).all() and torch.isfinite(new_state).all()
    (out_kernel, state_kernel), (out_short, state_short) = results
    assert _relative_l2(out_short, out_kernel) <= CLOSE_RELATIVE_L2
    assert _relative_l2(state_short, state_kernel) <= CLOSE_RELATIVE_L2


def test_the_candidate_takes_only_short_rows_in_one_or_two_sequences(monkeypatch):
    called = []
    monkeypatch.setattr(short_chunks, "run", lambda *args: called.append("short_chunks"))
    for path in (kernel.token_serial, kernel.chunked, kernel.wy_prepass, kernel.wgmma_value_side,
                 kernel.context_parallel):  # fmt: skip
        monkeypatch.setattr(path, "run", lambda *args, name=path.__name__.rsplit(".", 1)[-1]: called.append(name))

    def call(num_tokens: int, num_seqs: int) -> None:
        q = torch.empty(num_tokens, 4, 128, device="meta")
        new_state = torch.empty(num_seqs, 8, 128, 128, device="meta")
        short_chunks.run_as_kernel(q, *[None] * 10, new_state)

    shapes = ((16, 1), (40, 2), (28, 2), (15, 1), (40, 3), (41, 2), (300, 4), (8192, 32), (1377, 1), (8192, 1))
    for num_tokens, num_seqs in shapes:
        call(num_tokens, num_seqs)
    assert called == [
        "short_chunks", "short_chunks", "short_chunks", "token_serial", "token_serial", "chunked", "chunked",
        "wgmma_value_side", "wy_prepass", "context_parallel",
    ]  # fmt: skip
    # Every official row it takes: 17 of the 21 of <= 40 tokens (those of 16 tokens or more; all in <= 2 sequences).
    rows = [(w.axes["total_seq_len"], w.axes["num_seqs"]) for w in load_workloads("gdn_prefill")]
    taken = [row for row in rows if short_chunks.takes_short_chunks(*row)]
    assert len(taken) == 17 and all(16 <= t <= 40 for t, _ in taken)


TAIL_CASES = [
    cases.CheckCase("one_token", (1,), True, 0.0, "mamba2"),
    cases.CheckCase("one_short_chunk", (16,), True, 0.0, "slow_decay"),
    cases.CheckCase("tail_of_1", (65,), True, 0.0, "mamba2"),
    cases.CheckCase("tail_of_3", (67,), True, 0.0, "mamba2"),
    cases.CheckCase("tail_of_15", (79,), True, 0.05, "mamba2"),
    cases.CheckCase("tail_of_16_and_17", (80, 81), True, 0.0, "slow_decay"),
    cases.CheckCase("two_full_and_6", (134,), True, 0.0, "mamba2"),
    cases.CheckCase("short_only_and_empty", (10, 0, 76, 3), False, 0.0, "fast_decay"),
    cases.CheckCase("three_with_tails", (200, 130, 61), True, 0.0, "slow_decay"),
    # more CTAs than SMs: grid rows ranked by length
    cases.CheckCase("six_ranked_with_tails", (70, 65, 80, 129, 200, 66), True, 0.0, "mamba2"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", TAIL_CASES, ids=lambda case: case.name)
def test_short_tails_equal_the_chunked_path_bit_for_bit(case):
    # A tail chunk holds the 64-token chunk's operands with zero rows and gates past the end, which add exact zeros.
    assert cases.bitwise_mismatch(case, [kernel.chunked.run, short_chunks.run_tail], "cuda", seed=79) is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", [c for c in cases.CASES if not c.long], ids=lambda c: c.name)
def test_short_tail_matches_reference(case):
    inputs = cases.make_inputs(case, "cuda", seed=zlib.crc32(case.name.encode()) % 1000)
    output, new_state = cases.poisoned_outputs(case, "cuda")
    short_chunks.run_tail(*inputs.values(), output, new_state)
    verdict = cases.compare(output, new_state, *cases.load_reference_run()(*inputs.values()))
    assert verdict.passed, verdict


def test_the_tail_candidate_takes_only_the_chunked_rows(monkeypatch):
    called = []
    monkeypatch.setattr(short_chunks, "run_tail", lambda *args: called.append("run_tail"))
    for path in (kernel.token_serial, kernel.wy_prepass, kernel.wgmma_value_side, kernel.context_parallel):
        monkeypatch.setattr(path, "run", lambda *args, name=path.__name__.rsplit(".", 1)[-1]: called.append(name))
    for num_tokens, num_seqs in ((40, 2), (67, 1), (300, 4), (8192, 32), (1377, 1), (8192, 1)):
        q = torch.empty(num_tokens, 4, 128, device="meta")
        short_chunks.run_tail_as_kernel(q, *[None] * 10, torch.empty(num_seqs, 8, 128, 128, device="meta"))
    assert called == ["token_serial", "run_tail", "run_tail", "wgmma_value_side", "wy_prepass", "context_parallel"]
    assert short_chunks.tail_kernel_for(2).slice_rows == 16 and short_chunks.tail_kernel_for(3).slice_rows == 32
