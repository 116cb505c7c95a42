"""Side resolution (availability and reasons) and building sides with flashinfer-bench on the CPU."""

from __future__ import annotations

import textwrap
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from flashinfer_bench import Definition

from hopperbench.human_best import HumanEntry
from hopperbench.sides import (
    SIDE_RESOLVERS,
    Side,
    SideContext,
    SideError,
    SideKind,
    canonical_side_order,
    known_side_names,
    run_start_up,
    sides_for,
)
from hopperbench.tracks import TRACKS, CandidateSide, LibrarySide

TRACK = TRACKS["gdn_prefill"]

DEFINITION = Definition(
    name="tiny_add",
    op_type="tiny",
    axes={"n": {"type": "var"}},
    inputs={"x": {"shape": ["n"], "dtype": "float32"}, "y": {"shape": ["n"], "dtype": "float32"}},
    outputs={"out": {"shape": ["n"], "dtype": "float32"}},
    reference="import torch\n\ndef run(x, y):\n    return x + 2 * y\n",
)


@pytest.fixture(autouse=True)
def fib_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIB_CACHE_PATH", str(tmp_path / "fib_cache"))


def human_entry(**overrides: object) -> HumanEntry:
    fields = dict(
        track="gdn_prefill",
        team="Team",
        placement="1st",
        definition=TRACK.definition_name,
        submodule="human_best/winner",
        url="https://github.com/someone/winner",
        commit="a" * 40,
        pin="later_commit",
        pin_reason="test",
        source_dir="solution/triton",
        solution_files=("kernel.py", "util.py"),
        entry="kernel.py::launch",
        language="triton",
        destination_passing=True,
        license="none",
        availability="is public but not checked out here",
    )
    return HumanEntry.model_validate({**fields, **overrides})


def ctx(root: Path, **kw: object) -> SideContext:
    return SideContext(repo_root=root, adapters_dir=root / "adapters", manifest={"gdn_prefill": human_entry()}, **kw)


def by_name(sides: list[Side]) -> dict[str, Side]:
    return {s.name: s for s in sides}


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_ours_unavailable_until_the_kernel_exists(tmp_path: Path) -> None:
    (ours,) = SIDE_RESOLVERS[SideKind.OURS](TRACK, ctx(tmp_path))
    assert not ours.available
    assert ours.reason == "kernels/gdn_prefill/kernel.py does not exist yet"
    with pytest.raises(SideError, match="unavailable"):
        ours.solution(DEFINITION)


def test_ours_carries_all_top_level_text_files_and_builds(tmp_path: Path) -> None:
    folder = tmp_path / "kernels" / "gdn_prefill"
    write(folder / "kernel.py", "from .helper import twice\n\ndef run(x, y, out):\n    out.copy_(x + twice(y))\n")
    write(folder / "helper.py", "def twice(t):\n    return 2 * t\n")
    write(folder / "NOTES.md", "notes\n")
    write(folder / ".hidden.py", "x = 1\n")
    (folder / "empty.py").write_text("")
    (folder / "blob.bin").write_bytes(b"\xff\xfe\x00\x81")
    write(folder / "sub" / "nested.py", "x = 1\n")

    (ours,) = SIDE_RESOLVERS[SideKind.OURS](TRACK, ctx(tmp_path))
    assert ours.available and ours.reason is None
    assert ours.files == ("NOTES.md", "helper.py", "kernel.py")
    assert ours.entry_point == "kernel.py::run"
    assert ours.destination_passing_style and ours.language == "python"

    solution = ours.solution(DEFINITION)
    assert solution.spec.target_hardware == ["cuda"]
    assert {s.path: s.content for s in solution.sources}["kernel.py"] == (folder / "kernel.py").read_text()
    runnable = ours.build(DEFINITION)
    x, y, out = torch.ones(3), torch.arange(3.0), torch.full((3,), float("nan"))
    runnable(x, y, out)
    assert torch.equal(out, torch.tensor([1.0, 3.0, 5.0]))


def test_reference_is_the_definitions_reference(tmp_path: Path) -> None:
    (reference,) = SIDE_RESOLVERS[SideKind.REFERENCE](TRACK, ctx(tmp_path))
    assert reference.available and not reference.destination_passing_style
    solution = reference.solution(DEFINITION)
    assert solution.spec.entry_point == "main.py::run"
    assert [s.content for s in solution.sources] == [DEFINITION.reference]
    result = reference.build(DEFINITION)(torch.ones(2), torch.ones(2))
    assert torch.equal(result, torch.full((2,), 3.0))


def test_human_side_from_the_manifest(tmp_path: Path) -> None:
    source = tmp_path / "human_best" / "winner" / "solution" / "triton"
    write(source / "kernel.py", "from .util import f\n\ndef launch(x, y, out):\n    out.copy_(f(x, y))\n")
    write(source / "util.py", "def f(x, y):\n    return x + 2 * y\n")
    write(source / "unrelated.py", "raise SystemExit('must not be packed')\n")

    guard = {"gdn_prefill": SimpleNamespace(runs_human=True, human_pinned=True, reason=None)}
    (human,) = SIDE_RESOLVERS[SideKind.HUMAN](TRACK, ctx(tmp_path, guard_results=guard))
    assert human.available and human.pinned is True
    assert human.files == ("kernel.py", "util.py")
    assert human.language == "triton" and human.destination_passing_style
    assert human.entry_point == "kernel.py::launch"
    assert "someone/winner@" + "a" * 40 in human.description
    solution = human.solution(DEFINITION)
    assert solution.spec.language == "triton"
    assert [s.path for s in solution.sources] == ["kernel.py", "util.py"]

    unpinned = {"gdn_prefill": SimpleNamespace(runs_human=True, human_pinned=False, reason="allowed")}
    (human,) = SIDE_RESOLVERS[SideKind.HUMAN](TRACK, ctx(tmp_path, guard_results=unpinned))
    assert human.available and human.pinned is False


def test_human_side_unavailable_reasons(tmp_path: Path) -> None:
    resolve = SIDE_RESOLVERS[SideKind.HUMAN]
    (human,) = resolve(TRACK, ctx(tmp_path))
    assert not human.available
    assert human.reason == "Team's code (https://github.com/someone/winner) is public but not checked out here"

    refused = {"gdn_prefill": SimpleNamespace(runs_human=False, human_pinned=None, reason="human side unavailable: x")}
    (human,) = resolve(TRACK, ctx(tmp_path, guard_results=refused))
    assert human.reason == "human side unavailable: x"

    unknown = human_entry(commit="unknown", pin="unknown", source_dir=None, solution_files=(), entry=None,
                          language="unknown", destination_passing="unknown", availability="is not public")  # fmt: skip
    (human,) = resolve(TRACK, replace_manifest(ctx(tmp_path), unknown))
    assert (
        not human.available
        and "is not public" in (human.reason or "")
        and "entry point is unknown" in (human.reason or "")
    )

    (human,) = resolve(TRACK, SideContext(repo_root=tmp_path, manifest={}))
    assert human.reason == "no [gdn_prefill] entry in human_best/manifest.toml"


def replace_manifest(context: SideContext, entry: HumanEntry) -> SideContext:
    return context.model_copy(update={"manifest": {"gdn_prefill": entry}})


def test_library_sides(tmp_path: Path) -> None:
    track = replace(
        TRACK,
        libraries=(
            LibrarySide(name="libok", entry="lib_ok.py::run", description="ok"),
            LibrarySide(name="libmissing", entry="lib_missing.py::run", description="no adapter"),
            LibrarySide(name="libpkg", entry="lib_ok.py::run", description="pkg", package="surely-not-installed==1.0"),
            LibrarySide(name="libold", entry="lib_ok.py::run", description="pkg", package="pydantic<1"),
            # Imported from its checkout: needs the files. Built from it: the installed version pins it.
            LibrarySide(name="libsrc", entry="lib_ok.py::run", description="src", submodule="third_party/lib"),
            LibrarySide(
                name="libbuilt", entry="lib_ok.py::run", description="built", submodule="third_party/lib",
                package="pydantic>=2",
            ),
        ),
    )
    write(tmp_path / "adapters" / "lib_ok.py", "def run(x, y, out):\n    out.copy_(x + 2 * y)\n")
    sides = by_name(SIDE_RESOLVERS[SideKind.LIBRARY](track, ctx(tmp_path)))
    assert sides["libok"].available and sides["libok"].files == ("lib_ok.py",)
    assert sides["libok"].destination_passing_style and sides["libok"].kind == SideKind.LIBRARY
    assert sides["libmissing"].reason == "adapters/lib_missing.py does not exist yet"
    assert sides["libpkg"].reason == "package surely-not-installed is not installed (needs surely-not-installed==1.0)"
    assert "the adapter needs pydantic<1" in (sides["libold"].reason or "")
    assert sides["libsrc"].reason == "third_party/lib is not checked out"
    assert sides["libbuilt"].available
    out = torch.empty(2)
    sides["libok"].build(DEFINITION)(torch.ones(2), torch.ones(2), out)
    assert torch.equal(out, torch.full((2,), 3.0))


def test_sides_for_a_real_track_lists_every_kind_in_order(tmp_path: Path) -> None:
    sides = sides_for(TRACK, ctx(tmp_path))
    assert [s.name for s in sides][:3] == ["ours", "human", "reference"]
    libraries = [lib.name for lib in TRACK.libraries]
    assert [s.name for s in sides][3 : 3 + len(libraries)] == libraries
    assert [s.name for s in sides][3 + len(libraries) :] == [c.name for c in TRACK.candidates]
    assert [s.kind for s in sides][3 + len(libraries) :] == [SideKind.CANDIDATE] * len(TRACK.candidates)


def test_a_candidate_is_built_from_the_kernel_folder_and_judged_like_ours(tmp_path: Path) -> None:
    folder = tmp_path / "kernels" / "tiny"
    folder.mkdir(parents=True)
    (folder / "kernel.py").write_text("def run(x, y, out):\n    out.copy_(x + y)\n")
    (folder / "faster.py").write_text("def run(x, y, out):\n    out.copy_(x + y)\n")
    track = replace(
        TRACK,
        kernel_entry="kernels/tiny/kernel.py::run",
        candidates=(
            CandidateSide(name="cand_faster", entry="faster.py::run", description="a candidate"),
            CandidateSide(name="cand_gone", entry="gone.py::run", description="not written"),
        ),
    )
    sides = by_name(sides_for(track, ctx(tmp_path)))
    faster = sides["cand_faster"]
    assert faster.available and faster.kind == SideKind.CANDIDATE and faster.entry_point == "faster.py::run"
    assert set(faster.files) == {"kernel.py", "faster.py"}  # it may import the current kernel
    assert sides["cand_gone"].reason == "kernels/tiny/gone.py does not exist"
    out = torch.empty(2)
    faster.build(DEFINITION)(torch.ones(2), torch.ones(2), out)
    assert torch.equal(out, torch.full((2,), 2.0))
    moe = TRACKS["moe"]
    assert moe.acceptance_for("candidate") == moe.acceptance_for("ours") != moe.acceptance_for("library")


def test_the_start_up_runs_in_the_module_the_built_entry_reads(tmp_path: Path) -> None:
    # What the start-up sets up (MoE's L2 partition map) must be what the built `run` sees: the module the builder
    # imported, not a second copy of the file.
    folder = tmp_path / "kernels" / "tiny"
    write(folder / "kernel.py", """
        STARTED = []


        def warm_up(device):
            STARTED.append(str(device))


        def run(x, y, out):
            out.copy_(x + y * len(STARTED))
    """)
    write(folder / "faster.py", "from .kernel import run, warm_up  # noqa: F401\n")
    track = replace(
        TRACK,
        kernel_entry="kernels/tiny/kernel.py::run",
        kernel_start_up="warm_up",
        candidates=(CandidateSide(name="cand_faster", entry="faster.py::run", description="a candidate"),),
    )
    sides = by_name(sides_for(track, ctx(tmp_path)))
    assert sides["ours"].start_up == sides["cand_faster"].start_up == "warm_up"
    assert sides["human"].start_up is None and sides["reference"].start_up is None
    for name in ("ours", "cand_faster"):
        runnable = sides[name].build(DEFINITION)
        run_start_up(sides[name], runnable, torch.device("cpu"))
        out = torch.empty(2)
        runnable(torch.ones(2), torch.ones(2), out)
        assert torch.equal(out, torch.full((2,), 2.0))
    assert TRACKS["moe"].kernel_start_up == "warm_up" and TRACKS["gdn_prefill"].kernel_start_up is None


def test_a_start_up_missing_from_the_entry_module_is_an_error(tmp_path: Path) -> None:
    write(tmp_path / "kernels" / "tiny" / "kernel.py", "def run(x, y, out):\n    out.copy_(x + y)\n")
    track = replace(TRACK, kernel_entry="kernels/tiny/kernel.py::run", kernel_start_up="warm_up")
    (ours,) = SIDE_RESOLVERS[SideKind.OURS](track, ctx(tmp_path))
    with pytest.raises(SideError, match="no function warm_up"):
        run_start_up(ours, ours.build(DEFINITION), torch.device("cpu"))


def test_candidate_names_carry_the_prefix_results_rely_on() -> None:
    with pytest.raises(ValueError, match="cand_"):
        CandidateSide(name="chunked", entry="chunked.py::run", description="x")
    assert canonical_side_order(["fla", "reference", "cand_b", "human", "ours", "cand_a"]) == [
        "ours", "cand_a", "cand_b", "human", "reference", "fla"
    ]  # fmt: skip


def test_a_library_may_not_take_a_fixed_name(tmp_path: Path) -> None:
    track = replace(TRACK, libraries=(LibrarySide(name="reference", entry="x.py::run", description="clash"),))
    with pytest.raises(SideError, match="may not be called"):
        sides_for(track, ctx(tmp_path))


def test_side_names_and_order() -> None:
    assert known_side_names([TRACKS["moe"]])[:3] == ["ours", "human", "reference"]
    all_names = known_side_names(TRACKS.values())
    assert all(lib.name in all_names for t in TRACKS.values() for lib in t.libraries)
    assert canonical_side_order(["zz", "reference", "aa", "ours", "human"]) == [
        "ours",
        "human",
        "reference",
        "aa",
        "zz",
    ]


def test_side_round_trips_through_a_job_file(tmp_path: Path) -> None:
    side = Side(name="ours", kind=SideKind.OURS, track="moe", available=True, source_dir=tmp_path, files=("kernel.py",),
                entry_point="kernel.py::run")  # fmt: skip
    assert Side.model_validate_json(side.model_dump_json()) == side


def test_our_kernels_compile_for_the_architecture_the_runner_gives_cute_dsl() -> None:
    """Each track's kernel module compiles for the CUTE_DSL_ARCH that workers get (WORKER_DEFAULTS)."""
    import sys

    from hopperbench.definitions import load_definition
    from hopperbench.runner import WORKER_DEFAULTS

    for track in TRACKS.values():
        (ours,) = [side for side in sides_for(track) if side.name == "ours"]
        module = sys.modules[ours.build(load_definition(track)).metadata.misc["module_name"]]
        assert module.GPU_ARCH == WORKER_DEFAULTS["CUTE_DSL_ARCH"], track.name
