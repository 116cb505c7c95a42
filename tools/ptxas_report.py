"""What ptxas says about our kernels: registers, spills and WGMMA pipeline remarks, per compiled entry.

    uv run tools/ptxas_report.py [--track gdn_prefill,moe,dsa_attention] [--allow Summary:C7512,...] [--module NAME]

Compiles every variant of each track's `kernels/<track>/kernel.py` (its `compile_only("sm_90a")`, no GPU needed;
`--module` names another module of the folder with a `compile_only`, such as a candidate's)
with the CuTe DSL's ptxas remarks on (`remarks{ptx}`), and prints one line per compiled entry: the launcher it
belongs to (in compile order), the kernel, its registers, its spill stores and the ptxas remarks of the
C75xx family. Those are the silent costly ones: C7512 "wgmma.mma_async instructions are serialized due to
insufficient register resources", C7517 / C7519 "warpgroup.wait / arrive injected" (a register the MMAs use is
touched inside their asynchronous window), each of which makes every MMA of the group wait for the previous one.

Exit 1 when a remark is not allowed by --allow (`<kernel substring>:<code>` pairs), 2 with one line on stderr when
the compile output holds no ptxas report (the DSL's format changed) or on bad arguments. Loads each track's kernels
under a package of its own, so that nothing compiled earlier in the process is reused.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TRACKS = ("gdn_prefill", "moe", "dsa_attention")
ARCH = "sm_90a"
REMARKS_OPTION = "remarks{ptx}"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_REMARK = re.compile(r"\((C75\d\d)\) (.*?) (?:in|for) (?:the )?function '([^']+)'")
_UNNAMED_REMARK = re.compile(r"\((C75\d\d)\) (.*)")  # e.g. C7507 / C7508, a `setmaxnreg` ignored


class ReportError(RuntimeError):
    """Why there is no report."""


@dataclass
class Entry:
    """One compiled kernel entry as ptxas reported it."""

    launcher: int  # which compile call of the track (0-based, in compile order)
    kernel: str
    registers: int | None = None
    spill_stores: int = 0
    spill_loads: int = 0
    remarks: list[tuple[str, str]] = field(default_factory=list)  # (code, message)


def short_name(mangled: str, package: str = "") -> str:
    """`kernel_cutlass_kernel_<package><module>_Summary_object_at__...` -> `kernel_<module>_Summary`."""
    name = re.sub(r"_object_at_.*", "", mangled)
    name = name.removeprefix("kernel_cutlass_")
    return name.replace(package, "") if package else name


def ptxas_lines(text: str) -> list[str]:
    """The ptxas report lines of the DSL's remark output: each block runs from "ptxas output:" to the next blank
    line, and a wrapped line (one not starting with "ptxas") is joined back to its start."""
    lines: list[str] = []
    in_block = False
    for raw in _ANSI.sub("", text).splitlines():
        line = raw.strip()
        if "ptxas output:" in line:
            in_block, line = True, line.split("ptxas output:", 1)[1].strip()
        elif not line:
            in_block = False
        if not in_block or not line:
            continue
        if line.startswith("ptxas") or not lines:
            lines.append(re.sub(r"\s+", " ", line))
        else:
            lines[-1] += " " + line
    return lines


def parse(text: str, launcher: int, package: str = "") -> list[Entry]:
    """The entries of one compile call's output, with their remarks: a remark that names its function goes to it,
    one that does not to the entry whose compilation it precedes (the last one if none follows)."""
    entries: dict[str, Entry] = {}
    current: Entry | None = None
    remarks: list[tuple[str, str, str]] = []
    unnamed: list[tuple[str, str]] = []
    for line in ptxas_lines(text):
        if m := _ENTRY.search(line):
            current = entries.setdefault(m.group(1), Entry(launcher, short_name(m.group(1), package)))
            remarks += [(m.group(1), code, message) for code, message in unnamed]
            unnamed = []
        elif m := _PROPERTIES.search(line):
            current = entries.setdefault(m.group(1), Entry(launcher, short_name(m.group(1), package)))
        elif (m := _SPILLS.search(line)) and current is not None:
            current.spill_stores, current.spill_loads = int(m.group(1)), int(m.group(2))
        elif (m := _REGISTERS.search(line)) and current is not None:
            current.registers = int(m.group(1))
        if m := _REMARK.search(line):
            remarks.append((m.group(3), m.group(1), m.group(2)))
        elif m := _UNNAMED_REMARK.search(line):
            unnamed.append((m.group(1), m.group(2).strip()))
    if unnamed and entries:
        last = next(reversed(entries))
        remarks += [(last, code, message) for code, message in unnamed]
    for function, code, message in remarks:
        entry = entries.setdefault(function, Entry(launcher, short_name(function, package)))
        if (code, message) not in entry.remarks:
            entry.remarks.append((code, message))
    return list(entries.values())


def compile_track(track: str, module: str = "kernel") -> list[Entry]:
    """Every entry of every launcher `kernels/<track>/<module>.py`'s compile_only builds."""
    import cutlass.cute as cute

    from hopperbench import devcheck

    package = f"ptxas_report_{track}"
    outputs: list[str] = []
    original = cute.compile

    def compile_with_remarks(*args, options: str = "", **kwargs):
        captured = io.StringIO()
        with contextlib.redirect_stderr(captured):
            compiled = original(*args, options=f"{options} {REMARKS_OPTION}".strip(), **kwargs)
        outputs.append(captured.getvalue())
        return compiled

    cute.compile = compile_with_remarks
    try:
        if not (REPO_ROOT / "kernels" / track / f"{module}.py").is_file():
            raise ReportError(f"kernels/{track}/{module}.py does not exist")
        devcheck.load_folder_module(REPO_ROOT / "kernels" / track, package, module).compile_only(ARCH)
    finally:
        cute.compile = original
    entries = [entry for i, text in enumerate(outputs) for entry in parse(text, i, package)]
    if not entries:
        raise ReportError(f"{track}: the compile output holds no ptxas report (has the DSL's remark format changed?)")
    return entries


def parse_allow(text: str) -> list[tuple[str, str]]:
    """`Summary:C7512,Gemm1:C7517` -> [("Summary", "C7512"), ("Gemm1", "C7517")]."""
    pairs = []
    for item in filter(None, text.split(",")):
        kernel, _, code = item.partition(":")
        if not kernel or not re.fullmatch(r"C75\d\d", code):
            raise ReportError(f"--allow takes <kernel substring>:C75xx pairs, got {item!r}")
        pairs.append((kernel, code))
    return pairs


def disallowed(entries: Iterable[Entry], allow: Sequence[tuple[str, str]]) -> list[tuple[Entry, str]]:
    """(entry, code) of every remark that no allowed pair matches."""
    return [
        (entry, code)
        for entry in entries
        for code, _ in entry.remarks
        if not any(kernel in entry.kernel and code == allowed for kernel, allowed in allow)
    ]


def line(track: str, entry: Entry) -> str:
    remarks = "; ".join(f"{code} {message}" for code, message in entry.remarks) or "-"
    return (
        f"{track:13} #{entry.launcher:<2} {entry.kernel:48} {entry.registers or '?':>3} regs"
        f"  {entry.spill_stores:4d} B spilled  {remarks}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--track", default=",".join(TRACKS), help="comma list of tracks (default all)")
    parser.add_argument("--allow", default="", help="remarks to accept: <kernel substring>:C75xx, comma list")
    parser.add_argument("--module", default="kernel", help="the module of each track's folder to compile (default kernel)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    try:
        tracks = [t for t in args.track.split(",") if t]
        unknown = [t for t in tracks if t not in TRACKS]
        if unknown or not tracks:
            raise ReportError(f"--track takes {', '.join(TRACKS)}, got {args.track!r}")
        allow = parse_allow(args.allow)
        report = {track: compile_track(track, args.module) for track in tracks}
    except ReportError as e:
        print(f"ptxas_report: {e}", file=sys.stderr)
        return 2
    for track, entries in report.items():
        for entry in entries:
            print(line(track, entry))
    bad = [(track, entry, code) for track, entries in report.items() for entry, code in disallowed(entries, allow)]
    for track, entry, code in bad:
        print(f"not allowed: {track} {entry.kernel} {code}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
