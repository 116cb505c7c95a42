"""Workload lists: embedded TSVs, official flashinfer-trace data, validation and selection."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import hopperbench.workloads as workloads_module
from hopperbench.paths import shared_contest_data_dir
from hopperbench.tracks import TRACKS
from hopperbench.workloads import (
    WorkloadError,
    WorkloadSelectionError,
    load_workloads,
    official_workload_file,
    select_workloads,
)

EXPECTED_COUNTS = {"gdn_prefill": 100, "moe": 19, "dsa_attention": 23}


def _shared_tsv_rows(path: Path) -> list[dict[str, str]]:
    return list(
        csv.DictReader([line for line in path.read_text().splitlines() if not line.startswith("#")], delimiter="\t")
    )


@pytest.mark.parametrize("track", list(EXPECTED_COUNTS))
def test_embedded_lists_load_with_contest_counts(track: str, tmp_path: Path) -> None:
    workloads = load_workloads(track, data_dir=tmp_path)  # empty dir: no official data
    assert len(workloads) == EXPECTED_COUNTS[track]
    assert [w.index for w in workloads] == list(range(len(workloads)))
    assert len({w.uuid for w in workloads}) == len(workloads)
    assert all(w.data_source == "synthesized" and not w.blob_inputs for w in workloads)


def test_embedded_axes_and_scalars_are_consistent(tmp_path: Path) -> None:
    gdn = load_workloads("gdn_prefill", tmp_path)
    assert all(w.axes["len_cu_seqlens"] == w.axes["num_seqs"] + 1 for w in gdn)
    assert sum(w.axes["total_seq_len"] for w in gdn) == 183_065  # harness_facts.md §8
    moe = load_workloads("moe", tmp_path)
    assert {w.scalars["routed_scaling_factor"] for w in moe} == {2.5}
    assert all(isinstance(w.scalars["local_expert_offset"], int) for w in moe)
    dsa = load_workloads("dsa_attention", tmp_path)
    assert {w.scalars["sm_scale"] for w in dsa} == {0.1352337788608801}
    assert sum(w.axes["num_tokens"] for w in dsa) == 120


@pytest.mark.parametrize("track", ["gdn_prefill", "dsa_attention"])
def test_reconstructed_lists_match_shared_tables(track: str, tmp_path: Path) -> None:
    shared = shared_contest_data_dir()
    if shared is None:
        pytest.skip("../shared/contest_data is absent")
    definition_name = TRACKS[track].definition_name
    rows = _shared_tsv_rows(shared / definition_name / "workloads_axes_reconstructed.tsv")
    workloads = load_workloads(track, tmp_path)
    assert [w.uuid for w in workloads] == [r["uuid"] for r in rows]
    for w, row in zip(workloads, rows, strict=True):
        assert w.axes == {k: int(v) for k, v in row.items() if k not in ("index", "uuid")}


def test_moe_list_matches_official_jsonl(tmp_path: Path) -> None:
    shared = shared_contest_data_dir()
    if shared is None:
        pytest.skip("../shared/contest_data is absent")
    name = TRACKS["moe"].definition_name
    for jsonl in (f"{name}.jsonl", f"{name}.fixed_b8049ff6.jsonl"):
        lines = [json.loads(line)["workload"] for line in (shared / name / jsonl).read_text().splitlines()]
        workloads = load_workloads("moe", tmp_path)
        assert [w.uuid for w in workloads] == [line["uuid"] for line in lines]
        for w, line in zip(workloads, lines, strict=True):
            assert w.axes == line["axes"]
            assert w.scalars == {
                k: line["inputs"][k]["value"] for k in ("local_expert_offset", "routed_scaling_factor")
            }


def _with_list(monkeypatch: pytest.MonkeyPatch, track: str, text: str, tmp_path: Path) -> None:
    """Point `track` at a TSV written in tmp_path (an absolute path wins over the package folder)."""
    path = tmp_path / f"{track}.tsv"
    path.write_text(text)
    patched = dataclasses.replace(TRACKS[track], workload_list=str(path))
    monkeypatch.setattr(workloads_module, "get_track", lambda name: patched)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "index\tuuid\ttotal_seq_len\tnum_seqs\tlen_cu_seqlens\n0\tu0\t10\t2\t4\n",
            r"constraint .len_cu_seqlens == num_seqs \+ 1. fails",
        ),
        ("index\tuuid\ttotal_seq_len\tnum_seqs\n0\tu0\t10\t2\n", "expected the var axes"),
        ("index\tuuid\ttotal_seq_len\tnum_seqs\tlen_cu_seqlens\tbogus\n0\tu0\t10\t2\t3\t1\n", "neither var axes"),
        ("index\tuuid\ttotal_seq_len\tnum_seqs\tlen_cu_seqlens\n0\tu0\t10\t2\t3\n0\tu1\t10\t2\t3\n", "out of order"),
        ("index\tuuid\ttotal_seq_len\tnum_seqs\tlen_cu_seqlens\n0\tu0\t10\t2\t3\n1\tu0\t10\t2\t3\n", "duplicate uuid"),
        ("index\tuuid\ttotal_seq_len\tnum_seqs\tlen_cu_seqlens\n0\tu0\t0\t2\t3\n", "must be >= 1"),
        ("index\tuuid\ttotal_seq_len\tnum_seqs\tlen_cu_seqlens\n0\tu0\tten\t2\t3\n", "not an integer"),
    ],
)
def test_bad_embedded_list_is_rejected(
    body: str, message: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _with_list(monkeypatch, "gdn_prefill", "# comment\n" + body, tmp_path)
    with pytest.raises(WorkloadError, match=message):
        load_workloads("gdn_prefill", tmp_path)


def test_scalar_of_wrong_kind_is_rejected(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _with_list(monkeypatch, "moe", "index\tuuid\tseq_len\tlocal_expert_offset\n0\tu0\t4\t2.5\n", tmp_path)
    with pytest.raises(WorkloadError, match="not an integer"):
        load_workloads("moe", tmp_path)


# ---------------------------------------------------------------------------------------------
# Official data


def _write_official_dsa(root: Path, num_tokens: list[int], blobs_for: set[int], num_pages: int = 8462) -> Path:
    """A flashinfer-trace DSA workload file; blobs (sparse_indices) only for indices in `blobs_for`."""
    track = TRACKS["dsa_attention"]
    blob_dir = root / "blob" / "workloads" / track.op_type / track.definition_name
    blob_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, t in enumerate(num_tokens):
        blob = f"{track.definition_name}_w{i}.safetensors"
        if i in blobs_for:
            save_file({"sparse_indices": torch.zeros(t, 2048, dtype=torch.int32)}, str(blob_dir / blob))
        workload = {
            "uuid": f"w{i}",
            "axes": {"num_tokens": t, "num_pages": num_pages},
            "inputs": {
                "sparse_indices": {
                    "type": "safetensors",
                    "path": f"./blob/workloads/{track.op_type}/{track.definition_name}/{blob}",
                    "tensor_key": "sparse_indices",
                },
                "sm_scale": {"type": "scalar", "value": 0.125},
                "q_nope": {"type": "random"},
            },
        }
        lines.append(
            json.dumps(
                {"definition": track.definition_name, "solution": None, "workload": workload, "evaluation": None}
            )
        )
    path = official_workload_file(track, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_official_data_is_preferred_and_missing_blobs_recorded(tmp_path: Path) -> None:
    _write_official_dsa(tmp_path, [2, 3], blobs_for={0})
    w0, w1 = load_workloads("dsa_attention", tmp_path)
    assert (w0.data_source, w1.data_source) == ("official", "official")
    assert w0.scalars == {"sm_scale": 0.125}
    assert w0.blob_inputs["sparse_indices"].path.is_file()
    assert w0.blob_inputs["sparse_indices"].tensor_key == "sparse_indices"
    assert w0.missing_blob_inputs == ()
    assert w1.blob_inputs == {} and w1.missing_blob_inputs == ("sparse_indices",)


def test_official_blob_with_wrong_shape_is_rejected(tmp_path: Path) -> None:
    _write_official_dsa(tmp_path, [2], blobs_for={0})
    blob = next((tmp_path / "blob").rglob("*.safetensors"))
    save_file({"sparse_indices": torch.zeros(5, 2048, dtype=torch.int32)}, str(blob))
    with pytest.raises(WorkloadError, match="shape"):
        load_workloads("dsa_attention", tmp_path)


def test_official_file_for_another_definition_is_rejected(tmp_path: Path) -> None:
    path = _write_official_dsa(tmp_path, [2], blobs_for=set())
    path.write_text(path.read_text().replace('"definition": "dsa_sparse', '"definition": "xdsa_sparse'))
    with pytest.raises(WorkloadError, match="expected 'dsa_sparse"):
        load_workloads("dsa_attention", tmp_path)


def test_official_file_with_unknown_input_is_rejected(tmp_path: Path) -> None:
    path = _write_official_dsa(tmp_path, [2], blobs_for=set())
    path.write_text(path.read_text().replace('"q_nope"', '"q_rope"'))
    with pytest.raises(WorkloadError, match="q_rope"):
        load_workloads("dsa_attention", tmp_path)


def test_official_file_that_is_not_jsonl_is_rejected(tmp_path: Path) -> None:
    path = _write_official_dsa(tmp_path, [2], blobs_for=set())
    path.write_text("{not json\n")
    with pytest.raises(WorkloadError, match="not a flashinfer-bench workload file"):
        load_workloads("dsa_attention", tmp_path)


# ---------------------------------------------------------------------------------------------
# Selection


def test_select_by_uuid_keeps_list_order_and_truncates(tmp_path: Path) -> None:
    workloads = load_workloads("moe", tmp_path)
    picked = select_workloads(workloads, [workloads[5].uuid, workloads[2].uuid, workloads[5].uuid])
    assert [w.index for w in picked] == [2, 5]
    assert select_workloads(workloads, max_count=3) == workloads[:3]
    assert select_workloads(workloads, [workloads[5].uuid, workloads[2].uuid], max_count=1) == [workloads[2]]
    assert select_workloads(workloads) == workloads


@pytest.mark.parametrize(
    ("uuids", "max_count", "message"),
    [
        (["no-such-uuid"], None, "unknown workload uuid.*no-such-uuid"),
        ([], None, "empty workload uuid list"),
        (None, 0, "must be >= 1"),
    ],
)
def test_bad_selection_is_rejected(
    uuids: list[str] | None, max_count: int | None, message: str, tmp_path: Path
) -> None:
    workloads = load_workloads("moe", tmp_path)
    with pytest.raises(WorkloadSelectionError, match=message):
        select_workloads(workloads, uuids, max_count)


def test_rows_say_which_inputs_were_synthesized_for_an_official_workload() -> None:
    from hopperbench.workloads import data_source_label

    embedded = load_workloads("moe")[0]
    assert data_source_label(embedded) == "synthesized"
    official = embedded.model_copy(update={"data_source": "official"})
    assert data_source_label(official) == "official"
    partial = embedded.model_copy(
        update={"data_source": "official", "missing_blob_inputs": ("hidden_states", "gemm1_weights")}
    )
    assert data_source_label(partial) == "official; synthesized: hidden_states,gemm1_weights"
