"""GDN design v2, `kernels/gdn_prefill/two_level.py`: the prepass and the state pass.

CPU: both launchers compile for sm_90a; the kernels' chunk-slot search, transcribed step by step
(per-thread ranges of sequences, a warp-shuffle inclusive scan, per-warp offsets, the walk of the
owning thread), against `chunked_model.chunk_slots`; the candidate's dispatch.
GPU (marked `gpu`): the prepass's workspaces against `chunked_model.prepass`, slot by slot, so that
a failing end-to-end case (test_gdn_prefill_kernel.py runs every check case on `two_level` and on
`candidate_two_level`) says whether the prepass or the state pass is wrong.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from hopperbench.devcheck import load_folder_module, load_module_by_path
from hopperbench.paths import REPO_ROOT

cases = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/check_cases.py", "gdn_check_cases")
model = load_module_by_path(REPO_ROOT / "kernels/gdn_prefill/chunked_model.py", "gdn_chunked_model")
two_level = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "two_level")
candidate = load_folder_module(REPO_ROOT / "kernels/gdn_prefill", "gdn_solution", "candidate_two_level")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

THREADS = two_level.NUM_THREADS
WARP = two_level.WARP_SIZE


# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------


def test_both_launchers_compile_for_sm90a_without_gpu():
    both = two_level.compiled_for("sm_90a")
    prepass_only = two_level.compiled_for("sm_90a", state_pass=False)
    assert callable(both) and callable(prepass_only) and both is not prepass_only
    assert two_level.compile_only("sm_90a") is both  # cached


def _seq_chunks(bounds: list[int], seq: int, total: int) -> int:
    start = min(max(bounds[seq], 0), total)
    end = min(max(bounds[seq + 1], start), total)
    return (end - start + model.CHUNK - 1) // model.CHUNK


def _locate_slot_as_the_kernel_does(bounds: list[int], slot: int, total: int) -> tuple[int, int]:
    """`_SlotMap.locate_slot`, thread by thread."""
    num_seqs = len(bounds) - 1
    per = (num_seqs + THREADS - 1) // THREADS
    mine = [sum(_seq_chunks(bounds, lo + i, total) for i in range(per) if lo + i < num_seqs) for lo in range(0, THREADS * per, per)]
    mine += [0] * (THREADS - len(mine))
    inclusive = []
    for warp in range(THREADS // WARP):
        values = mine[warp * WARP : (warp + 1) * WARP]
        offset = 1
        while offset < WARP:  # shuffle_sync_up: lane l reads lane l - offset (its own value below offset)
            values = [v + (values[lane - offset] if lane >= offset else 0) for lane, v in enumerate(values)]
            offset *= 2
        inclusive += values
    warp_totals = [inclusive[(w + 1) * WARP - 1] for w in range(THREADS // WARP)]
    found = (-1, 0)
    for tidx in range(THREADS):
        below = sum(total_ for w, total_ in enumerate(warp_totals) if w < tidx // WARP)
        first = below + inclusive[tidx] - mine[tidx]
        if first <= slot < first + mine[tidx]:
            running = first
            for i in range(per):
                lo = tidx * per
                if lo + i < num_seqs:
                    count = _seq_chunks(bounds, lo + i, total)
                    if running <= slot < running + count:
                        found = (lo + i, slot - running)
                    running += count
    return found


def _bounds(lengths: tuple[int, ...]) -> list[int]:
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    return bounds


@pytest.mark.parametrize(
    "lengths",
    [
        (1,),
        (64, 65),
        (0, 64, 0, 129, 1),
        cases.MANY_SHORT,
        cases.MANY_130,  # more sequences than threads: two per thread
        tuple(random.Random(300).randint(0, 200) for _ in range(300)),
    ],
    ids=lambda lengths: f"{len(lengths)}seqs",
)
def test_the_kernels_slot_search_finds_every_chunk_and_nothing_past_the_last(lengths):
    bounds = _bounds(lengths)
    total = bounds[-1]
    slots = model.chunk_slots(bounds, total)
    assert slots.slots == two_level.num_slots(total, len(lengths))
    for slot in range(slots.slots):
        expected = slots.owner(slot)
        assert _locate_slot_as_the_kernel_does(bounds, slot, total) == (expected if expected is not None else (-1, 0))


def test_the_kernels_slot_search_clamps_malformed_bounds():
    bounds = [0, 200, 100, 500, -5]
    slots = model.chunk_slots(bounds, 300)
    for slot in range(slots.slots):
        expected = slots.owner(slot)
        assert _locate_slot_as_the_kernel_does(bounds, slot, 300) == (expected if expected is not None else (-1, 0))


def test_the_state_pass_first_slot_is_the_chunk_count_before_the_sequence():
    lengths = (0, 64, 65, 1, 128, 0, 7)
    bounds = _bounds(lengths)
    slots = model.chunk_slots(bounds, bounds[-1])
    # first_slot: thread t sums sequences t, t + 128, ... below seq, then a block sum.
    for seq in range(len(lengths)):
        per_thread = [sum(_seq_chunks(bounds, j, bounds[-1]) for j in range(t, seq, THREADS)) for t in range(THREADS)]
        assert sum(per_thread) == slots.first[seq]


def test_the_candidate_keeps_kernel_py_threshold(monkeypatch):
    calls = []
    for module in (candidate.token_serial, candidate.two_level):
        monkeypatch.setattr(module, "run", lambda *args, _m=module: calls.append(_m.__name__.rsplit(".", 1)[-1]))
    for num_tokens in (1, 40, 41, 8192):
        case = cases.CheckCase(f"len{num_tokens}", (num_tokens,), True, 0.0, "mamba2")
        inputs = cases.make_inputs(case, "cpu", seed=1)
        candidate.run(*inputs.values(), *cases.poisoned_outputs(case, "cpu"))
    assert calls == ["token_serial", "token_serial", "two_level", "two_level"]
    # Past the workspaces' 32-bit offsets, the chunked kernel.
    assert candidate.path_for(64 * two_level.MAX_SLOTS, 1) is candidate.chunked
    assert candidate.path_for(64 * (two_level.MAX_SLOTS - 1), 1) is candidate.two_level


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


def _model_prepass_per_slot(inputs: dict, lengths: tuple[int, ...]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """(W, U) [8, 64, 128] of every chunk slot by `chunked_model.prepass` (fp16 operands), the chunk
    inputs built as `chunked_model.run` builds them."""
    q, k, v = (inputs[name].float().cpu() for name in ("q", "k", "v"))
    log_g, beta = model.gates(*(inputs[name].cpu() for name in ("A_log", "a", "dt_bias", "b")))
    group = model.NUM_V_HEADS // model.NUM_QK_HEADS
    bounds = _bounds(lengths)
    slots = model.chunk_slots(bounds, bounds[-1])
    out = {}
    for slot in range(slots.first[-1]):
        seq, chunk = slots.owner(slot)
        c0 = bounds[seq] + chunk * model.CHUNK
        c1 = min(c0 + model.CHUNK, bounds[seq + 1])
        pad = model.CHUNK - (c1 - c0)

        def heads_first(x: torch.Tensor, repeat: int = 1) -> torch.Tensor:
            x = x[c0:c1]
            if repeat > 1:
                x = x.repeat_interleave(repeat, dim=1)
            x = x.transpose(0, 1)
            return F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))

        ops = model.prepass(
            heads_first(q, group), heads_first(k, group), heads_first(v), heads_first(log_g), heads_first(beta),
            model.KERNEL,
        )  # fmt: skip
        out[slot] = (ops.W, ops.U)
    return out


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        cases.CheckCase("tl_63_64_65", (63, 64, 65), True, 0.0, "mamba2"),
        cases.CheckCase("tl_200_0_7_fast", (200, 0, 7), False, 0.05, "fast_decay"),
    ],
    ids=lambda c: c.name,
)
def test_the_prepass_workspaces_match_the_model_slot_by_slot(case):
    inputs = cases.make_inputs(case, "cuda", seed=11)
    output, new_state = cases.poisoned_outputs(case, "cuda")
    w_ws, u_ws = two_level.run_keeping_workspaces(*inputs.values(), output, new_state, state_pass=False)
    expected = _model_prepass_per_slot(inputs, case.lengths)
    for slot, (w_model, u_model) in expected.items():
        for name, got, want in (("W", w_ws[slot], w_model), ("U", u_ws[slot], u_model)):
            got = got.float().cpu()
            assert torch.isfinite(got).all(), (slot, name)
            err = (got - want).abs().max().item()
            assert err <= 4e-3 + 1e-2 * want.abs().max().item(), (slot, name, err)
    assert math.isnan(output.float()[0, 0, 0].item())  # the prepass alone writes no output
