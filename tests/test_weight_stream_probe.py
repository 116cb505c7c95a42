"""kernels/moe/probes/weight_stream_probe.py: each form's stages cover an item once (CPU), the configuration checks (CPU), the
compile of every probed form (CPU), and on a GPU (marked `gpu`) one short probe that prints its table."""

from __future__ import annotations

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT

probe = load_module_by_path(REPO_ROOT / "kernels/moe/probes/weight_stream_probe.py", "weight_stream_probe")
CHUNKS_PER_STAGE = probe.STAGE_BYTES // probe.CHUNK


@pytest.mark.parametrize("form", ["rows", "contiguous"])
def test_the_copies_of_an_items_stages_read_each_of_its_bytes_once(form):
    offsets = [
        probe.stage_chunk_offset(form, stage, chunk)
        for stage in range(probe.STAGES_PER_ITEM)
        for chunk in range(CHUNKS_PER_STAGE)
    ]
    assert sorted(offsets) == list(range(0, probe.ITEM_BYTES, probe.CHUNK))


def test_the_rows_form_reads_512_bytes_of_every_row_per_stage_a_warp_per_row():
    stage = 3
    for row in range(probe.ITEM_ROWS):
        warp_chunks = range(32 * row, 32 * row + 32)  # one warp's copy instruction when COPIES_PER_THREAD is walked
        offsets = [probe.stage_chunk_offset("rows", stage, chunk) for chunk in warp_chunks]
        first = row * probe.ROW_BYTES + stage * probe.ROW_STAGE_BYTES
        assert offsets == list(range(first, first + probe.ROW_STAGE_BYTES, probe.CHUNK))
        assert probe.bulk_row_offset(stage, row) == first


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="form must be"):
        probe.ProbeConfig("gather")
    with pytest.raises(ValueError, match="stages >= 2"):
        probe.ProbeConfig("rows", stages=1)
    with pytest.raises(ValueError, match="do not fit"):
        probe.ProbeConfig("bulk", stages=8, ctas_per_sm=2)
    assert probe.main(["--repeats", "0"]) == 2


@pytest.mark.parametrize("config", probe.CONFIGS, ids=lambda config: config.label)
def test_every_probed_form_compiles_without_a_gpu(config):
    assert callable(probe.compiled_probe(config))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_short_probe_prints_its_table(capsys):
    assert probe.main(["--items", "264", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 + len(probe.CONFIGS)
    assert all(float(line.split()[-1]) > 0 for line in lines[2:])
