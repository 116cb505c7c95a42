"""Deterministic input synthesis: reproducibility, validity and exact definition shapes/dtypes.

Full-size DSA caches (624 MB) and MoE weights (1.4 GB) are too slow to draw on a CPU, so
DSA runs on stand-in workloads with few pages and MoE on its small inputs (`only=`); the
full MoE set is checked on a GPU.
"""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hopperbench.synth import SynthesisError, absent_optional_inputs, derive_seed, make_inputs
from hopperbench.tracks.gdn_prefill.synth import has_initial_state as gdn_has_initial_state
from hopperbench.workloads import BlobRef, WorkloadSpec, load_workloads, track_definition

# Everything but the 1.4 GB of fp8 weights.
MOE_SMALL_INPUTS = (
    "routing_logits",
    "routing_bias",
    "hidden_states",
    "hidden_states_scale",
    "gemm1_weights_scale",
    "gemm2_weights_scale",
)


def _embedded(track: str, tmp_path: Path) -> list[WorkloadSpec]:
    return load_workloads(track, data_dir=tmp_path)


def _gdn(total: int, num_seqs: int, uuid: str = "gdn-test") -> WorkloadSpec:
    axes = {"total_seq_len": total, "num_seqs": num_seqs, "len_cu_seqlens": num_seqs + 1}
    return WorkloadSpec(track="gdn_prefill", index=0, uuid=uuid, axes=axes, scalars={}, data_source="synthesized")


def _dsa(
    num_tokens: int, num_pages: int = 40, uuid: str = "dsa-test", blobs: dict[str, BlobRef] | None = None
) -> WorkloadSpec:
    """A DSA stand-in: the contest's 8462 pages would mean 624 MB of caches per call."""
    return WorkloadSpec(
        track="dsa_attention",
        index=0,
        uuid=uuid,
        axes={"num_tokens": num_tokens, "num_pages": num_pages},
        scalars={"sm_scale": 0.1352337788608801},
        data_source="official" if blobs else "synthesized",
        blob_inputs=blobs or {},
    )


def _gdn_with_state(want: bool) -> WorkloadSpec:
    """Synthesized workloads always get a state; an official one only when its blob holds it (here
    an official workload whose blob holds no tensor at all: everything else is synthesized)."""
    workload = _gdn(40, 3)
    return workload if want else workload.model_copy(update={"data_source": "official"})


def _digest(inputs: dict[str, object]) -> str:
    h = hashlib.sha256()
    for name, value in inputs.items():
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            h.update(value.contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def _assert_matches_definition(track: str, workload: WorkloadSpec, inputs: dict[str, object]) -> None:
    definition = track_definition(track)
    shapes = dict(zip(definition.inputs, definition.get_input_shapes(workload.axes), strict=True))
    dtypes = dict(zip(definition.inputs, definition.torch_input_dtypes, strict=True))
    for name, value in inputs.items():
        if shapes[name] is None:
            assert isinstance(value, (int, float)) and not isinstance(value, bool), name
        elif value is not None:
            assert tuple(value.shape) == tuple(shapes[name]), name
            assert value.dtype == dtypes[name], name


# ---------------------------------------------------------------------------------------------
# Determinism


def test_seed_derivation_is_a_stable_64_bit_hash() -> None:
    seed = derive_seed("gdn_prefill", "uuid", 0, 1, "q")
    assert 0 <= seed < 2**64
    assert seed == int.from_bytes(hashlib.sha256(b"gdn_prefill\x1fuuid\x1f0\x1f1\x1fq").digest()[:8], "little")


@pytest.mark.parametrize(
    ("track", "workload"),
    [("gdn_prefill", _gdn(50, 3)), ("dsa_attention", _dsa(4))],
)
def test_same_arguments_give_identical_bytes_and_trial_or_seed_change_them(track: str, workload: WorkloadSpec) -> None:
    first = make_inputs(track, workload, seed=7, trial=0, device="cpu")
    assert list(first) == list(track_definition(track).inputs)
    assert _digest(make_inputs(track, workload, seed=7, trial=0, device="cpu")) == _digest(first)
    for other in (
        make_inputs(track, workload, seed=7, trial=1, device="cpu"),
        make_inputs(track, workload, seed=8, trial=0, device="cpu"),
    ):
        for name, value in first.items():
            if isinstance(value, torch.Tensor) and value.numel() > 8:
                assert not torch.equal(value, other[name]), name


def test_inputs_are_identical_in_a_fresh_process() -> None:
    workload = _dsa(3)
    code = (
        "import hashlib, torch\n"
        "from hopperbench.synth import make_inputs\n"
        "from hopperbench.workloads import WorkloadSpec\n"
        f"w = WorkloadSpec.model_validate_json({workload.model_dump_json()!r})\n"
        "x = make_inputs('dsa_attention', w, seed=3, trial=2, device='cpu')\n"
        "h = hashlib.sha256()\n"
        "for n, v in x.items():\n"
        "    h.update(n.encode())\n"
        "    t = isinstance(v, torch.Tensor)\n"
        "    h.update(v.contiguous().view(torch.uint8).numpy().tobytes() if t else repr(v).encode())\n"
        "print(h.hexdigest())\n"
    )
    # Another hash seed and thread count must not matter either.
    env = {"PYTHONHASHSEED": "123", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == _digest(make_inputs("dsa_attention", workload, seed=3, trial=2, device="cpu"))


def test_a_subset_has_the_bytes_of_the_full_call() -> None:
    workload = _gdn(30, 2)
    full = make_inputs("gdn_prefill", workload, 0, 0, "cpu")
    subset = make_inputs("gdn_prefill", workload, 0, 0, "cpu", only={"cu_seqlens", "v"})
    assert list(subset) == ["v", "cu_seqlens"]
    assert torch.equal(subset["v"], full["v"]) and torch.equal(subset["cu_seqlens"], full["cu_seqlens"])


# ---------------------------------------------------------------------------------------------
# GDN prefill


@pytest.mark.parametrize(("total", "num_seqs"), [(6, 1), (7, 7), (134, 1), (300, 5), (1000, 57)])
def test_gdn_inputs_are_valid(total: int, num_seqs: int) -> None:
    workload = _gdn(total, num_seqs)
    x = make_inputs("gdn_prefill", workload, seed=0, trial=0, device="cpu")
    _assert_matches_definition("gdn_prefill", workload, x)
    cu = x["cu_seqlens"]
    assert cu[0] == 0 and cu[-1] == total
    assert bool((cu.diff() >= 1).all())
    for name in ("q", "k"):
        norms = x[name].float().norm(dim=-1)
        assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2), name
    assert x["scale"] == pytest.approx(1 / math.sqrt(128))
    assert bool(((x["A_log"].exp() >= 1) & (x["A_log"].exp() <= 16)).all())
    dt = torch.nn.functional.softplus(x["dt_bias"])
    assert bool(((dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001)).all())


def test_gdn_real_workloads_have_valid_shapes(tmp_path: Path) -> None:
    small = [w for w in _embedded("gdn_prefill", tmp_path) if w.axes["total_seq_len"] <= 300][:5]
    assert small
    for workload in small:
        x = make_inputs("gdn_prefill", workload, seed=0, trial=0, device="cpu")
        _assert_matches_definition("gdn_prefill", workload, x)
        assert int(x["cu_seqlens"][-1]) == workload.axes["total_seq_len"]


def test_gdn_fast_decay_regime_puts_dt_bias_near_zero() -> None:
    workload = _gdn(40, 2)
    mamba2 = make_inputs("gdn_prefill", workload, 0, 0, "cpu")
    fast = make_inputs("gdn_prefill", workload, 0, 0, "cpu", gate_regime="fast_decay")
    assert bool((fast["dt_bias"].abs() <= 0.1).all())
    assert bool((mamba2["dt_bias"] < -2.0).all())  # softplus^-1(0.1) = -2.25
    assert torch.equal(fast["A_log"], mamba2["A_log"]) and torch.equal(fast["q"], mamba2["q"])


def test_gdn_state_is_given_unless_an_official_blob_lacks_it(tmp_path: Path) -> None:
    with_state = make_inputs("gdn_prefill", _gdn_with_state(True), 0, 0, "cpu")
    without = make_inputs("gdn_prefill", _gdn_with_state(False), 0, 0, "cpu")
    assert without["state"] is None
    assert with_state["state"].dtype == torch.float32
    assert 0.15 < float(with_state["state"].std()) < 0.25
    assert all(gdn_has_initial_state(w) for w in _embedded("gdn_prefill", tmp_path))


def test_a_no_state_twin_gets_its_workloads_inputs_with_the_state_none(tmp_path: Path) -> None:
    workload = _gdn(40, 3)
    twin = workload.without("state")
    assert (twin.uuid, twin.axes, twin.withheld_inputs) == (workload.uuid, workload.axes, ("state",))
    assert twin.row_name != workload.row_name == workload.uuid
    assert absent_optional_inputs("gdn_prefill", twin) == {"state"}
    assert absent_optional_inputs("gdn_prefill", workload) == set()
    for seed, trial in ((0, 0), (0, 1), (3, 2)):
        given = make_inputs("gdn_prefill", workload, seed, trial, "cpu")
        without = make_inputs("gdn_prefill", twin, seed, trial, "cpu")
        assert list(without) == list(given) and without["state"] is None and given["state"] is not None
        others = [n for n in given if n != "state"]
        assert _digest({n: without[n] for n in others}) == _digest({n: given[n] for n in others})
    # An official state is withheld too; the other blobs and inputs stay.
    blob = tmp_path / "w.safetensors"
    state = torch.full((3, 8, 128, 128), 0.5)
    save_file({"state": state}, str(blob))
    official = workload.model_copy(
        update={"data_source": "official", "blob_inputs": {"state": BlobRef(path=blob, tensor_key="state")}}
    )
    assert torch.equal(make_inputs("gdn_prefill", official, 0, 0, "cpu")["state"], state)
    assert make_inputs("gdn_prefill", official.without("state"), 0, 0, "cpu")["state"] is None


def test_gdn_too_few_tokens_for_the_sequences_is_an_error() -> None:
    with pytest.raises(SynthesisError, match="cannot fill"):
        make_inputs("gdn_prefill", _gdn(3, 4), 0, 0, "cpu")


# ---------------------------------------------------------------------------------------------
# DSA


def _check_sparse_indices(indices: torch.Tensor, num_pages: int) -> tuple[int, int]:
    """Asserts the structural rules; returns (padded rows, full rows)."""
    padded = full = 0
    for row in indices:
        valid = row[row >= 0]
        assert bool((row >= -1).all())
        assert bool((valid < num_pages * 64).all())
        assert valid.unique().numel() == valid.numel()
        # -1 only as a suffix: the first L entries are the valid ones.
        assert bool((row[: valid.numel()] >= 0).all())
        padded += valid.numel() < row.numel()
        full += valid.numel() == row.numel()
    return padded, full


@pytest.mark.parametrize(("num_tokens", "num_pages"), [(1, 40), (2, 40), (8, 40), (7, 300)])
def test_dsa_inputs_are_valid(num_tokens: int, num_pages: int) -> None:
    workload = _dsa(num_tokens, num_pages)
    x = make_inputs("dsa_attention", workload, seed=1, trial=0, device="cpu")
    _assert_matches_definition("dsa_attention", workload, x)
    padded, full = _check_sparse_indices(x["sparse_indices"], num_pages)
    assert full >= 1
    assert padded == (0 if num_tokens == 1 else math.ceil(num_tokens / 4))
    assert x["sm_scale"] == workload.scalars["sm_scale"]
    # Scaled logits of std ~2: the cache std follows from sm_scale.
    expected_std = 2.0 / (x["sm_scale"] * math.sqrt(576))
    assert float(x["ckv_cache"].float().std()) == pytest.approx(expected_std, rel=0.05)


def test_dsa_rows_use_whole_pages_of_a_per_token_context() -> None:
    x = make_inputs("dsa_attention", _dsa(8, 300), 0, 0, "cpu")
    for row in x["sparse_indices"]:
        valid = row[row >= 0]
        pages = (valid // 64).unique()
        if valid.numel() < 2048:  # a short context: every slot of its pages but the last page's tail
            assert valid.numel() > 64 * (pages.numel() - 1)


def test_dsa_too_few_pages_is_an_error() -> None:
    with pytest.raises(SynthesisError, match="fewer than topk"):
        make_inputs("dsa_attention", _dsa(2, num_pages=31), 0, 0, "cpu")


def test_dsa_official_blob_is_loaded_and_checked(tmp_path: Path) -> None:
    blob = tmp_path / "w.safetensors"
    indices = torch.arange(2 * 2048, dtype=torch.int32).reshape(2, 2048)
    save_file({"sparse_indices": indices, "wrong": indices.to(torch.int64)}, str(blob))

    def with_blob(path: Path, key: str) -> WorkloadSpec:
        return _dsa(2, 64, blobs={"sparse_indices": BlobRef(path=path, tensor_key=key)})

    x = make_inputs("dsa_attention", with_blob(blob, "sparse_indices"), 0, 0, "cpu")
    assert torch.equal(x["sparse_indices"], indices)
    synthesized = make_inputs("dsa_attention", _dsa(2, 64), 0, 0, "cpu")
    assert torch.equal(x["ckv_cache"], synthesized["ckv_cache"])  # the blob shifts no other input
    with pytest.raises(SynthesisError, match="torch.int64"):
        make_inputs("dsa_attention", with_blob(blob, "wrong"), 0, 0, "cpu")
    with pytest.raises(SynthesisError, match="cannot load"):
        make_inputs("dsa_attention", with_blob(tmp_path / "none.safetensors", "x"), 0, 0, "cpu")


# ---------------------------------------------------------------------------------------------
# MoE


def test_moe_small_inputs_are_valid(tmp_path: Path) -> None:
    workload = next(w for w in _embedded("moe", tmp_path) if w.axes["seq_len"] == 7)
    x = make_inputs("moe", workload, seed=0, trial=0, device="cpu", only=MOE_SMALL_INPUTS)
    assert list(x) == [n for n in track_definition("moe").inputs if n in MOE_SMALL_INPUTS]
    _assert_matches_definition("moe", workload, x)
    hidden = x["hidden_states"].float()
    assert float(hidden.abs().max()) <= 2.0 and float(hidden.std()) > 0.8
    for name in ("hidden_states_scale", "gemm1_weights_scale", "gemm2_weights_scale"):
        assert bool((x[name] > 0).all()), name
    assert float(x["hidden_states_scale"].min()) >= 0.5 and float(x["hidden_states_scale"].max()) <= 1.5
    assert float(x["routing_bias"].float().abs().max()) < 1.0


def test_moe_scalars_come_from_the_workload(tmp_path: Path) -> None:
    workload = _embedded("moe", tmp_path)[0]
    x = make_inputs("moe", workload, 0, 0, "cpu", only={"local_expert_offset", "routed_scaling_factor"})
    assert x == {"local_expert_offset": 192, "routed_scaling_factor": 2.5}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_full_inputs_on_gpu_are_valid_and_deterministic(tmp_path: Path) -> None:
    workload = next(w for w in _embedded("moe", tmp_path) if w.axes["seq_len"] == 80)
    first = make_inputs("moe", workload, seed=0, trial=0, device="cuda")
    _assert_matches_definition("moe", workload, first)
    for name in ("gemm1_weights", "gemm2_weights"):
        assert float(first[name].float().abs().max()) <= 2.0, name
    again = make_inputs("moe", workload, seed=0, trial=0, device="cuda")
    for name, value in first.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value.view(torch.uint8), again[name].view(torch.uint8)), name


# ---------------------------------------------------------------------------------------------
# Argument errors


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(SynthesisError, match="belongs to track"):
        make_inputs("moe", _gdn(10, 1), 0, 0, "cpu")
    with pytest.raises(SynthesisError, match="gdn_prefill track only"):
        make_inputs("dsa_attention", _dsa(2), 0, 0, "cpu", gate_regime="fast_decay")
    with pytest.raises(SynthesisError, match="unknown gate regime"):
        make_inputs("gdn_prefill", _gdn(10, 1), 0, 0, "cpu", gate_regime="slow")  # type: ignore[arg-type]
    with pytest.raises(SynthesisError, match="not inputs"):
        make_inputs("gdn_prefill", _gdn(10, 1), 0, 0, "cpu", only={"nope"})
