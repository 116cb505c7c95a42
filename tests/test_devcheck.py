"""hopperbench/devcheck.py: the plumbing shared by kernels/<track>/probes/device_check_*.py and the kernel tests.

CPU: loading by path, case selection, the common flags, the no-device exit, the table format,
error isolation between checks, exit codes, in-place input refill, NaN totals of a verdict; the
check_cases modules import nothing but torch (their folders are packed as solutions).
GPU (marked `gpu`): CUDA-event timing and graph capture.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hopperbench import devcheck
from hopperbench.acceptance import check_outputs
from hopperbench.paths import REPO_ROOT
from hopperbench.tracks import get_track

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# The device check of each kernel folder: (folder, the check's short name).
TOOLS = [("dsa_attention", "dsa"), ("gdn_prefill", "gdn"), ("moe", "moe")]


@dataclass(frozen=True)
class _Case:
    name: str


CASES = (_Case("a"), _Case("b"), _Case("c"))


def test_load_module_by_path_registers_the_module_before_running_it(tmp_path: Path):
    source = tmp_path / "probe.py"
    # A dataclass looks its module up in sys.modules while the module runs.
    source.write_text(
        textwrap.dedent(
            """
            from dataclasses import dataclass

            @dataclass
            class Point:
                x: int

            ORIGIN = Point(0)
            """
        )
    )
    module = devcheck.load_module_by_path(source, "devcheck_probe_module")
    try:
        assert sys.modules["devcheck_probe_module"] is module
        assert module.ORIGIN.x == 0
    finally:
        del sys.modules["devcheck_probe_module"]


def test_load_module_by_path_rejects_a_file_python_cannot_load(tmp_path: Path):
    not_python = tmp_path / "notes.txt"
    not_python.write_text("no module here")
    with pytest.raises(ImportError, match="notes.txt"):
        devcheck.load_module_by_path(not_python, "devcheck_not_python")


def test_select_cases_keeps_the_command_line_order_and_skips_empty_names():
    assert devcheck.select_cases(CASES, "") == list(CASES)
    assert [c.name for c in devcheck.select_cases(CASES, "c,a")] == ["c", "a"]
    assert [c.name for c in devcheck.select_cases(CASES, "b,")] == ["b"]


def test_select_cases_names_the_unknown_cases_and_the_choices_in_one_line():
    with pytest.raises(devcheck.UnknownCaseError) as info:
        devcheck.select_cases(CASES, "a,zz,yy")
    message = str(info.value)
    assert "zz, yy" in message and "a, b, c" in message and "\n" not in message


def test_case_check_parser_has_the_common_flags_with_per_tool_defaults():
    parser = devcheck.case_check_parser("probe", iters=50, warmup=10)
    defaults = parser.parse_args([])
    assert (defaults.iters, defaults.warmup, defaults.cases, defaults.seed) == (50, 10, "", 0)
    given = parser.parse_args(["--iters", "3", "--warmup", "1", "--cases", "a,b", "--seed", "7"])
    assert (given.iters, given.warmup, given.cases, given.seed) == (3, 1, "a,b", 7)


def test_require_cuda_says_why_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devcheck.require_cuda("probe_tool") is False
    captured = capsys.readouterr()
    assert captured.err == "probe_tool: no CUDA device\n" and captured.out == ""


@pytest.mark.parametrize(("folder", "track"), TOOLS)
def test_device_check_tools_exit_2_with_one_line_without_cuda(folder, track, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = REPO_ROOT / "kernels" / folder / "probes" / f"device_check_{track}.py"
    tool = devcheck.load_module_by_path(path, f"device_check_{track}_probe")
    assert tool.main([]) == devcheck.EXIT_NO_DEVICE
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and f"device_check_{track}" in captured.err
    assert captured.out == ""


def test_table_aligns_like_fixed_width_format_strings():
    table = devcheck.Table("case", 6, (devcheck.Column("T", 3), devcheck.Column("err", 9, ".2e")))
    assert table.header() == f"{'case':<6} {'T':>3} {'err':>9}"
    assert table.row("t1", 5, 1.5e-3) == f"{'t1':<6} {5:>3} {1.5e-3:>9.2e}"
    assert table.row("t1", 5, 1.5e-3, note=" (run)").endswith("1.50e-03 (run)")
    # Every row as wide as the header, so the columns line up.
    assert len(table.row("t1", 5, 1.5e-3)) == len(table.header())


def test_table_prints_a_missing_statistic_as_a_dash_and_rejects_a_wrong_value_count():
    table = devcheck.Table("case", 4, (devcheck.Column("err", 9, ".2e"),))
    assert table.row("x", None) == f"{'x':<4} {'-':>9}"
    with pytest.raises(ValueError, match="2 values for 1 columns"):
        table.row("x", 1.0, 2.0)


def test_run_checks_reports_an_exception_and_runs_the_next_check(capsys):
    ran: list[str] = []
    cleanups: list[int] = []

    def broken() -> bool:
        ran.append("broken")
        raise RuntimeError("launch failed\nsecond line")

    def fine() -> bool:
        ran.append("fine")
        return True

    passed = devcheck.run_checks(
        [("broken_case", broken), ("fine_case", fine)], 12, after_each=lambda: cleanups.append(1)
    )
    assert passed is False
    assert ran == ["broken", "fine"] and len(cleanups) == 2
    captured = capsys.readouterr()
    assert captured.out == f"{'broken_case':<12} ERROR RuntimeError: launch failed\n"
    assert "Traceback" in captured.err


def test_run_checks_fails_on_a_failed_check_and_passes_when_all_pass():
    assert devcheck.run_checks([("a", lambda: True), ("b", lambda: False)], 4) is False
    assert devcheck.run_checks([("a", lambda: True), ("b", lambda: True)], 4) is True


def test_finish_prints_the_summary_and_returns_the_exit_code(capsys):
    assert devcheck.finish(True) == devcheck.EXIT_PASSED == 0
    assert devcheck.finish(False) == devcheck.EXIT_FAILED == 1
    assert capsys.readouterr().out == "ALL PASSED\nSOME CASES FAILED\n"


def test_load_and_compile_compiles_once_and_reports_the_time(capsys):
    compiled: list[str] = []
    kernel = type(sys)("devcheck_fake_kernel")
    kernel.compile_only = lambda: compiled.append("sm_90a")
    assert devcheck.load_and_compile(lambda: kernel, "sm_90a, probe") is kernel
    assert compiled == ["sm_90a"]
    out = capsys.readouterr().out
    assert out.startswith("compile: ") and out.endswith(" s (sm_90a, probe)\n")


def test_refill_inputs_copies_tensors_in_place_and_leaves_scalars():
    static = {"x": torch.zeros(3), "scale": 0.5}
    storage = static["x"].data_ptr()
    devcheck.refill_inputs(static, {"x": torch.arange(3.0), "scale": 2.0})
    assert static["x"].data_ptr() == storage
    assert static["x"].tolist() == [0.0, 1.0, 2.0]
    assert static["scale"] == 0.5  # captured into the graph; a replay cannot change it


def test_total_nan_sums_the_outputs_and_is_unknown_when_one_could_not_be_compared():
    rule = get_track("dsa_attention").acceptance
    ref = {"output": torch.zeros(2, 3), "lse": torch.zeros(2)}
    out = {"output": torch.zeros(2, 3), "lse": torch.zeros(2)}
    out["output"][0, 1] = math.nan
    out["lse"][1] = math.nan
    assert devcheck.total_nan(check_outputs(rule, out, ref)) == 2
    wrong_shape = {"output": torch.zeros(2, 4), "lse": torch.zeros(2)}
    assert devcheck.total_nan(check_outputs(rule, wrong_shape, ref)) is None


def test_check_cases_modules_import_only_torch():
    # Their folders are packed as solutions without hopperbench: hopperbench may only be
    # imported lazily, inside the functions that need it.
    paths = [str(REPO_ROOT / f"kernels/{track}/check_cases.py") for track in ("dsa_attention", "gdn_prefill", "moe")]
    script = textwrap.dedent(
        f"""
        import importlib.util, sys
        for index, path in enumerate({paths!r}):
            spec = importlib.util.spec_from_file_location(f"probe_cases_{{index}}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            assert module.CASES, path
        loaded = sorted(name for name in sys.modules if name.split(".")[0] == "hopperbench")
        print(",".join(loaded))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


@pytest.mark.gpu
@needs_cuda
def test_median_time_and_graph_capture_on_the_device():
    x = torch.ones(1 << 20, device="cuda")
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        x.mul_(2.0)

    median = devcheck.median_cuda_time_us(step, warmup=2, iters=5)
    assert median > 0 and len(calls) == 7
    graph = devcheck.capture_graph(step)  # one eager call, one captured
    x.fill_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert float(x[0]) == 2.0
