"""Off-list workloads (`--workload-list offlist`): the MoE routing rows, their recipe variants checked
with the reference's routing on the CPU, GDN's long sequences, and the runner's refusals, --list and
--dry-run (no GPU)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from hopperbench.paths import CANONICAL_RESULTS
from hopperbench.results import Journal, csv_path_for, read_results
from hopperbench.runner import RunnerHooks, main
from hopperbench.synth import SynthesisError, make_inputs, recipe_variants
from hopperbench.tracks import TRACKS
from hopperbench.tracks.moe import reference
from hopperbench.workloads import WorkloadError, WorkloadSpec, load_offlist, load_workloads, synthesized_workloads
from tests.test_runner_cli import calls, fake  # noqa: F401  (fake is a fixture)
from tests.test_runner_cli_checks import machine_untouched, one_line_error

ROUTING = {"routing_logits", "routing_bias", "local_expert_offset"}


def offlist(variant: str, seq_len: int) -> WorkloadSpec:
    return next(w for w in load_offlist("moe") if w.recipe_variant == variant and w.axes["seq_len"] == seq_len)


def local_assignments(workload: WorkloadSpec, trial: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token its count of local experts [T], and per local expert its tokens [32], by the reference."""
    inputs = make_inputs("moe", workload, seed=0, trial=trial, device="cpu", only=ROUTING)
    experts, _ = reference._route(inputs["routing_logits"], inputs["routing_bias"], 2.5)
    local = experts - int(inputs["local_expert_offset"])
    is_local = (local >= 0) & (local < reference.NUM_LOCAL_EXPERTS)
    return is_local.sum(dim=1), torch.bincount(local[is_local], minlength=reference.NUM_LOCAL_EXPERTS)


# ------------------------------------------------------------------------------------------
# The list and the spec


def test_the_moe_offlist_rows_are_synthesized_variants_with_their_own_uuids() -> None:
    rows = load_offlist("moe")
    assert [(w.recipe_variant, w.axes["seq_len"]) for w in rows] == [
        ("listed", 8192), ("eight_local", 2000), ("eight_local", 8192), ("zipf", 8192)
    ]  # fmt: skip
    assert [w.uuid for w in rows] == [f"offlist-moe-{w.recipe_variant}-{w.axes['seq_len']}" for w in rows]
    listed = load_workloads("moe")
    assert all(w.data_source == "synthesized" for w in rows)
    assert {w.row_name for w in rows}.isdisjoint(w.row_name for w in listed)
    assert {w.scalars["local_expert_offset"] for w in rows} <= {w.scalars["local_expert_offset"] for w in listed}
    assert {w.scalars["routed_scaling_factor"] for w in rows} == {w.scalars["routed_scaling_factor"] for w in listed}
    assert all(w.recipe_variant is None for w in listed)
    assert set(recipe_variants("moe")) == {w.recipe_variant for w in rows}


def test_a_recipe_variant_is_for_synthesized_workloads_only() -> None:
    fields = dict(track="moe", index=0, uuid="x", axes={"seq_len": 1}, scalars={}, recipe_variant="zipf")
    assert WorkloadSpec(**fields, data_source="synthesized").recipe_variant == "zipf"
    with pytest.raises(ValueError, match="only a synthesized workload"):
        WorkloadSpec(**fields, data_source="official")
    with pytest.raises(ValueError):
        WorkloadSpec(**{**fields, "recipe_variant": ""}, data_source="synthesized")


def _with_offlist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    path = tmp_path / "offlist.tsv"
    path.write_text(text)
    monkeypatch.setattr(type(TRACKS["moe"]), "offlist_path", property(lambda self: path))


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        ("0\tnew-uuid\t8\t32\t2.5\tskewed", "recipe variant 'skewed' is not one of the track's"),
        ("0\t{listed}\t8\t32\t2.5\tzipf", "the uuid of a listed workload"),
    ],
)
def test_an_offlist_row_with_an_unknown_variant_or_a_listed_uuid_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row: str, fragment: str
) -> None:
    listed = next(iter(synthesized_workloads("moe")))
    header = "index\tuuid\tseq_len\tlocal_expert_offset\trouted_scaling_factor\trecipe_variant\n"
    _with_offlist(tmp_path, monkeypatch, header + row.format(listed=listed) + "\n")
    with pytest.raises(WorkloadError, match=fragment):
        load_offlist("moe")


def test_a_listed_workload_cannot_name_a_variant_and_a_track_without_offlist_has_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(WorkloadError, match="has no off-list workloads"):
        load_offlist("dsa_attention")
    listed = TRACKS["moe"].workload_list_path.read_text().splitlines()
    rows = [line for line in listed if line and not line.startswith("#")]
    path = tmp_path / "workloads.tsv"
    path.write_text("\n".join([rows[0] + "\trecipe_variant", rows[1] + "\tzipf"]) + "\n")
    monkeypatch.setattr(type(TRACKS["moe"]), "workload_list_path", property(lambda self: path))
    with pytest.raises(WorkloadError, match="names a recipe variant"):
        load_workloads("moe", tmp_path / "no-data")


def test_an_unknown_variant_is_refused_by_the_synthesis() -> None:
    spec = offlist("zipf", 8192).model_copy(update={"recipe_variant": "nope", "axes": {"seq_len": 4}})
    with pytest.raises(SynthesisError, match="unknown recipe variant 'nope'"):
        make_inputs("moe", spec, 0, 0, "cpu", only=ROUTING)


# ------------------------------------------------------------------------------------------
# The routing variants, through the reference's routing


@pytest.mark.parametrize("seq_len", [2000, 8192])
def test_eight_local_routes_every_token_to_the_same_8_local_experts(seq_len: int) -> None:
    workload = offlist("eight_local", seq_len)
    chosen = set()
    for trial in range(3):
        per_token, per_expert = local_assignments(workload, trial)
        assert per_token.min() == per_token.max() == 8
        assert (per_expert > 0).sum() == 8 and set(per_expert[per_expert > 0].tolist()) == {seq_len}
        chosen.add(tuple(per_expert.nonzero().flatten().tolist()))
    assert len(chosen) == 3  # a fresh choice per input set


def test_zipf_skews_the_local_experts_beyond_the_listed_recipe() -> None:
    for trial in range(3):
        _, zipf = local_assignments(offlist("zipf", 8192), trial)
        _, listed = local_assignments(offlist("listed", 8192), trial)
        skew = zipf.max() / zipf.float().mean()
        assert skew > 10  # the busiest local expert: many times the mean
        assert skew > 1.5 * listed.max() / listed.float().mean()  # the bias alone skews the listed recipe
        assert (zipf > 0).sum() < (listed > 0).sum()


def test_the_variants_keep_the_other_inputs_and_stay_deterministic() -> None:
    small = {v: offlist(v, 8192 if v != "eight_local" else 2000).model_copy(update={"axes": {"seq_len": 16}})
             for v in recipe_variants("moe")}  # fmt: skip
    base = make_inputs("moe", small["listed"], 0, 1, "cpu", only=ROUTING)
    for spec in small.values():
        inputs = make_inputs("moe", spec, 0, 1, "cpu", only=ROUTING)
        again = make_inputs("moe", spec, 0, 1, "cpu", only=ROUTING)
        assert torch.equal(inputs["routing_logits"], again["routing_logits"])
        if spec.recipe_variant != "listed":
            assert not torch.equal(inputs["routing_logits"], base["routing_logits"])
    without_variant = small["listed"].model_copy(update={"recipe_variant": None})
    plain = make_inputs("moe", without_variant, 0, 1, "cpu", only=ROUTING)
    assert torch.equal(plain["routing_logits"], base["routing_logits"])  # the control is the listed recipe itself


# ------------------------------------------------------------------------------------------
# GDN's long sequences


def test_the_gdn_offlist_rows_are_the_issues_long_sequences() -> None:
    rows = load_offlist("gdn_prefill")
    assert [(w.uuid, w.axes["total_seq_len"], w.axes["num_seqs"]) for w in rows] == [
        ("offlist-gdn-single-8192", 8192, 1), ("offlist-gdn-single-32768", 32768, 1),
        ("offlist-gdn-single-65536", 65536, 1), ("offlist-gdn-one_long-8192", 8192, 33),
    ]  # fmt: skip
    assert set(recipe_variants("gdn_prefill")) == {w.recipe_variant for w in rows}
    for w in rows[:3]:
        bounds = make_inputs("gdn_prefill", w, 0, 0, "cpu", only={"cu_seqlens"})["cu_seqlens"]
        assert bounds.tolist() == [0, w.axes["total_seq_len"]]


def test_one_long_puts_one_long_sequence_beside_short_ones_and_changes_nothing_else() -> None:
    workload = load_offlist("gdn_prefill")[3]
    inputs = make_inputs("gdn_prefill", workload, 0, 1, "cpu")
    lengths = inputs["cu_seqlens"].diff().tolist()
    assert lengths == [8192 - 64 * 32] + [64] * 32
    listed = make_inputs("gdn_prefill", workload.model_copy(update={"recipe_variant": "listed"}), 0, 1, "cpu")
    assert not torch.equal(listed["cu_seqlens"], inputs["cu_seqlens"])
    for name in ("q", "k", "v", "state", "A_log", "a", "dt_bias", "b"):
        assert torch.equal(inputs[name], listed[name]), name
    too_many = workload.model_copy(update={"axes": {"total_seq_len": 640, "num_seqs": 10, "len_cu_seqlens": 11}})
    with pytest.raises(SynthesisError, match="no long sequence"):
        make_inputs("gdn_prefill", too_many, 0, 0, "cpu", only={"cu_seqlens"})


def test_the_gdn_dry_run_names_the_no_state_twins(fake: RunnerHooks, tmp_path: Path, capsys) -> None:  # noqa: F811
    out = tmp_path / "gdn_long_sequences.json"
    argv = ["--dry-run", "--track", "gdn_prefill", "--workload-list", "offlist", "--output", str(out)]
    assert main([*argv, "--no-pin-cpus", "--allow-unpinned", "gdn_prefill"], machine_untouched(fake)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "gdn_prefill: 4 workload(s), 4 of them also without state"
    variant = "total_seq_len=65536 num_seqs=1 len_cu_seqlens=2, recipe variant listed"
    assert f"  off-list 2: offlist-gdn-single-65536 ({variant})" in lines
    assert f"  off-list 2: offlist-gdn-single-65536 ({variant}, without state)" in lines


# ------------------------------------------------------------------------------------------
# The runner


def test_list_and_dry_run_show_the_offlist_rows(fake: RunnerHooks, tmp_path: Path, capsys) -> None:  # noqa: F811
    hooks = machine_untouched(fake)
    assert main(["--list", "--track", "moe", "--workload-list", "offlist"], hooks) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"moe\t{w.index}\t{w.uuid}\tseq_len={w.axes['seq_len']}\tsynthesized; recipe variant {w.recipe_variant}"
        for w in load_offlist("moe")
    ]
    out = tmp_path / "out" / "moe_routing.json"
    argv = ["--dry-run", "--track", "moe", "--workload-list", "offlist", "--output", str(out), "--no-pin-cpus"]
    assert main(argv, hooks) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        f"dry run: nothing run or written; output {out} (12 jobs)",
        "moe: 4 workload(s)",
        "  off-list 0: offlist-moe-listed-8192 (seq_len=8192, recipe variant listed)",
    ]
    assert "  off-list 3: offlist-moe-zipf-8192 (seq_len=8192, recipe variant zipf)" in lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--list", "--workload-list", "offlist"], "no off-list workloads for dsa_attention; pass --track gdn_prefill,moe"),
        (["--dry-run", "--track", "dsa_attention", "--workload-list", "offlist"], "pass --track gdn_prefill,moe"),
        (["--dry-run", "--track", "moe", "--workload-list", "offlist", "--output", str(CANONICAL_RESULTS)],
         "the canonical run holds the listed workloads only"),
        (["--track", "moe", "--workload-list", "sideways"], "invalid choice"),
    ],
)  # fmt: skip
def test_offlist_refusals_are_one_line(fake: RunnerHooks, argv: list[str], fragment: str, capsys) -> None:  # noqa: F811
    assert main(argv, machine_untouched(fake)) == 2
    assert fragment in one_line_error(capsys)


def test_an_offlist_run_records_its_list_and_variants_and_resumes_only_as_one(
    fake: RunnerHooks, tmp_path: Path, capsys  # noqa: F811
) -> None:
    out = tmp_path / "moe_routing.json"
    argv = ["--track", "moe", "--workload-list", "offlist", "--max-workloads", "2", "--iterations", "1"]
    assert main([*argv, "--output", str(out)], fake) == 0
    results = read_results(out)
    assert [(r.uuid, r.recipe_variant) for r in results.rows] == [
        ("offlist-moe-listed-8192", "listed"), ("offlist-moe-eight_local-2000", "eight_local")
    ]  # fmt: skip
    assert results.environment.protocol["workload_list"] == "offlist"
    with open(csv_path_for(out), newline="") as f:
        assert {line["recipe_variant"] for line in csv.DictReader(f)} == {"listed", "eight_local"}
    assert {c["uuid"] for c in calls(tmp_path)} == {"offlist-moe-listed-8192", "offlist-moe-eight_local-2000"}
    # A resume without the flag would add the listed rows to it: refused by the protocol check.
    out.unlink()
    csv_path_for(out).unlink()
    capsys.readouterr()
    assert main(["--track", "moe", "--iterations", "1", "--max-workloads", "2", "--output", str(out), "--resume"],
                fake) == 2  # fmt: skip
    assert "protocol differs in workload_list" in one_line_error(capsys)
    assert Journal(Journal.path_for(out)).exists()
