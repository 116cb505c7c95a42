"""tools/ncu_stalls.py: the summary of an ncu source page (stall reasons, opcodes, hottest lines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT

stalls = load_module_by_path(REPO_ROOT / "tools/ncu_stalls.py", "ncu_stalls")

HEADER = ["Address", "Source", stalls.SAMPLES, stalls.EXECUTED, "stall_wait", "stall_barrier", "stall_wait (Not Issued)"]


def _export(*kernels: tuple[str, list[list[str]]]) -> list[list[str]]:
    lines: list[list[str]] = []
    for name, rows in kernels:
        lines += [["Kernel Name", name], HEADER, *rows]
    return lines


def test_reasons_and_opcodes_are_shares_of_all_samples_per_kernel():
    lines = _export(
        ("k1", [
            ["0x10", "  @P0 HMMA.16816.F32 R4, R8, R12, R4", "6", "100", "5", "1", "9"],
            ["0x20", "  BAR.SYNC.DEFER_BLOCKING 0x0", "3", "10", "0", "3", "9"],
            ["0x30", "  HMMA.16816.F32 R4, R8, R12, R4", "1", "100", "1", "0", "9"],
        ]),
        ("k2", [["0x10", "  EXIT", "2", "4", "2", "0", "0"]]),
    )
    first, second = stalls.parse(lines)
    summary = stalls.summarize(first, top=2)
    assert summary.samples == 10 and summary.executed == 210
    assert summary.by_reason == [("wait", 0.6), ("barrier", 0.4)]  # the "Not Issued" copies are not counted twice
    assert summary.by_opcode[0] == ("HMMA", 0.7, 200)  # the predicate is not the opcode
    assert [line for line, _, _ in summary.hottest] == ["@P0 HMMA.16816.F32 R4, R8, R12, R4", "BAR.SYNC.DEFER_BLOCKING 0x0"]
    assert summary.hottest[1][2][0] == "barrier"
    assert stalls.summarize(second, top=1).by_opcode == [("EXIT", 1.0, 4)]
    assert "wait 60.0%" in stalls.render(summary)


def test_an_export_without_sass_rows_or_samples_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(stalls.StallsError, match="no kernel"):
        stalls.parse([["Kernel Name", "k"], HEADER])
    with pytest.raises(stalls.StallsError, match="source counters"):
        stalls.parse([["Kernel Name", "k"], ["Address", "Source"], ["0x10", "EXIT"]])
    bad = tmp_path / "empty.csv"
    bad.write_text("")
    assert stalls.main([str(bad)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_by_role_cuts_a_warp_specialized_kernel_at_each_register_change():
    rows = [
        ["0x10", "  BAR.SYNC.DEFER_BLOCKING 0x0", "1", "8", "0", "1", "0"],
        ["0x20", "  USETMAXREG.DEALLOC.CTAPOOL 0x68", "0", "4", "0", "0", "0"],
        ["0x30", "  LDS R4, [R2]", "4", "40", "4", "0", "0"],
        ["0x40", "  USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xc8", "0", "8", "0", "0", "0"],
        ["0x50", "  BAR.SYNC.DEFER_BLOCKING R3, 0x180", "6", "16", "0", "6", "0"],
    ]
    (kernel,) = stalls.parse(_export(("ws", rows)))
    prologue, key, chain = stalls.split_by_role(kernel)
    assert [len(p.rows) for p in (prologue, key, chain)] == [1, 2, 2]
    assert prologue.name == "ws [prologue]" and chain.name == "ws [USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xc8]"
    assert stalls.summarize(key, top=1).by_reason[0] == ("wait", 1.0)
    assert stalls.summarize(chain, top=1).by_reason[0] == ("barrier", 1.0)
    (plain,) = stalls.parse(_export(("k", rows[:1])))
    assert stalls.split_by_role(plain) == [plain]
