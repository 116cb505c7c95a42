"""DSA candidate v2 (kernels/dsa_attention/fused.py: the combine fused into the split kernel).

CPU: the kernel compiles for sm_90a without a GPU and is cached; the split heuristic; input
validation; and the kernel's index maps, evaluated by CuTe itself from the layouts the kernel is
built with (the MMA accumulator fragment of every thread, the partial record it writes and reads
back, the merge slots, the per-head statistics, the lse writers). GPU (marked `gpu`, skipped
without CUDA): the GPU tests of test_dsa_attention_kernel.py run fused.py too (every check case,
every split count, bitwise-repeatable results, graph replay); here, what the arrival counters add:
consecutive calls on new inputs and on changing batch sizes (the counters must be back at zero
after each call), calls on side streams, two of them concurrently (counters are per stream), and
graph replays repeated on new inputs.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter

import pytest
import torch

import cutlass
import cutlass.cute as cute

from hopperbench.devcheck import load_module_by_path, refill_inputs, replay_on_fresh_inputs, total_nan
from hopperbench.paths import REPO_ROOT
from tests.kernels.test_dsa_attention_kernel import _cpu_inputs, cases, needs_cuda, solution_module

fused = solution_module("fused")


# ------------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------------


def test_compiles_for_sm90a_without_gpu():
    compiled = fused.compile_only("sm_90a")
    assert callable(compiled)
    assert fused.compile_only("sm_90a") is compiled  # cached: no recompilation


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 7, 8, 9, 16, 17, 33, 37, 66, 67, 132, 133, 4096])
def test_num_splits_fills_one_wave_within_the_merge_cap(num_tokens):
    splits = fused.num_splits_for(num_tokens)
    assert splits in fused.VALID_SPLITS and splits <= fused.MAX_FUSED_SPLITS
    assert num_tokens * splits <= fused.MAX_CTAS_PER_WAVE or splits == 1
    # As many splits as the cap and the wave allow.
    assert splits == fused.MAX_FUSED_SPLITS or num_tokens * splits * 2 > fused.MAX_CTAS_PER_WAVE


@functools.cache
def _traced_index_maps() -> dict[str, list]:
    """The kernel's index maps for every thread, evaluated by CuTe while tracing a host function on
    the CPU: the same tiled MMA and layout builders as the kernel, with a static thread index, so
    every coordinate and offset below is a plain int that CuTe computed."""
    maps: dict[str, list] = {}

    @cute.jit
    def trace():
        tiled_mma = fused._v1._make_tiled_mma()
        identity = cute.make_identity_tensor((fused.NUM_HEADS, fused.CKV_DIM))
        accumulator = []
        for tidx in cutlass.range_constexpr(fused.NUM_THREADS):
            tOcO = tiled_mma.get_slice(tidx).partition_C(identity)
            accumulator.append([tuple(tOcO[v]) for v in range(cute.size(tOcO))])
        maps["accumulator"] = accumulator  # [thread][value] -> (head, column), as the kernel's tOcO
        acc_layout = cute.make_rmem_tensor(
            tiled_mma.get_slice(0).partition_shape_C((fused.NUM_HEADS, fused.CKV_DIM)), cutlass.Float32
        ).layout
        maps["register_of_value"] = [cute.crd2idx(v, acc_layout) for v in range(fused.FRAG_VALUES)]
        record = fused.partial_fragment_layout()
        maps["record_offset"] = [
            [[cute.crd2idx((j, t, k), record) for k in range(fused.FRAG_VECTORS)] for j in range(fused.VEC)]
            for t in range(fused.NUM_THREADS)
        ]  # [thread][value in vector][vector]
        registers = fused.register_fragment_layout()
        maps["register_of_fragment"] = [
            [cute.crd2idx((j, k), registers) for k in range(fused.FRAG_VECTORS)] for j in range(fused.VEC)
        ]
        slots = fused.merge_slots_layout()
        maps["slot_base"] = [cute.crd2idx((0, s), slots) for s in range(fused.MERGE_SLOTS)]
        maps["slot_end"] = [cute.crd2idx((fused.PARTIAL_FLOATS - 1, s), slots) + 1 for s in range(fused.MERGE_SLOTS)]
        stats = fused.stats_layout()
        maps["stats"] = [cute.crd2idx((h, i), stats) for h in range(fused.NUM_HEADS) for i in range(2)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the DSL's advice to unroll the 128-thread loop at run time
        trace()
    return maps


def _row_lo(fragment: list[tuple[int, int]]) -> int:
    return fragment[0][0]  # the kernel's row_lo = tOcO[0][0]


def test_accumulator_fragments_tile_the_output_block_exactly_once():
    held = Counter(c for fragment in _traced_index_maps()["accumulator"] for c in fragment)
    assert len(held) == fused.NUM_HEADS * fused.CKV_DIM and set(held.values()) == {1}
    assert all(0 <= h < fused.NUM_HEADS and 0 <= c < fused.CKV_DIM for h, c in held)


def test_every_accumulator_value_is_on_row_lo_or_row_lo_plus_8():
    # The merge and the normalisation pick a value's head weight by `tOcO[v][0] == row_lo`, else
    # row_hi = row_lo + 8: any other row would be scaled with the wrong head's statistics.
    for fragment in _traced_index_maps()["accumulator"]:
        row_lo = _row_lo(fragment)
        assert row_lo < fused.HI_ROW_OFFSET
        rows = Counter(h for h, _ in fragment)
        assert rows == {row_lo: fused.FRAG_VALUES // 2, row_lo + fused.HI_ROW_OFFSET: fused.FRAG_VALUES // 2}


def test_lse_writers_cover_every_head_once():
    # write_output: the threads whose value 0 is in column 0 write lse of row_lo and row_hi.
    writers = [f for f in _traced_index_maps()["accumulator"] if f[0][1] == 0]
    heads = sorted(h for f in writers for h in (_row_lo(f), _row_lo(f) + fused.HI_ROW_OFFSET))
    assert heads == list(range(fused.NUM_HEADS))


def test_partial_record_round_trip_puts_every_output_element_at_one_offset():
    # Writer: register register_of_fragment[j][k] of thread t -> record_offset[t][j][k]. Reader:
    # the same offset -> incoming[j, k], folded into acc_o[v] for v = j + 4 k (the kernel's
    # `incoming[v % VEC, v // VEC]`), which must be the register the writer stored from.
    maps = _traced_index_maps()
    registers = maps["register_of_fragment"]
    for v in range(fused.FRAG_VALUES):
        assert registers[v % fused.VEC][v // fused.VEC] == maps["register_of_value"][v]
    element_at_offset = {}
    for t, fragment in enumerate(maps["accumulator"]):
        value_of_register = {r: v for v, r in enumerate(maps["register_of_value"])}
        for j in range(fused.VEC):
            for k in range(fused.FRAG_VECTORS):
                offset = maps["record_offset"][t][j][k]
                assert offset not in element_at_offset
                element_at_offset[offset] = fragment[value_of_register[registers[j][k]]]
    assert sorted(element_at_offset) == list(range(fused.PARTIAL_O))
    assert len(set(element_at_offset.values())) == fused.PARTIAL_O
    # Each thread's vector is 4 contiguous floats starting 16-B aligned (st.global.v4 / cp.async 16).
    for per_thread in maps["record_offset"]:
        for k in range(fused.FRAG_VECTORS):
            vector = [per_thread[j][k] for j in range(fused.VEC)]
            assert vector == list(range(vector[0], vector[0] + fused.VEC)) and vector[0] % fused.VEC == 0


def test_statistics_have_their_own_offsets_after_the_output_block():
    heads = range(fused.NUM_HEADS)
    record_stats = [fused.PARTIAL_MAX + h for h in heads] + [fused.PARTIAL_SUM + h for h in heads]
    assert sorted(record_stats) == list(range(fused.PARTIAL_O, fused.PARTIAL_FLOATS))
    # Shared-memory copy of this CTA's statistics (read by the one-split path).
    assert sorted(_traced_index_maps()["stats"]) == list(range(2 * fused.NUM_HEADS))
    # One softmax thread per head writes them (tidx % 8 == 0, head tidx // 8).
    per_row = fused.THREADS_PER_SOFTMAX_ROW
    assert [t // per_row for t in range(fused.NUM_THREADS) if t % per_row == 0] == list(heads)


def test_load_rounds_copy_every_piece_of_a_record_once():
    # load_partial: round k, thread t copies piece k * 128 + t when it is inside the record.
    pieces = [
        k * fused.NUM_THREADS + t
        for k in range(fused.LOAD_ROUNDS)
        for t in range(fused.NUM_THREADS)
        if k * fused.NUM_THREADS + t < fused.PARTIAL_VECTORS
    ]
    assert sorted(pieces) == list(range(fused.PARTIAL_VECTORS))


def test_merge_slots_fit_in_the_k_stages_and_start_16_byte_aligned():
    maps = _traced_index_maps()
    k_stage_bytes = fused.NUM_STAGES * fused.BLOCK_N * fused.QK_ROW_STRIDE * 2
    assert max(maps["slot_end"]) * 4 <= k_stage_bytes
    assert all(base * 4 % 16 == 0 for base in maps["slot_base"])
    spans = sorted(zip(maps["slot_base"], maps["slot_end"]))
    assert all(end <= next_base for (_, end), (next_base, _) in zip(spans, spans[1:]))  # disjoint


def test_run_rejects_wrong_dtype_with_one_line_error():
    inputs, output, lse = _cpu_inputs()
    inputs["sparse_indices"] = inputs["sparse_indices"].long()
    with pytest.raises(fused.DsaShapeError, match="sparse_indices") as info:
        fused.run(*inputs.values(), output, lse)
    assert "\n" not in str(info.value)


def test_run_with_splits_rejects_a_split_count_that_does_not_divide_the_chunks():
    inputs, output, lse = _cpu_inputs()
    with pytest.raises(fused.DsaShapeError, match="num_splits"):
        fused.run_with_splits(*inputs.values(), output, lse, 3)


def test_run_with_splits_rejects_a_workspace_beyond_32_bit_offsets():
    # Meta tensors: shapes only, nothing allocated; 8200 tokens x 32 splits x 8224 floats > 2^31.
    num_tokens = 8200
    meta = {"device": "meta", "dtype": torch.bfloat16}
    args = (
        torch.empty(num_tokens, 16, 512, **meta),
        torch.empty(num_tokens, 16, 64, **meta),
        torch.empty(4, 64, 512, **meta),
        torch.empty(4, 64, 64, **meta),
        torch.empty(num_tokens, 2048, device="meta", dtype=torch.int32),
        cases.SM_SCALE,
        torch.empty(num_tokens, 16, 512, **meta),
        torch.empty(num_tokens, 16, device="meta", dtype=torch.float32),
    )
    with pytest.raises(fused.DsaShapeError, match="32-bit"):
        fused.run_with_splits(*args, 32)


def test_device_check_tool_loads_the_candidate_with_its_sweep_entry():
    tool = load_module_by_path(REPO_ROOT / "tools/device_check_dsa.py", "device_check_dsa_tool")
    module = tool._kernel_loader("fused")()
    assert module.run_with_splits.__module__ == module.__name__  # fused.py's own, not kernel.py's
    assert module.num_splits_for(1) in module.VALID_SPLITS
    assert tool._parse_args(["--kernel", "fused"]).kernel == "fused"
    assert tool._parse_args([]).kernel == "kernel"


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


def _counters_in_use() -> torch.Tensor:
    """The cached arrival counters of the current device and stream (created by the first call)."""
    key = (torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)
    return fused._COUNTERS[key]


def _check(case, seed: int):
    inputs = cases.make_inputs(case, "cuda", seed=seed)
    output, lse = cases.poisoned_outputs(case.num_tokens, "cuda")
    fused.run(*inputs.values(), output, lse)
    result = cases.compare(output, lse, *cases.load_reference_run()(*inputs.values()))
    assert total_nan(result) == 0, result
    assert result.passed, result
    return output, lse


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 8, 37])
def test_consecutive_calls_leave_the_counters_at_zero(num_tokens):
    # A counter left non-zero makes the next call pick the wrong last CTA: its output stays NaN
    # or merges unfinished partials. Three calls on new inputs, each checked, the same T.
    case = cases.CheckCase("consecutive", num_tokens, 300, "scattered_padding")
    assert fused.num_splits_for(num_tokens) > 1  # the fused merge path, not the one-split path
    for seed in range(3):
        _check(case, seed=seed)
        torch.cuda.synchronize()
        assert not _counters_in_use().any()


@pytest.mark.gpu
@needs_cuda
def test_changing_batch_sizes_on_one_stream_reuse_the_counters():
    # Back to back on one stream with different T and split counts (16, 2, 16, 4, 16): a token's
    # counter is shared by calls of any T and must be back at zero after each of them.
    for seed, num_tokens in enumerate([8, 37, 1, 33, 8]):
        assert fused.num_splits_for(num_tokens) > 1
        _check(cases.CheckCase(f"mixed_t{num_tokens}", num_tokens, 300, "scattered_padding"), seed=seed)
    torch.cuda.synchronize()
    assert not _counters_in_use().any()


@pytest.mark.gpu
@needs_cuda
def test_two_side_streams_at_once_use_their_own_counters():
    # Two streams' calls overlap on the GPU; with shared counters a token's tickets would mix and
    # pick a last CTA whose token still has unfinished splits (wrong or NaN output).
    case = cases.CheckCase("streams", 8, 300, "scattered_padding")
    inputs = [cases.make_inputs(case, "cuda", seed=seed) for seed in (11, 12)]
    outputs = [cases.poisoned_outputs(case.num_tokens, "cuda") for _ in inputs]
    streams = [torch.cuda.Stream() for _ in inputs]
    torch.cuda.synchronize()  # the inputs are written on the default stream
    for stream, args, (output, lse) in zip(streams, inputs, outputs):
        with torch.cuda.stream(stream):
            for _ in range(3):  # several launches per stream, so that the two streams overlap
                fused.run(*args.values(), output, lse)
    torch.cuda.synchronize()
    reference = cases.load_reference_run()
    for stream, args, (output, lse) in zip(streams, inputs, outputs):
        result = cases.compare(output, lse, *reference(*args.values()))
        assert total_nan(result) == 0 and result.passed, result
        assert not fused._COUNTERS[(torch.cuda.current_device(), stream.cuda_stream)].any()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 8])
def test_cuda_graph_replays_follow_new_inputs(num_tokens):
    case = cases.CheckCase("graph", num_tokens, 300, "scattered_padding")
    static = cases.make_inputs(case, "cuda", seed=1)
    output, lse = cases.poisoned_outputs(case.num_tokens, "cuda")

    def call() -> None:
        fused.run(*static.values(), output, lse)

    graph = replay_on_fresh_inputs(call, static, cases.make_inputs(case, "cuda", seed=2), (output, lse))
    reference = cases.load_reference_run()
    assert cases.compare(output, lse, *reference(*static.values())).passed
    # A second replay on other inputs: the counters the graph uses must be zero again.
    fresh = cases.make_inputs(case, "cuda", seed=4)
    _replay_again(graph, static, fresh, (output, lse))
    assert cases.compare(output, lse, *reference(*static.values())).passed
    # And an eager call after the replays still finds its own counters at zero.
    _check(case, seed=5)


def _replay_again(graph, static, fresh, outputs) -> None:
    """Refill the captured inputs, poison the outputs and replay an already captured graph."""
    refill_inputs(static, fresh)
    for output in outputs:
        output.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
