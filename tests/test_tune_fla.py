"""tools/tune_fla.py on the CPU: the choice over tunings, the grouping of records, the generated block of fla_gdn.py.
The tuning itself needs a GPU (run on the H200)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from hopperbench.tracks.gdn_prefill.adapters import fla_gdn

REPO_ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("tune_fla", REPO_ROOT / "tools" / "tune_fla.py")
assert spec is not None and spec.loader is not None
tune_fla = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tune_fla)

FAST = {"kwargs": {"BV": 64}, "num_warps": 4, "num_stages": 2, "num_ctas": 1, "maxnreg": None}
SLOW = {"kwargs": {"BV": 32}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}


def _json(fields: dict) -> str:
    return json.dumps(fields, sort_keys=True)


def test_the_choice_is_the_lowest_median_over_the_tunings() -> None:
    # FAST wins two tunings by a hair and loses one badly; SLOW is steadier but slower in the median.
    tunings = [
        {_json(FAST): 1.00, _json(SLOW): 1.01},
        {_json(FAST): 1.00, _json(SLOW): 1.02},
        {_json(FAST): 1.50, _json(SLOW): 1.03},
    ]
    assert tune_fla.choose(tunings) == (_json(FAST), 1.00, 2)
    tunings = [{_json(FAST): 1.10, _json(SLOW): 1.0}, {_json(FAST): 1.10, _json(SLOW): 1.2}, {_json(SLOW): 1.05}]
    assert tune_fla.choose(tunings) == (_json(SLOW), 1.05, 2)  # FAST, pruned once, is judged on the other two


@triton.autotune(
    configs=[triton.Config({"BLOCK": 16}, num_warps=4), triton.Config({"BLOCK": 32}, num_warps=8)], key=["N"]
)
@triton.jit
def _tuned(x, N, BLOCK: tl.constexpr):  # its launch and benchmark are stubbed: the tests run on the CPU
    pass


class _NoLaunch:
    def run(self, *args, **kwargs) -> None:
        pass


def test_each_tuning_is_recorded_once_with_its_timings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_tuned, "cache", {})
    monkeypatch.setattr(_tuned, "fn", _NoLaunch())
    monkeypatch.setattr(_tuned, "_bench", lambda *args, config, **kwargs: [config.kwargs["BLOCK"] / 10, 0.0, 0.0])
    x = torch.zeros(4)
    with tune_fla.recorded_autotuning() as records:
        _tuned.run(x, 4096, grid=(1,))
        _tuned.run(x, 4096, grid=(1,))  # the same key: no tuning, nothing recorded
        _tuned.run(x, 64, grid=(1,))
    assert len(records) == 2
    first = records[0]
    assert first["kernel"] == f"{__name__}._tuned" and first["key"] == [4096, "torch.float32"]
    assert first["timings"] == [
        [{"kwargs": {"BLOCK": 16}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}, 1.6],
        [{"kwargs": {"BLOCK": 32}, "num_warps": 8, "num_stages": 3, "num_ctas": 1, "maxnreg": None}, 3.2],
    ]
    assert records[1]["key"] == [64, "torch.float32"]
    pinned = tune_fla.aggregate(records)
    assert pinned[f"{__name__}._tuned"][0]["config"]["kwargs"] == {"BLOCK": 16}


def test_recording_ends_with_its_block() -> None:
    untuned = triton.runtime.autotuner.Autotuner.run
    with tune_fla.recorded_autotuning():
        assert triton.runtime.autotuner.Autotuner.run is not untuned
    assert triton.runtime.autotuner.Autotuner.run is untuned


def test_records_group_by_kernel_and_key() -> None:
    records = [
        {"kernel": "fla.a.k", "key": [4, 128, "torch.bfloat16"], "timings": [[FAST, 1.0], [SLOW, 2.0]]},
        {"kernel": "fla.a.k", "key": [4, 128, "torch.bfloat16"], "timings": [[FAST, 1.2], [SLOW, 1.1]]},
        {"kernel": "fla.a.k", "key": [4, 128, "torch.bfloat16"], "timings": [[FAST, 1.1], [SLOW, 1.9]]},
        {"kernel": "fla.a.k", "key": [4, 128], "timings": [[SLOW, 3.0], [FAST, 4.0]]},
        {"kernel": "fla.b.h", "key": [8], "timings": [[FAST, 0.5]]},
    ]
    pinned = tune_fla.aggregate(records)
    assert list(pinned) == ["fla.a.k", "fla.b.h"]
    by_key = {tuple(entry["key"]): entry for entry in pinned["fla.a.k"]}
    assert by_key[(4, 128, "torch.bfloat16")]["config"] == FAST
    assert by_key[(4, 128, "torch.bfloat16")]["picked_by"] == "2 of 3 tunings"
    assert by_key[(4, 128)]["config"] == SLOW and by_key[(4, 128)]["median_ms"] == 3.0


def test_the_generated_block_keeps_other_gpus_and_reads_back(tmp_path: Path) -> None:
    source = (REPO_ROOT / "hopperbench/tracks/gdn_prefill/adapters/fla_gdn.py").read_text()
    pinned = {"fla.a.k": [{"key": [4, True, "torch.float32"], "config": FAST, "median_ms": 1.0, "picked_by": "1 of 1"}]}
    other = {"NVIDIA_H100": {"fla.b.h": [{"key": [8], "config": SLOW}]}}
    rewritten = tune_fla.rewrite_block(source, "NVIDIA_H200", pinned, other)

    def outside_block(text: str) -> str:
        return text[: text.index(tune_fla.BLOCK_BEGIN)] + text[text.index(tune_fla.BLOCK_END) :]

    assert outside_block(rewritten) == outside_block(source)
    module = tmp_path / "fla_gdn_rewritten.py"
    module.write_text(rewritten)
    loaded_spec = importlib.util.spec_from_file_location("fla_gdn_rewritten", module)
    assert loaded_spec is not None and loaded_spec.loader is not None
    loaded = importlib.util.module_from_spec(loaded_spec)
    loaded_spec.loader.exec_module(loaded)
    assert loaded.PINNED_CONFIGS == {"NVIDIA_H100": other["NVIDIA_H100"], "NVIDIA_H200": pinned}
    with pytest.raises(tune_fla.TuneError, match="no generated block"):
        tune_fla.rewrite_block("no block here", "NVIDIA_H200", pinned, {})


def test_the_committed_block_is_a_table_of_pinnable_entries() -> None:
    for gpu, kernels in fla_gdn.PINNED_CONFIGS.items():
        assert gpu == fla_gdn.gpu_key(gpu)
        for kernel, entries in kernels.items():
            assert kernel.startswith("fla.") and entries
            for entry in entries:
                assert set(entry["config"]) == set(FAST) and isinstance(entry["key"], list)


def test_without_cuda_one_line_and_exit_2() -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU: the tool would tune")
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "tune_fla.py")], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip() == "tune_fla: needs a CUDA GPU"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla builds its configuration lists from the GPU's limits")
def test_the_committed_pins_are_configurations_fla_itself_offers() -> None:
    """A pin fla does not list among its kernel's configurations would time a kernel fla never runs."""
    try:
        fla_gdn.import_chunk_gated_delta_rule()
    except fla_gdn.LibraryUnavailableError as e:
        pytest.skip(str(e))
    autotuners = fla_gdn.fla_autotuners()
    for kernels in fla_gdn.PINNED_CONFIGS.values():
        for kernel, entries in kernels.items():
            offered = [tune_fla.config_fields(config) for config in autotuners[kernel].configs]
            for entry in entries:
                assert entry["config"] in offered, (kernel, entry["config"])
