"""kernels/moe/probes/cta_placement.py: the placement check on made-up SM ids (CPU), the probe's compile (CPU), and on a GPU
(marked `gpu`) one launch whose every CTA reports a valid SM id."""

from __future__ import annotations

import pytest
import torch

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT

cta_placement = load_module_by_path(REPO_ROOT / "kernels/moe/probes/cta_placement.py", "cta_placement")


def test_counts_groups_whose_ctas_share_one_sm():
    # Breadth-first placement over 4 SMs with 3 CTAs each: CTA c on SM c mod 4.
    assert cta_placement.groups_on_one_sm([c % 4 for c in range(12)], 3) == 4
    # Depth-first placement: CTAs 0-2 on SM 0, ...: no group {c, c + 4, c + 8} is on one SM.
    assert cta_placement.groups_on_one_sm([c // 3 for c in range(12)], 3) == 0
    # Two groups swapped in their last slot: both lose, the others stay whole.
    smids = [c % 4 for c in range(12)]
    smids[8], smids[9] = smids[9], smids[8]
    assert cta_placement.groups_on_one_sm(smids, 3) == 2


def test_the_probe_compiles_without_a_gpu():
    assert callable(cta_placement._probe(66560))
    # MEDIUM_T's GEMM1 since v2.18 (the session-24 probe ran with the `mma.sync` three-CTA GEMM1's 66432 bytes); three
    # still fit an SM.
    assert cta_placement.three_cta_gemm1_smem_bytes() == 75776


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_cta_reports_an_sm(capsys):
    assert cta_placement.main(["--repeats", "1", "--smem-bytes", "66560"]) == 0
    assert "groups" in capsys.readouterr().out
