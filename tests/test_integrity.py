"""The human_best guard on real temporary git repositories.

Each test builds a superproject with a genuine submodule (added from a local
"upstream" repository with `git submodule add`) plus a manifest that pins it, then
breaks one thing and checks the state the guard reports and what a run does.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from hopperbench.human_best import load_manifest
from hopperbench.integrity import IntegrityError, check_submodule, guard, read_gitlink
from hopperbench.tracks import TRACKS

SUBMODULE = "human_best/winner"
TRACK = TRACKS["gdn_prefill"]  # any registered track; its human_key names the manifest table


def git(cwd: Path, *args: str) -> str:
    result = subprocess.run(
        ["git", "-c", "protocol.file.allow=always", *args], cwd=cwd, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


@pytest.fixture(autouse=True)
def isolated_git(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No user or system git configuration; a fixed identity."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    for var in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{var}_NAME", "Test")
        monkeypatch.setenv(f"GIT_{var}_EMAIL", "test@example.com")


def write_manifest(root: Path, track: str, commit: str) -> None:
    pin = "unknown" if commit == "unknown" else "later_commit"
    (root / "human_best").mkdir(exist_ok=True)
    (root / "human_best" / "manifest.toml").write_text(
        f"""
[{track}]
team = "Test Team (A. Person)"
placement = "1st"
definition = "{TRACKS[track].definition_name}"
submodule = "{SUBMODULE}"
url = "https://github.com/example/winner"
commit = "{commit}"
pin = "{pin}"
pin_reason = "test"
source_dir = "solution"
solution_files = ["kernel.py"]
entry = "kernel.py::run"
language = "triton"
destination_passing = true
license = "none"
availability = "is not public"
""",
        encoding="utf-8",
    )


@pytest.fixture
def upstream(tmp_path: Path) -> Path:
    repo = tmp_path / "upstream"
    (repo / "solution").mkdir(parents=True)
    git(tmp_path, "init", "-q", "-b", "main", str(repo))
    (repo / "solution" / "kernel.py").write_text("def run():\n    return 1\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    return repo


@pytest.fixture
def superproject(tmp_path: Path, upstream: Path) -> Path:
    """A committed superproject whose submodule is checked out at its gitlink, clean."""
    root = tmp_path / "super"
    git(tmp_path, "init", "-q", "-b", "main", str(root))
    git(root, "submodule", "add", "-q", str(upstream), SUBMODULE)
    write_manifest(root, TRACK.human_key, commit=git(upstream, "rev-parse", "HEAD"))
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "pin")
    return root


def status_of(root: Path):
    return check_submodule(load_manifest(root / "human_best" / "manifest.toml")[TRACK.human_key], root)


def run_guard(root: Path, allow: set[str] = frozenset()):
    return guard([TRACK], allow_unpinned=set(allow), repo_root=root)[TRACK.name]


def test_clean_checkout_is_pinned_and_runs(superproject: Path, upstream: Path) -> None:
    status = status_of(superproject)
    assert status.state == "pinned"
    assert status.head == status.gitlink == git(upstream, "rev-parse", "HEAD")
    result = run_guard(superproject)
    assert (result.human, result.human_pinned, result.reason) == ("pinned", True, None)


def test_gitlink_in_the_index_counts_without_a_commit(tmp_path: Path, upstream: Path) -> None:
    root = tmp_path / "fresh"
    git(tmp_path, "init", "-q", "-b", "main", str(root))
    sha = git(upstream, "rev-parse", "HEAD")
    git(root, "update-index", "--add", "--cacheinfo", f"160000,{sha},{SUBMODULE}")
    assert read_gitlink(root, SUBMODULE) == (sha, "index")
    write_manifest(root, TRACK.human_key, commit=sha)
    assert status_of(root).state == "missing"  # the gitlink is honoured; only the working tree is absent


def test_gitlink_read_from_head_when_not_in_the_index(superproject: Path) -> None:
    sha = read_gitlink(superproject, SUBMODULE)[0]
    git(superproject, "rm", "-q", "--cached", SUBMODULE)
    assert read_gitlink(superproject, SUBMODULE) == (sha, "HEAD")


def test_missing_working_tree_is_unavailable_with_the_fix(superproject: Path) -> None:
    git(superproject, "submodule", "deinit", "-q", "-f", SUBMODULE)
    status = status_of(superproject)
    assert status.state == "missing" and not status.code_present
    assert f"git submodule update --init {SUBMODULE}" in status.message
    result = run_guard(superproject)
    assert result.human == "unavailable" and not result.runs_human and result.human_pinned is None
    assert result.reason is not None and result.reason.startswith("human side unavailable: Test Team's code")
    assert "\n" not in result.reason


def test_not_a_checkout_is_refused(superproject: Path) -> None:
    (superproject / SUBMODULE / ".git").unlink()  # a gitfile: the files stay, the repository link goes
    status = status_of(superproject)
    assert status.state == "not_a_checkout" and status.code_present
    with pytest.raises(IntegrityError, match="not a git checkout"):
        run_guard(superproject)


def test_off_commit_is_refused_unless_allowed(superproject: Path, upstream: Path) -> None:
    (upstream / "solution" / "kernel.py").write_text("def run():\n    return 2\n")
    git(upstream, "commit", "-q", "-am", "second")
    git(superproject / SUBMODULE, "pull", "-q", "origin", "main")
    status = status_of(superproject)
    assert status.state == "off_commit"
    assert status.head == git(upstream, "rev-parse", "HEAD") != status.gitlink
    with pytest.raises(IntegrityError) as refused:
        run_guard(superproject)
    message = str(refused.value)
    assert "\n" not in message and f"git submodule update {SUBMODULE}" in message and "--allow-unpinned" in message

    allowed = run_guard(superproject, allow={TRACK.name})
    assert (allowed.human, allowed.human_pinned, allowed.runs_human) == ("unpinned", False, True)
    assert allowed.reason is not None
    assert allowed.reason.startswith(f"human side unpinned (allowed by --allow-unpinned {TRACK.name})")


def test_modified_file_is_refused(superproject: Path) -> None:
    (superproject / SUBMODULE / "solution" / "kernel.py").write_text("def run():\n    return 3\n")
    status = status_of(superproject)
    assert status.state == "modified" and "solution/kernel.py" in status.message
    with pytest.raises(IntegrityError, match="modified"):
        run_guard(superproject)


def test_untracked_file_is_refused(superproject: Path) -> None:
    (superproject / SUBMODULE / "solution" / "extra.py").write_text("x = 1\n")
    status = status_of(superproject)
    assert status.state == "untracked" and "solution/extra.py" in status.message
    with pytest.raises(IntegrityError, match="untracked"):
        run_guard(superproject)


def test_manifest_gitlink_mismatch_is_refused(superproject: Path, upstream: Path) -> None:
    (upstream / "solution" / "kernel.py").write_text("def run():\n    return 2\n")
    git(upstream, "commit", "-q", "-am", "second")
    write_manifest(superproject, TRACK.human_key, commit=git(upstream, "rev-parse", "HEAD"))
    status = status_of(superproject)
    assert status.state == "mismatch"
    assert git(upstream, "rev-parse", "HEAD") in status.message and status.gitlink in status.message
    with pytest.raises(IntegrityError, match="manifest pins"):
        run_guard(superproject)


def test_files_tracked_instead_of_a_gitlink_is_a_mismatch(tmp_path: Path, upstream: Path) -> None:
    root = tmp_path / "vendored"
    git(tmp_path, "init", "-q", "-b", "main", str(root))
    shutil.copytree(upstream / "solution", root / SUBMODULE / "solution")
    git(root, "add", SUBMODULE)
    write_manifest(root, TRACK.human_key, commit=git(upstream, "rev-parse", "HEAD"))
    status = status_of(root)
    assert status.state == "mismatch" and "tracked as plain files" in status.message


def test_unknown_commit_is_unavailable_and_says_how_to_pin(tmp_path: Path) -> None:
    root = tmp_path / "nopin"
    git(tmp_path, "init", "-q", "-b", "main", str(root))
    write_manifest(root, TRACK.human_key, commit="unknown")
    assert status_of(root).state == "unknown_commit"
    result = run_guard(root, allow={TRACK.name})  # allowing unpinned cannot conjure code
    assert result.human == "unavailable"
    assert result.reason == (
        "human side unavailable: Test Team's code (example/winner) is not public; pin it with "
        f"`tools/pin_human_best.py --track {TRACK.human_key}` on a machine with GitHub access"
    )


def test_allowed_mismatch_without_code_is_unavailable(superproject: Path) -> None:
    write_manifest(superproject, TRACK.human_key, commit="0" * 40)
    git(superproject, "submodule", "deinit", "-q", "-f", SUBMODULE)
    result = run_guard(superproject, allow={TRACK.name})
    assert result.status is not None and result.status.state == "mismatch"
    assert result.human == "unavailable"


def test_allow_unpinned_rejects_unknown_track_names(superproject: Path) -> None:
    with pytest.raises(IntegrityError, match="unknown track"):
        run_guard(superproject, allow={"gdn_prefil"})


def test_tree_copied_without_git_cannot_verify_pins(tmp_path: Path) -> None:
    """A tree shipped without its .git (as to a GPU host) is refused with a message that says so."""
    from hopperbench.human_best import load_manifest
    from hopperbench.integrity import check_submodule

    entry = load_manifest()["gdn_prefill"]
    (tmp_path / entry.submodule).mkdir(parents=True)
    (tmp_path / entry.submodule / "kernel.py").write_text("x = 1\n")
    status = check_submodule(entry, tmp_path)
    assert status.state == "mismatch"
    assert "not a git checkout" in status.message
    assert "--allow-unpinned gdn_prefill" in status.message


def test_unknown_commit_stays_unavailable_in_a_tree_without_git(tmp_path: Path) -> None:
    from hopperbench.human_best import load_manifest
    from hopperbench.integrity import check_submodule

    status = check_submodule(load_manifest()["moe"], tmp_path)
    assert status.state == "unknown_commit"
