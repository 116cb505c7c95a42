"""tools/ptxas_report.py: its reading of the CuTe DSL's ptxas remarks, and the guard it gives every kernel of ours:
no WGMMA group serialized by ptxas but the known ones (compiled here for sm_90a, no GPU needed)."""

from __future__ import annotations

import pytest

from hopperbench.devcheck import load_module_by_path
from hopperbench.paths import REPO_ROOT

report = load_module_by_path(REPO_ROOT / "tools/ptxas_report.py", "ptxas_report")

# The context-parallel summary walks a 256-row state on four warpgroups, 128 registers a thread: ptxas serializes
# its MMAs (kernels/gdn_prefill/NOTES.md, "Context-parallel path"). Any other such remark is a regression.
KNOWN = "context_parallel_Summary:C7512"

ESC = "\x1b"
# Both layouts the DSL prints (4.8.1): a one-line remark whose report follows on the next lines, and a remark with
# a source frame whose report is indented and wrapped at ~100 columns.
CANNED = f"""{ESC}[96mremark[ptxas info]:{ESC}[0m ptxas output: ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kernel_cutlass_kernel_pkgtoken_serial_Recurrence_object_at__tensorptr_0' for 'sm_90a'
ptxas info    : Function properties for kernel_cutlass_kernel_pkgtoken_serial_Recurrence_object_at__tensorptr_0
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 62 registers, used 1 barriers


  --> kernels/gdn_prefill/chunked.py:173:26
   |
> 173 |     start = cutlass.Int32(cu_seqlens[seq])
  {ESC}[96mremark:{ESC}[0m Spilled values are placed in local memory and can add memory traffic and latency. ptxas
          reports spill usage at kernel granularity.

          ptxas output:
          ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are
          serialized due to insufficient register resources for the function
          'kernel_cutlass_kernel_pkgcontext_parallel_Summary_object_at__tensorptr_2'
          ptxas info    : Compiling entry function
          'kernel_cutlass_kernel_pkgcontext_parallel_Summary_object_at__tensorptr_2'
          for 'sm_90a'
          ptxas info    : Function properties for
          kernel_cutlass_kernel_pkgcontext_parallel_Summary_object_at__tensorptr_2
          ptxas         .     56 bytes stack frame, 52 bytes spill stores, 48 bytes spill loads
          ptxas info    : Used 128 registers, used 1 barriers, 56 bytes cumulative stack size

"""  # noqa: E501


def test_entries_carry_their_registers_spills_and_remarks_across_wrapped_lines() -> None:
    entries = {e.kernel: e for e in report.parse(CANNED, 3, "pkg")}
    assert set(entries) == {"kernel_token_serial_Recurrence", "kernel_context_parallel_Summary"}
    serial, summary = entries["kernel_token_serial_Recurrence"], entries["kernel_context_parallel_Summary"]
    assert (serial.launcher, serial.registers, serial.spill_stores, serial.remarks) == (3, 62, 0, [])
    assert (summary.registers, summary.spill_stores, summary.spill_loads) == (128, 52, 48)
    assert [code for code, _ in summary.remarks] == ["C7512"]
    assert "serialized due to insufficient register resources" in summary.remarks[0][1]


def test_a_remark_naming_no_function_goes_to_the_entry_it_precedes() -> None:
    # ptxas's setmaxnreg remarks name no function; unreported, a kernel silently runs on its launch registers.
    text = (
        "ptxas output: ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg' ignored; unable to determine"
        " register count at entry.\n"
        "ptxas info    : Compiling entry function 'kernel_cutlass_kernel_pkgwarp_chain_Adaptive_object_at__t_0'\n"
        "ptxas info    : Used 168 registers, used 16 barriers\n"
    )
    (entry,) = report.parse(text, 0, "pkg")
    assert entry.kernel == "kernel_warp_chain_Adaptive" and [code for code, _ in entry.remarks] == ["C7508"]


def test_a_remark_is_allowed_only_by_a_matching_kernel_and_code() -> None:
    entries = report.parse(CANNED, 0, "pkg")
    assert report.disallowed(entries, report.parse_allow("Summary:C7512")) == []
    assert [code for _, code in report.disallowed(entries, report.parse_allow("Summary:C7517"))] == ["C7512"]
    assert [code for _, code in report.disallowed(entries, report.parse_allow("Recurrence:C7512"))] == ["C7512"]


def test_bad_arguments_and_an_empty_report_exit_2_in_one_line(capsys) -> None:
    assert report.main(["--track", "nope"]) == 2
    assert capsys.readouterr().err.strip().startswith("ptxas_report: --track takes")
    assert report.main(["--allow", "Summary"]) == 2
    assert "--allow takes" in capsys.readouterr().err
    assert report.main(["--track", "gdn_prefill", "--module", "no_such_module"]) == 2
    assert "kernels/gdn_prefill/no_such_module.py does not exist" in capsys.readouterr().err
    assert report.parse("no report here", 0) == []


@pytest.mark.parametrize("track", report.TRACKS)
def test_no_kernel_of_ours_has_its_wgmma_serialized_but_the_known_one(track: str, capsys) -> None:
    assert report.main(["--track", track, "--allow", KNOWN]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out.splitlines()
    assert printed and all(line.startswith(track) for line in printed)
