"""Check that results files name the commit whose files actually ran.

    uv run tools/verify_provenance.py results/h200/*.json

A results JSON's environment holds `repo_commit` (from git, or declared by whoever copied the
tree to the GPU host) and `repo_tree`, the git tree id of the files as they ran
(`hopperbench.environment.working_tree_id`). This checkout must know the commit; the files are
verified when `<commit>^{tree}` equals `repo_tree`.

A copy can also hold files that no commit tracks (a helper script carried to the GPU host that
the copy's git does not ignore): the tree id then differs. If the files the copy listed as
untracked (`repo_changes`, "??") exist here, and the commit's tree plus them is exactly
`repo_tree`, the code that ran is the commit's and the extra files are named. Likewise a copy can
leave tracked files out (`results/`, when the tree and the CuTe-DSL libraries would exceed the
GPU host's transfer limit): if the commit's tree less the files the copy listed as deleted
(" D") is exactly `repo_tree` (or less their whole top-level folders, since that list is cut
short), the code that ran is the commit's less those files, which are named by folder. Both can hold
at once (helper files added, results left out). One line per file (and one per track merged into it from another run, `track_runs`, each with its own commit);
exit 1 if any file's tree differs from its commit's (plus such untracked files) or names a commit
this checkout lacks, 0 otherwise (a file recorded before trees were recorded is reported as
unverifiable, not as a failure).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from enum import Enum
from pathlib import Path
from typing import Any

from hopperbench.environment import EnvironmentRecord, temporary_index
from hopperbench.paths import REPO_ROOT


class Verdict(str, Enum):
    VERIFIED = "verified"
    VERIFIED_PLUS_UNTRACKED = "verified plus untracked files"
    VERIFIED_LESS_DELETED = "verified less deleted files"
    VERIFIED_AS_COPIED = "verified plus untracked, less deleted files"
    MISMATCH = "MISMATCH"
    UNKNOWN_COMMIT = "UNKNOWN COMMIT"
    UNVERIFIABLE = "unverifiable"


def commit_tree(repo: Path, commit: str) -> str | None:
    done = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{commit}^{{tree}}"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    return done.stdout.strip() if done.returncode == 0 else None


def copied_tree(repo: Path, commit: str, extras: list[str], removed: list[str]) -> str | None:
    """The tree id of `commit`'s tree less `removed` (files or whole folders) plus `extras` (as they are
    in this checkout); None if one of the extras is missing here."""
    if not all((repo / path).is_file() for path in extras):
        return None
    with temporary_index(repo) as git:
        git("read-tree", commit)
        if removed:
            git("rm", "-r", "-q", "-f", "--cached", "--ignore-unmatch", "--", *removed)
        if extras:
            git("add", "-f", "--", *extras)
        return git("write-tree")


def tree_without(repo: Path, commit: str, paths: list[str]) -> str:
    """The tree id of `commit`'s tree with `paths` (files or whole folders) removed."""
    tree = copied_tree(repo, commit, [], paths)
    assert tree is not None  # no extras to miss
    return tree


def copy_explanations(extras: list[str], deleted: list[str]) -> list[tuple[list[str], list[str]]]:
    """What a copy may have added (its untracked files) and left out (the files it listed as deleted
    or, since the list is cut at REPO_CHANGES_LIMIT lines, their whole top-level folders), simplest
    first. The tree id's equality is the proof; the lists only propose."""
    folders = sorted({path.split("/", 1)[0] for path in deleted if "/" in path})
    candidates = [(extras, []), ([], deleted), ([], folders), (extras, deleted), (extras, folders)]
    return [(plus, less) for plus, less in candidates if plus or less]


def tracked_by(repo: Path, commit: str, path: str) -> bool:
    done = subprocess.run(["git", "-C", str(repo), "cat-file", "-e", f"{commit}:{path}"], capture_output=True, check=False)
    return done.returncode == 0


def untracked_in(changes: list[str] | None) -> list[str]:
    """The paths `git status --porcelain` listed as untracked ("?? path")."""
    return [line[3:] for line in changes or [] if line.startswith("?? ")]


def deleted_in(changes: list[str] | None) -> list[str]:
    """The paths `git status --porcelain` listed as deleted from the work tree (" D path")."""
    return [line[3:] for line in changes or [] if line.startswith(" D ")]


def count_by_folder(paths: list[str]) -> str:
    folders: dict[str, int] = {}
    for path in paths:
        folder = path.split("/", 1)[0] + "/" if "/" in path else path
        folders[folder] = folders.get(folder, 0) + 1
    return ", ".join(f"{folder} ({count} listed)" for folder, count in sorted(folders.items()))


def verdict_for(environment: EnvironmentRecord, repo: Path) -> tuple[Verdict, str]:
    commit, tree = environment.repo_commit, environment.repo_tree
    if commit is None or tree is None:
        return Verdict.UNVERIFIABLE, f"commit {commit or '-'}, no tree recorded"
    expected = commit_tree(repo, commit)
    if expected is None:
        return Verdict.UNKNOWN_COMMIT, f"commit {commit} is not in this checkout"
    # Untracked in the copy, whose .git may sit at an older commit: only files `commit` lacks.
    extras = [path for path in untracked_in(environment.repo_changes) if not tracked_by(repo, commit, path)]
    # Deleted against the copy's HEAD, which may be older than `commit`: a file `commit` itself
    # removed is listed too, but only the files `commit` has can have been left out of the copy.
    deleted = [path for path in deleted_in(environment.repo_changes) if tracked_by(repo, commit, path)]
    if expected != tree:
        for plus, less in copy_explanations(extras, deleted):
            if copied_tree(repo, commit, plus, less) == tree:
                return copy_verdict(environment, plus, less, deleted)
        changes = environment.repo_changes
        listed = "not recorded" if changes is None else ("; ".join(changes[:5]) or "none") + (" ..." if len(changes) > 5 else "")
        return Verdict.MISMATCH, (
            f"the files that ran (tree {tree[:12]}) are not commit {commit[:12]}'s; "
            f"the copy's changes against its HEAD {(environment.repo_git_head or '-')[:12]}: {listed}"
        )
    return Verdict.VERIFIED, f"files of commit {commit[:12]} ({environment.repo_commit_source})"


def copy_verdict(
    environment: EnvironmentRecord, plus: list[str], less: list[str], deleted: list[str]
) -> tuple[Verdict, str]:
    """The verdict on a copy that ran `commit`'s files plus `plus`, less `less`, and what it names."""
    commit = environment.repo_commit or ""
    detail = f"files of commit {commit[:12]} ({environment.repo_commit_source})"
    if plus:
        detail += f", plus {len(plus)} untracked file(s) no commit holds: {', '.join(plus)}"
    if less:
        what = count_by_folder(deleted) if less == deleted else (
            ", ".join(f"all of {folder}/" for folder in less) + f" ({len(deleted)} files listed)")
        detail += f", less what the copy left out: {what}"
    if plus and less:
        return Verdict.VERIFIED_AS_COPIED, detail
    return (Verdict.VERIFIED_PLUS_UNTRACKED if plus else Verdict.VERIFIED_LESS_DELETED), detail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results JSON files")
    args = parser.parse_args(argv)
    failed = False
    for path in args.results:
        try:
            environments = environments_of(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"{path}: not a results JSON ({type(e).__name__})", file=sys.stderr)
            return 2
        for track, environment in environments.items():
            verdict, detail = verdict_for(environment, REPO_ROOT)
            failed |= verdict in (Verdict.MISMATCH, Verdict.UNKNOWN_COMMIT)
            print(f"{path}{f' ({track})' if track else ''}: {verdict.value}: {detail}")
    return 1 if failed else 0


def environments_of(results: dict[str, Any]) -> dict[str, EnvironmentRecord]:
    """A results JSON's own environment (key "") and that of each track merged in from another run
    (`track_runs`, absent in files written before it existed)."""
    environments = {"": EnvironmentRecord.model_validate(results["environment"])}
    for track, run in results.get("track_runs", {}).items():
        environments[track] = EnvironmentRecord.model_validate(run["environment"])
    return environments


if __name__ == "__main__":
    sys.exit(main())
