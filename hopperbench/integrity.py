"""The submodule guard: is each winner's code present, a checkout, at its pinned gitlink, and clean?

Definitions (one `PinState` per submodule, checked in this order):

- `unknown_commit`: the manifest has no commit and the superproject no gitlink for it.
- `mismatch`: the manifest's commit differs from the superproject's gitlink (index
  entry, else HEAD's tree), the gitlink is absent, or the path is tracked as plain
  files instead of a gitlink. The repository contradicts itself.
- `missing`: the submodule folder is absent or empty (a clone without
  `git submodule update --init`, or a machine that cannot reach GitHub).
- `not_a_checkout`: files are there but the folder has no `.git` of its own, or its
  repository has no commit.
- `off_commit`: the checkout's HEAD is not the gitlink.
- `modified`: tracked files differ from HEAD (`git status --porcelain`).
- `untracked`: files not tracked by the checkout are present.
- `pinned`: none of the above.

What the guard makes of it, per track (`HumanSide`):

- `pinned` -> the human side runs; rows say human_pinned = true.
- `unknown_commit`, `missing` -> `unavailable`: the track still runs ours against
  the reference, and rows say why the human column is empty (with the fix).
- every other state -> refused with `IntegrityError`, unless the track is in
  `allow_unpinned`: then `unpinned` (runs, rows say human_pinned = false) when code
  is present, else `unavailable`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from hopperbench.human_best import HumanEntry, load_manifest
from hopperbench.paths import REPO_ROOT
from hopperbench.tracks import TRACKS, Track

PinState = Literal[
    "pinned", "missing", "not_a_checkout", "off_commit", "modified", "untracked", "unknown_commit", "mismatch"
]
HumanSide = Literal["pinned", "unpinned", "unavailable"]

GITLINK_MODE = "160000"
PIN_TOOL = "tools/pin_human_best.py"
# States that mean "the code is there but is not what the manifest pins".
_REFUSABLE: frozenset[PinState] = frozenset({"mismatch", "not_a_checkout", "off_commit", "modified", "untracked"})


class IntegrityError(RuntimeError):
    """A pinned submodule is present but not at its pin; the message is one line."""


class GitError(RuntimeError):
    """A git command the guard relies on failed; the message is one line."""


class PinStatus(BaseModel):
    """The state of one submodule, with a one-line message naming the problem and the fix."""

    model_config = ConfigDict(frozen=True)

    state: PinState
    message: str
    # The superproject's gitlink and the checkout's HEAD, when they could be read.
    gitlink: str | None = None
    head: str | None = None
    # Whether a non-empty working tree exists (runnable when allowed unpinned).
    code_present: bool = False


class GuardResult(BaseModel):
    """What a run does with one track's human side."""

    model_config = ConfigDict(frozen=True)

    track: str
    human: HumanSide
    # Why the human column is empty or unpinned; None when pinned.
    reason: str | None
    status: PinStatus | None
    entry: HumanEntry | None

    @property
    def runs_human(self) -> bool:
        return self.human != "unavailable"

    @property
    def human_pinned(self) -> bool | None:
        """The rows' stamp: True pinned, False unpinned-but-allowed, None no human rows."""
        return {"pinned": True, "unpinned": False, "unavailable": None}[self.human]


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        raise GitError("git is not installed or not on PATH; the human_best guard needs it") from None


def _git_ok(args: list[str], cwd: Path) -> str:
    result = _git(args, cwd)
    if result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or ["no message"])[0]
        raise GitError(f"`git {' '.join(args)}` failed in {cwd}: {detail}")
    return result.stdout


def read_gitlink(repo_root: Path, submodule: str) -> tuple[str | None, str]:
    """The commit the superproject pins at `submodule`, and how it was found.

    The index counts first (a staged pin is the newest intent), then HEAD's tree.
    Returns (None, "tracked-as-files") when the path is tracked as ordinary files
    and (None, "absent") when nothing is tracked there.
    """
    for line in _git_ok(["ls-files", "--stage", "--", submodule], repo_root).splitlines():
        meta, _, path = line.partition("\t")
        mode, sha, _stage = meta.split()
        if path == submodule and mode == GITLINK_MODE:
            return sha, "index"
        return None, "tracked-as-files"
    has_head = _git(["rev-parse", "--verify", "--quiet", "HEAD"], repo_root).returncode == 0
    if has_head:
        for line in _git_ok(["ls-tree", "HEAD", "--", submodule], repo_root).splitlines():
            meta, _, path = line.partition("\t")
            mode, kind, sha = meta.split()
            if path == submodule and mode == GITLINK_MODE and kind == "commit":
                return sha, "HEAD"
            return None, "tracked-as-files"
    return None, "absent"


def _own_repository(folder: Path) -> bool:
    """True when `folder` is the top of its own git repository (not just inside ours)."""
    if not (folder / ".git").exists():
        return False
    result = _git(["rev-parse", "--show-toplevel"], folder)
    return result.returncode == 0 and Path(result.stdout.strip()).resolve() == folder.resolve()


def check_submodule(entry: HumanEntry, repo_root: Path = REPO_ROOT) -> PinStatus:
    """Check one winner's submodule against the manifest and the superproject's gitlink."""
    path = entry.submodule
    folder = entry.checkout_dir(repo_root)
    code_present = folder.is_dir() and any(folder.iterdir())
    pin_fix = f"run `{PIN_TOOL} --track {entry.track}` on a machine with GitHub access"
    superproject_is_checkout = _own_repository(repo_root)
    if not entry.commit_known and not superproject_is_checkout:
        return PinStatus(
            state="unknown_commit",
            message=f"{path}: no commit of {entry.repo_slug} is pinned (manifest says unknown); {pin_fix}",
            code_present=code_present,
        )
    if not superproject_is_checkout:
        # A copy of the tree without its .git (as shipped to a GPU host): no pin can be read.
        return PinStatus(
            state="mismatch",
            message=(
                f"{path}: cannot verify the pin, {repo_root} is not a git checkout (a copy without .git?); "
                f"run from a clone, or pass --allow-unpinned {entry.track} (rows stamped human_pinned=false)"
            ),
            code_present=code_present,
        )
    gitlink, found_in = read_gitlink(repo_root, path)

    if not entry.commit_known and gitlink is None and found_in == "absent":
        return PinStatus(
            state="unknown_commit",
            message=f"{path}: no commit of {entry.repo_slug} is pinned (manifest says unknown); {pin_fix}",
            code_present=code_present,
        )
    if found_in == "tracked-as-files":
        return PinStatus(
            state="mismatch",
            message=(
                f"{path} is tracked as plain files in the superproject, not as a submodule gitlink; "
                f"run `git rm -r --cached {path}` and {pin_fix}"
            ),
            code_present=code_present,
        )
    if gitlink != entry.commit:
        where = f"the gitlink ({found_in}) is {gitlink}" if gitlink else "the superproject has no gitlink"
        return PinStatus(
            state="mismatch",
            message=f"{path}: manifest pins {entry.commit} but {where}; {pin_fix} so both agree",
            gitlink=gitlink,
            code_present=code_present,
        )
    if not code_present:
        return PinStatus(
            state="missing",
            message=(
                f"{path} is missing: run `git submodule update --init {path}` on a machine that can reach GitHub"
            ),
            gitlink=gitlink,
        )
    if not _own_repository(folder):
        return PinStatus(
            state="not_a_checkout",
            message=(
                f"{path} has files but is not a git checkout of its own; move it aside and run "
                f"`git submodule update --init {path}`"
            ),
            gitlink=gitlink,
            code_present=True,
        )
    head_result = _git(["rev-parse", "--verify", "--quiet", "HEAD^{commit}"], folder)
    if head_result.returncode != 0:
        return PinStatus(
            state="not_a_checkout",
            message=(
                f"{path} is a git repository without a commit; run `git submodule update --init --force {path}`"
            ),
            gitlink=gitlink,
            code_present=True,
        )
    head = head_result.stdout.strip()
    if head != gitlink:
        return PinStatus(
            state="off_commit",
            message=(
                f"{path} is at {head[:12]}, not its pinned {gitlink}; run `git submodule update {path}` "
                f"(or `git -C {path} checkout {gitlink}`)"
            ),
            gitlink=gitlink,
            head=head,
            code_present=True,
        )
    porcelain = _git_ok(["status", "--porcelain", "--untracked-files=all", "--ignored=no"], folder).splitlines()
    modified = [line[3:] for line in porcelain if not line.startswith("??")]
    untracked = [line[3:] for line in porcelain if line.startswith("??")]
    if modified:
        return PinStatus(
            state="modified",
            message=(
                f"{path} has {len(modified)} modified file(s) ({_sample(modified)}); "
                f"run `git -C {path} checkout -- .` to restore the pinned files"
            ),
            gitlink=gitlink,
            head=head,
            code_present=True,
        )
    if untracked:
        return PinStatus(
            state="untracked",
            message=(
                f"{path} has {len(untracked)} untracked file(s) ({_sample(untracked)}); "
                f"run `git -C {path} clean -fd` (after saving anything you need)"
            ),
            gitlink=gitlink,
            head=head,
            code_present=True,
        )
    return PinStatus(
        state="pinned",
        message=f"{path} is at its pinned commit {gitlink} and clean",
        gitlink=gitlink,
        head=head,
        code_present=True,
    )


def _sample(paths: list[str], limit: int = 3) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (", ..." if len(paths) > limit else "")


def _unavailable_reason(entry: HumanEntry, status: PinStatus) -> str:
    who = f"{entry.team.split(' (')[0]}'s code ({entry.repo_slug})"
    if status.state == "unknown_commit":
        return (
            f"human side unavailable: {who} {entry.availability}; pin it with "
            f"`{PIN_TOOL} --track {entry.track}` on a machine with GitHub access"
        )
    return f"human side unavailable: {who} {entry.availability}: {status.message}"


def guard(
    tracks: Iterable[Track],
    allow_unpinned: set[str] | frozenset[str] = frozenset(),
    repo_root: Path = REPO_ROOT,
    manifest: dict[str, HumanEntry] | None = None,
) -> dict[str, GuardResult]:
    """Decide, per track, whether and how its human side runs; raise on a tampered pin.

    `manifest` defaults to `<repo_root>/human_best/manifest.toml`. Raises
    `IntegrityError` (one line) for the first track whose submodule is present but not
    at its pin, unless that track is in `allow_unpinned`.
    """
    unknown = sorted(set(allow_unpinned) - set(TRACKS))
    if unknown:
        raise IntegrityError(
            f"--allow-unpinned names unknown track(s) {', '.join(unknown)}; choose from {', '.join(TRACKS)}"
        )
    if manifest is None:
        manifest = load_manifest(repo_root / "human_best" / "manifest.toml")
    results: dict[str, GuardResult] = {}
    for track in tracks:
        entry = manifest.get(track.human_key)
        if entry is None:
            results[track.name] = GuardResult(
                track=track.name,
                human="unavailable",
                reason=f"human side unavailable: human_best/manifest.toml has no [{track.human_key}] table",
                status=None,
                entry=None,
            )
            continue
        status = check_submodule(entry, repo_root)
        results[track.name] = _decide(track.name, entry, status, allowed=track.name in allow_unpinned)
    return results


def _decide(track: str, entry: HumanEntry, status: PinStatus, allowed: bool) -> GuardResult:
    if status.state == "pinned":
        return GuardResult(track=track, human="pinned", reason=None, status=status, entry=entry)
    if status.state in _REFUSABLE:
        if not allowed:
            raise IntegrityError(
                f"{track}: {status.message} (or pass --allow-unpinned {track} to run it anyway, "
                "its rows stamped human_pinned=false)"
            )
        if status.code_present:
            reason = f"human side unpinned (allowed by --allow-unpinned {track}): {status.message}"
            return GuardResult(track=track, human="unpinned", reason=reason, status=status, entry=entry)
    return GuardResult(
        track=track, human="unavailable", reason=_unavailable_reason(entry, status), status=status, entry=entry
    )
