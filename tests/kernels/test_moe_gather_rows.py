"""The row gather before the grouped GEMM1 (kernels/moe/gather_rows.py; kernel.py's GROUPED_T).

CPU: it compiles for sm_90a without a GPU and caches; its PTX copies a row in 16-B vectors, all of a lane's loads
before its first store; a transcription of its walk and row lookup (each warp's ballot over the experts' inclusive
ends) gives every packed row below the counts' sum once, with its expert and rank.
GPU (skipped without CUDA): the gathered rows and scales against torch indexing, bit for bit, on uneven, empty, skewed
and all-local counts; rows past the counts' sum left untouched.
"""

from __future__ import annotations

import random
import re

import pytest

pytest.importorskip("cutlass")

import torch  # noqa: E402

from tests.kernels.compile_checks import assert_compiles_and_caches  # noqa: E402
from tests.kernels.test_moe_kernel import needs_cuda, solution_module  # noqa: E402

gather = solution_module("gather_rows")


# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------


def test_compiles_for_sm90a_without_gpu():
    assert_compiles_and_caches(gather.compile_only, 1)


def test_a_row_is_copied_in_16_byte_vectors_all_loads_first(tmp_path):
    gather.compiled(dump_dir=str(tmp_path))
    (ptx,) = tmp_path.glob("*.ptx")
    lines = [line.strip() for line in ptx.read_text().splitlines()]
    loads = [at for at, line in enumerate(lines) if re.match(r"ld\.global(\.\w+)*\.v4\.b32", line)]
    stores = [at for at, line in enumerate(lines) if re.match(r"st\.global(\.\w+)*\.v4\.b32", line)]
    assert len(loads) == len(stores) == gather.CHUNKS_PER_LANE
    assert max(loads) < min(stores)
    assert "trap;" not in ptx.read_text()


def lookup_transcribed(counts: list[int], row: int) -> tuple[int, int]:
    """(expert, rank) of packed row `row` as a warp finds it: lane e holds expert e's inclusive end; the expert is the
    number of lanes whose end is at or before the row (ballot, popc), the rank the row less that expert's first row."""
    ends = [sum(counts[: e + 1]) for e in range(len(counts))]
    expert = sum(end <= row for end in ends)
    return expert, row - (ends[expert] - counts[expert])


@pytest.mark.parametrize("seed", range(6))
def test_the_walk_and_lookup_give_every_packed_row_once_with_its_expert_and_rank(seed):
    draw = random.Random(seed)
    counts = [draw.choice([0, 0, 1, 3, 127, 128, 129, 500]) for _ in range(32)]
    if seed == 0:
        counts = [0] * 32
    elif seed == 1:
        counts = [0] * 9 + [1000] + [0] * 22
    total = sum(counts)
    grid = draw.choice([1, 7, 132]) * gather.CTAS_PER_SM
    seen = []
    for cta in range(grid):
        for warp in range(gather.ROWS_PER_CTA):
            row = cta * gather.ROWS_PER_CTA + warp
            while row < total:
                seen.append((row, *lookup_transcribed(counts, row)))
                row += grid * gather.ROWS_PER_CTA
    assert sorted(r for r, _, _ in seen) == list(range(total))
    expected = {(sum(counts[:e]) + k, e, k) for e in range(32) for k in range(counts[e])}
    assert set(seen) == expected


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

GPU_CASES = {
    "uneven": (300, [0, 1, 127, 128, 129, 0, 5, 64] + [0, 17] * 12),
    "one_expert": (1000, [0] * 7 + [1000] + [0] * 24),  # every token on one expert
    "eight_local": (700, [700] * 8 + [0] * 24),  # every token on the same 8 experts: 8 T rows
    "no_local": (50, [0] * 32),
}


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_grouped_rows_are_x_indexed_by_the_token_lists(case):
    num_tokens, counts_list = GPU_CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(len(case))
    x = torch.randn(num_tokens, gather.HIDDEN, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    x_scale = torch.rand(gather.HIDDEN_BLOCKS, num_tokens, device="cuda", generator=gen) + 0.5
    expert_tokens = torch.full((32, num_tokens), -1, dtype=torch.int32, device="cuda")
    for e, count in enumerate(counts_list):
        expert_tokens[e, :count] = torch.randperm(num_tokens, device="cuda", generator=gen)[:count].int()
    counts = torch.tensor(counts_list, dtype=torch.int32, device="cuda")
    rows = 8 * num_tokens
    a_rows = torch.full((rows, gather.HIDDEN), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    a_rows_scale = torch.full((gather.HIDDEN_BLOCKS, rows), float("nan"), device="cuda")
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    gather.compiled()(counts, expert_tokens, x, x_scale, a_rows, a_rows_scale, sms)
    torch.cuda.synchronize()
    tokens = torch.cat([expert_tokens[e, :count] for e, count in enumerate(counts_list)]).long()
    total = tokens.numel()
    assert torch.equal(a_rows[:total].view(torch.uint8), x[tokens].view(torch.uint8))
    assert torch.equal(a_rows_scale[:, :total], x_scale[:, tokens])
    assert bool((a_rows[total:].view(torch.uint8) == 0x7F).all()) and bool(a_rows_scale[:, total:].isnan().all())
