"""kernels/moe/probes/l2_prefetch_probe.py: the chunk split and the argument checks (CPU), the compile of its three kernels (CPU), and on
a GPU (marked `gpu`) one short probe that prints its table."""

from __future__ import annotations

import argparse

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT

probe = load_module_by_path(REPO_ROOT / "kernels/moe/probes/l2_prefetch_probe.py", "l2_prefetch_probe")


@pytest.mark.parametrize("ctas, chunks", [(1, 14), (2, 14), (8, 14), (132, 14), (3, 1)])
def test_the_ctas_prefetch_every_chunk_once(ctas, chunks):
    issued = [chunk for cta in range(ctas) for chunk in probe.chunks_of_cta(cta, ctas, chunks)]
    assert sorted(issued) == list(range(chunks))


def test_bad_arguments_are_refused():
    with pytest.raises(argparse.ArgumentTypeError):
        probe._sm_counts("2,0")
    with pytest.raises(ValueError, match="multiple of 16"):
        probe._Prefetcher(1000)
    assert probe.main(["--megabytes", "0"]) == 2


def test_the_probe_kernels_compile_without_a_gpu():
    assert callable(probe.compiled_prefetcher(448 << 10))
    assert callable(probe.compiled_reader())
    assert callable(probe.compiled_spin())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_short_probe_prints_its_table(capsys):
    assert probe.main(["--megabytes", "2", "--chunk-kb", "64", "--sms", "1,4", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "cold" in out and len(out.splitlines()) == 4
