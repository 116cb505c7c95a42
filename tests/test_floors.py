"""Roofline floors: hand-computed values from hopper_anchors.md §2.3, §3.4, §4.4."""

from __future__ import annotations

import pytest
import torch

from hopperbench.floors import FloorInputError, floor, trial_floor
from hopperbench.results import TrialFloor
from hopperbench.tracks import DSA_ATTENTION
from hopperbench.tracks.moe.floor import expected_active_local_experts
from hopperbench.tracks.moe.floor import local_expert_counts as moe_local_expert_counts

T_LAT_US = 1.15


def test_dsa_without_inputs_counts_2048_distinct_rows_per_token() -> None:
    f = floor("dsa_attention", {"num_tokens": 8, "num_pages": 8462}, t_lat_us=T_LAT_US)
    # 1152 B x 2048 rows x 8 tokens + 43,072 B x 8 tokens (§2.3: 19.2 MB -> 4.5 us)
    assert f.bytes_min == 1152 * 2048 * 8 + 43072 * 8 == 19_218_944
    assert f.flops == 34816 * 2048 * 8
    assert f.memory_us == pytest.approx(19_218_944 / 4.3e12 * 1e6)
    assert f.memory_us == pytest.approx(4.4695, abs=1e-4)
    assert f.compute_us == pytest.approx(34816 * 16384 / 790e12 * 1e6)
    assert f.floor_us == pytest.approx(f.memory_us + T_LAT_US)


def test_dsa_with_inputs_counts_distinct_valid_rows_and_valid_keys() -> None:
    indices = torch.full((2, 2048), -1, dtype=torch.int32)
    indices[0, :3] = torch.tensor([0, 1, 2])
    indices[1, :2] = torch.tensor([2, 3])  # row 2 is shared: 4 distinct rows, 5 valid keys
    f = floor(DSA_ATTENTION, {"num_tokens": 2, "num_pages": 1}, t_lat_us=0.0, inputs={"sparse_indices": indices})
    assert f.bytes_min == 1152 * 4 + 43072 * 2
    assert f.flops == 34816 * 5
    assert f.floor_us == pytest.approx(max(f.memory_us, f.compute_us))


def test_dsa_rejects_indices_of_the_wrong_shape() -> None:
    with pytest.raises(FloorInputError, match="sparse_indices has shape"):
        floor("dsa_attention", {"num_tokens": 3}, t_lat_us=1.0, inputs={"sparse_indices": torch.zeros(2, 2048)})


def test_moe_single_token_streams_one_expert() -> None:
    f = floor("moe", {"seq_len": 1}, t_lat_us=T_LAT_US)
    assert f.bytes_min == pytest.approx(44_040_192 + 10_752 + 22_752)
    assert f.memory_us == pytest.approx(44_073_696 / 4.3e12 * 1e6)
    assert f.flops == pytest.approx(88_080_384)
    assert f.compute_us == pytest.approx(88_080_384 / 1.5e15 * 1e6)
    assert f.floor_us == pytest.approx(f.memory_us + T_LAT_US)


def test_moe_estimate_matches_the_notes_table() -> None:
    assert expected_active_local_experts(80) == pytest.approx(29.5, abs=0.05)
    assert expected_active_local_experts(901) == pytest.approx(32.0, abs=1e-6)
    # T = 14107: compute-bound at ~0.83 ms (§4.4)
    f = floor("moe", {"seq_len": 14107}, t_lat_us=0.0)
    assert f.compute_us == pytest.approx(828, rel=5e-3)
    assert f.floor_us == f.compute_us > f.memory_us


def _logits_routing_every_token_to(experts: list[int], num_tokens: int) -> torch.Tensor:
    logits = torch.full((num_tokens, 256), -10.0)
    logits[:, experts] = 10.0
    return logits


def test_moe_routing_counts_follow_the_local_window() -> None:
    # Experts 0..3 (group 0) and 40..43 (group 1) take every token.
    logits = _logits_routing_every_token_to([0, 1, 2, 3, 40, 41, 42, 43], num_tokens=5)
    bias = torch.zeros(256, dtype=torch.bfloat16)
    counts = moe_local_expert_counts(logits, bias, local_expert_offset=32)
    assert counts.tolist() == [0] * 8 + [5] * 4 + [0] * 20
    f = floor(
        "moe",
        {"seq_len": 5},
        t_lat_us=0.0,
        inputs={"routing_logits": logits, "routing_bias": bias, "local_expert_offset": 32},
    )
    assert f.bytes_min == (44_040_192 + 10_752) * 4 + 22_752 * 5
    assert f.flops == 88_080_384 * 20


def test_moe_bias_steers_selection_and_no_local_expert_leaves_only_token_bytes() -> None:
    logits = torch.zeros(3, 256)
    bias = torch.zeros(256, dtype=torch.bfloat16)
    bias[200:208] = 1.0  # all selected experts live in [192, 224)
    inputs = {"routing_logits": logits, "routing_bias": bias, "local_expert_offset": 0}
    f = floor("moe", {"seq_len": 3}, t_lat_us=0.0, inputs=inputs)
    assert f.bytes_min == 22_752 * 3
    assert f.flops == 0
    assert moe_local_expert_counts(logits, bias, 192).tolist() == [0] * 8 + [3] * 8 + [0] * 16


def test_gdn_counts_state_in_and_out() -> None:
    f = floor("gdn_prefill", {"total_seq_len": 8192, "num_seqs": 48, "len_cu_seqlens": 49}, t_lat_us=T_LAT_US)
    # §3.4: ~101 MB -> 23 us; compute ~15 us
    assert f.bytes_min == 6176 * 8192 + 524_288 * 48 * 2 == 100_925_440
    assert f.memory_us == pytest.approx(23.47, abs=0.01)
    assert f.compute_us == pytest.approx(8192 * 8 * (6 * 128**2 + 10 * 64 * 128 + 0.7 * 64**2) / 790e12 * 1e6)
    assert f.compute_us == pytest.approx(15.2, abs=0.1)
    assert f.floor_us == pytest.approx(f.memory_us + T_LAT_US)


def test_gdn_without_input_state_reads_no_state() -> None:
    axes = {"total_seq_len": 6, "num_seqs": 1, "len_cu_seqlens": 2}
    with_state = floor("gdn_prefill", axes, t_lat_us=0.0, inputs={"state": torch.zeros(1)})
    without = floor("gdn_prefill", axes, t_lat_us=0.0, inputs={"state": None})
    assert with_state.bytes_min - without.bytes_min == 524_288
    assert without.bytes_min == 6176 * 6 + 524_288


@pytest.mark.parametrize(
    ("track", "axes", "message"),
    [
        ("gdn_prefill", {"total_seq_len": 6}, "lack 'num_seqs'"),
        ("moe", {"seq_len": 0}, "must be >= 1"),
        ("dsa_attention", {}, "lack 'num_tokens'"),
    ],
)
def test_bad_axes_give_one_clear_error(track: str, axes: dict[str, int], message: str) -> None:
    with pytest.raises(FloorInputError, match=message):
        floor(track, axes, t_lat_us=1.0)


def test_negative_latency_is_rejected() -> None:
    with pytest.raises(FloorInputError, match="t_lat_us"):
        floor("moe", {"seq_len": 1}, t_lat_us=-1.0)


def test_trial_floor_is_the_exact_floor_without_the_empty_kernel_span() -> None:
    indices = torch.full((2, 2048), -1, dtype=torch.int32)
    indices[0, :3] = torch.tensor([0, 1, 2])
    axes = {"num_tokens": 2, "num_pages": 1}
    f = floor("dsa_attention", axes, t_lat_us=T_LAT_US, inputs={"sparse_indices": indices})
    assert f.core_us == pytest.approx(f.floor_us - T_LAT_US)
    assert trial_floor("dsa_attention", axes, {"sparse_indices": indices}) == TrialFloor(
        bytes_min=f.bytes_min, core_us=f.core_us
    )
    with pytest.raises(FloorInputError, match="lack tensor 'sparse_indices'"):
        trial_floor("dsa_attention", axes, {"q_nope": torch.zeros(1)})
