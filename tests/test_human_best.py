"""The human_best manifest (schema, the real file, its agreement with git) and the pin tool."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hopperbench.human_best import MANIFEST_PATH, ManifestError, load_manifest, parse_manifest
from hopperbench.integrity import check_submodule, read_gitlink
from hopperbench.paths import REPO_ROOT
from hopperbench.tracks import TRACKS


def _load_pin_tool() -> ModuleType:
    path = REPO_ROOT / "tools" / "pin_human_best.py"
    spec = importlib.util.spec_from_file_location("pin_human_best", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


pin_tool = _load_pin_tool()

VALID = """
[gdn_prefill]
team = "Team"
placement = "1st"
definition = "gdn_prefill_qk4_v8_d128_k_last"
submodule = "human_best/winner"
url = "https://github.com/owner/winner"
commit = "{commit}"
pin = "{pin}"
pin_reason = "why"
source_dir = "solution/triton"
solution_files = ["kernel.py"]
entry = "{entry}"
language = "triton"
destination_passing = true
license = "none"
availability = "is public"
"""


def manifest_text(commit: str = "a" * 40, pin: str = "later_commit", entry: str = "kernel.py::launch") -> str:
    return VALID.format(commit=commit, pin=pin, entry=entry)


# --- the real manifest ---------------------------------------------------------------------------


def test_real_manifest_covers_every_track() -> None:
    manifest = load_manifest()
    assert set(manifest) == {track.human_key for track in TRACKS.values()}
    for track in TRACKS.values():
        assert manifest[track.human_key].definition == track.definition_name


def test_real_manifest_known_pins_match_gitmodules_and_gitlinks() -> None:
    gitmodules = subprocess.run(
        ["git", "config", "-f", ".gitmodules", "--list"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout
    pinned = [e for e in load_manifest().values() if e.commit_known]
    assert pinned, "at least one winner has a known commit"
    for entry in pinned:
        assert f"submodule.{entry.submodule}.path={entry.submodule}" in gitmodules
        assert f"submodule.{entry.submodule}.url={entry.url}" in gitmodules
        # `git add -A` in the superproject would replace a gitlink by a local checkout's HEAD.
        assert read_gitlink(REPO_ROOT, entry.submodule)[0] == entry.commit, entry.submodule


def test_real_manifest_unknowns_are_explicit() -> None:
    manifest = load_manifest()
    moe = manifest["moe"]
    assert (moe.commit, moe.pin, moe.entry, moe.destination_passing) == ("unknown", "unknown", None, "unknown")
    gdn = manifest["gdn_prefill"]
    assert gdn.entry_function == "launch_gdn" and gdn.entry_confirmed and gdn.destination_passing is True
    assert manifest["dsa_attention"].entry_confirmed is False


def test_real_kachua_tree_when_present_is_reported_off_commit() -> None:
    entry = load_manifest()["gdn_prefill"]
    folder = entry.checkout_dir(REPO_ROOT)
    if not (folder / ".git").exists():
        pytest.skip("no local human_best/kachua-mlsys working tree")
    assert all(p.is_file() for p in entry.solution_paths(REPO_ROOT))
    state = check_submodule(entry).state
    # the assembled tree is not the pinned commit; a real checkout at the pin is "pinned"
    assert state in {"off_commit", "pinned"}


# --- validation ---------------------------------------------------------------------------------


def test_valid_manifest_parses() -> None:
    entry = parse_manifest(manifest_text())["gdn_prefill"]
    assert (entry.repo_slug, entry.name, entry.entry_file, entry.entry_function) == (
        "owner/winner", "winner", "kernel.py", "launch")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (manifest_text(commit="abc123"), "commit must be 40 lowercase hex digits"),
        (manifest_text(commit="A" * 40), "commit must be 40 lowercase hex digits"),
        (manifest_text(entry="kernel.py:launch"), "entry must be '<file>::<function>'"),
        (manifest_text(entry="kernel.py::a::b"), "entry must be '<file>::<function>'"),
        (manifest_text(entry="other.py::launch"), "not among solution_files"),
        (manifest_text(commit="unknown"), "does not fit commit"),
        (manifest_text(pin="deadline_tag"), "needs deadline_tag"),
        (manifest_text().replace("human_best/winner", "third_party/w"), "submodule must be 'human_best/<name>'"),
        (manifest_text().replace("https://github.com/owner/winner", "git@github.com:o/w"), "url must be"),
        (manifest_text() + "extra = 1\n", "extra"),
        (manifest_text().replace('team = "Team"\n', ""), "team"),
        ("not toml = = 1", "not valid TOML"),
    ],
)
def test_validation_errors_are_one_line(text: str, expected: str) -> None:
    with pytest.raises(ManifestError) as caught:
        parse_manifest(text, source="m.toml")
    message = str(caught.value)
    assert "\n" not in message and expected in message and message.startswith("m.toml")


def test_missing_manifest_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"^cannot read .*nope\.toml"):
        load_manifest(tmp_path / "nope.toml")


# --- the pin tool ---------------------------------------------------------------------------------

AOE = timezone(timedelta(hours=-12))


def tag(name: str, when: datetime) -> Any:
    return pin_tool.TagDate(tag=name, date=when, commit=name.ljust(40, "0")[:40])


def test_deadline_is_end_of_april_24_aoe() -> None:
    assert pin_tool.DEADLINE_UTC == datetime(2026, 4, 24, 23, 59, 59, tzinfo=AOE)


def test_select_deadline_tag_takes_the_latest_before_the_deadline() -> None:
    tags = [
        tag("v1", datetime(2026, 3, 1, tzinfo=UTC)),
        tag("v3", datetime(2026, 4, 24, 23, 59, 59, tzinfo=AOE)),  # the last second counts
        tag("v4", datetime(2026, 4, 25, 12, 0, 0, tzinfo=UTC)),  # one second late
        tag("v2", datetime(2026, 4, 20, tzinfo=UTC)),
    ]
    assert pin_tool.select_deadline_tag(tags).tag == "v3"
    assert pin_tool.select_deadline_tag(tags, accept=lambda t: t.tag != "v3").tag == "v2"
    assert pin_tool.select_deadline_tag(tags[2:3]) is None
    same_time = [tag("b", datetime(2026, 4, 1, tzinfo=UTC)), tag("a", datetime(2026, 4, 1, tzinfo=UTC))]
    assert pin_tool.select_deadline_tag(same_time).tag == "b"
    with pytest.raises(ValueError, match="without a timezone"):
        pin_tool.select_deadline_tag([tag("naive", datetime(2026, 4, 1))])


def test_parse_tag_refs_peels_annotated_tags() -> None:
    sep = "\x1f"
    text = (
        f"light{sep}2026-04-20T10:00:00+02:00{sep}{sep}{'1' * 40}\n"
        f"annot{sep}2026-04-21T10:00:00-12:00{sep}{'2' * 40}{sep}{'3' * 40}\n"
    )
    light, annotated = pin_tool.parse_tag_refs(text)
    assert (light.tag, light.commit, light.date.utcoffset()) == ("light", "1" * 40, timedelta(hours=2))
    assert (annotated.tag, annotated.commit) == ("annot", "2" * 40)


def test_update_manifest_text_rewrites_only_the_track() -> None:
    real = MANIFEST_PATH.read_text(encoding="utf-8")
    updates = {"commit": "b" * 40, "pin": "deadline_tag", "deadline_tag": "v1", "pin_reason": 'tag "v1"'}
    new = parse_manifest(pin_tool.update_manifest_text(real, "gdn_prefill", updates))
    old = parse_manifest(real)
    assert (new["gdn_prefill"].commit, new["gdn_prefill"].deadline_tag) == ("b" * 40, "v1")
    assert new["gdn_prefill"].pin_reason == 'tag "v1"'
    assert new["gdn_prefill"].hazards == old["gdn_prefill"].hazards
    assert new["dsa_attention"] == old["dsa_attention"] and new["moe"] == old["moe"]
    cleared = pin_tool.update_manifest_text(pin_tool.update_manifest_text(real, "gdn_prefill", updates),
                                            "gdn_prefill", {"deadline_tag": None, "pin": "later_commit"})
    assert parse_manifest(cleared)["gdn_prefill"].deadline_tag is None


def test_no_network_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    # Port 9 on loopback refuses at once: the same path as a machine without GitHub.
    code = pin_tool.main(["--track", "moe", "--url", "https://127.0.0.1:9/owner/repo", "--timeout", "20"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("pin_human_best: cannot reach https://127.0.0.1:9/owner/repo")
    assert "machine with GitHub access" in err


def test_pin_from_a_mirror_pins_the_deadline_tag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))

    def git(cwd: Path, *args: str, date: str | None = None) -> str:
        env_date = {"GIT_COMMITTER_DATE": date, "GIT_AUTHOR_DATE": date} if date else {}
        identity = {f"GIT_{who}_{field}": value for who in ("AUTHOR", "COMMITTER")
                    for field, value in (("NAME", "T"), ("EMAIL", "t@e"))}
        env = {**identity, "HOME": str(tmp_path), "GIT_CONFIG_NOSYSTEM": "1", "PATH": os.environ["PATH"], **env_date}
        return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True,
                              check=True).stdout.strip()

    mirror = tmp_path / "mirror"
    (mirror / "solution" / "triton").mkdir(parents=True)
    git(tmp_path, "init", "-q", "-b", "main", str(mirror))
    for n, (when, tag_name) in enumerate([("2026-04-10T00:00:00Z", "v1"), ("2026-04-24T20:00:00-12:00", "v2"),
                                          ("2026-05-10T00:00:00Z", "v3")]):
        (mirror / "solution" / "triton" / "kernel.py").write_text(f"def launch():\n    return {n}\n")
        git(mirror, "add", ".")
        git(mirror, "commit", "-q", "-m", tag_name, date=when)
        git(mirror, "tag", "-a", tag_name, "-m", tag_name, date=when)
    (mirror / "README").write_text("after the deadline\n")
    git(mirror, "add", ".")
    git(mirror, "commit", "-q", "-m", "head", date="2026-06-01T00:00:00Z")

    root = tmp_path / "super"
    (root / "human_best").mkdir(parents=True)
    git(tmp_path, "init", "-q", "-b", "main", str(root))
    (root / "human_best" / "manifest.toml").write_text(
        manifest_text(commit="unknown", pin="unknown", entry="kernel.py::launch"), encoding="utf-8")

    code = pin_tool.main(["--track", "gdn_prefill", "--from", str(mirror)], repo_root=root)
    assert code == 0
    entry = load_manifest(root / "human_best" / "manifest.toml")["gdn_prefill"]
    v2 = git(mirror, "rev-parse", "v2^{commit}")
    assert (entry.commit, entry.pin, entry.deadline_tag) == (v2, "deadline_tag", "v2")
    assert entry.head_commit == git(mirror, "rev-parse", "HEAD")
    assert entry.url == "https://github.com/owner/winner"  # the mirror is not what gets recorded
    assert read_gitlink(root, "human_best/winner") == (v2, "index")
    assert check_submodule(entry, root).state == "pinned"
    assert git(root, "config", "-f", ".gitmodules", "submodule.human_best/winner.url") == entry.url
