"""kernels/dsa_attention/probes/dsa_gather_probe.py: the chunk map of a cache row and the runs (CPU), the argument checks (CPU), the compile of
its kernel (CPU), and on a GPU (marked `gpu`) one short probe that prints its table."""

from __future__ import annotations

import argparse

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT

probe = load_module_by_path(REPO_ROOT / "kernels/dsa_attention/probes/dsa_gather_probe.py", "dsa_gather_probe")


@pytest.mark.parametrize("row_id", [0, 1, 541_567])
def test_a_rows_chunks_cover_its_ckv_and_kpe_bytes_once(row_id):
    sources = [probe.chunk_source(row_id, chunk) for chunk in range(probe.CHUNKS_PER_ROW)]
    ckv = [offset for part, offset in sources if part == 0]
    kpe = [offset for part, offset in sources if part == 1]
    assert ckv == list(range(row_id * probe.CKV_BYTES, (row_id + 1) * probe.CKV_BYTES, probe.CHUNK))
    assert kpe == list(range(row_id * probe.KPE_BYTES, (row_id + 1) * probe.KPE_BYTES, probe.CHUNK))


@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_the_runs_cover_every_pair_within_one_ctas_shared_memory(tokens):
    pairs = tokens * probe.TOPK
    run = probe.rows_per_cta(pairs, 132)
    assert run * 132 >= pairs > (run - 1) * 132 and run <= probe.MAX_ROWS_PER_CTA


def test_bad_arguments_are_refused():
    with pytest.raises(argparse.ArgumentTypeError):
        probe._indices("0,-1")
    assert probe.main(["--repeats", "0"]) == 2
    assert probe.main(["--workloads", "23"]) == 2
    assert probe.main(["--ctas", "-1"]) == 2


def test_the_probe_kernel_compiles_without_a_gpu():
    assert callable(probe.compiled_gather())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_short_probe_prints_its_table(capsys):
    assert probe.main(["--workloads", "0", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and float(lines[-1].split()[5]) > 0
