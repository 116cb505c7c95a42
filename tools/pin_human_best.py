"""Pin a contest winner's repository as the `human_best/` submodule of one track.

    uv run python tools/pin_human_best.py --track gdn_prefill            # resolve, check out, record
    uv run python tools/pin_human_best.py --track moe --url https://github.com/OWNER/REPO
    uv run python tools/pin_human_best.py --track dsa_attention --dry-run  # resolve, print, record nothing
    uv run python tools/pin_human_best.py --track gdn_prefill --from /path/to/mirror.git  # offline mirror

Needs network access to GitHub. The organisers scored, per definition, the latest
tag pushed before the kernel deadline (2026-04-24 23:59 AoE = 2026-04-25 11:59 UTC),
so the pin is that tag's commit when one exists (and contains the solution's entry
file), else the branch head. The tool checks the commit out in the submodule,
stages the gitlink (`git update-index`), writes `.gitmodules` and updates the
track's table in `human_best/manifest.toml`; commit those three yourself.

Exit status: 0 pinned, 1 bad input or local failure, 2 the remote cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from hopperbench.human_best import MANIFEST_PATH, ManifestError, load_manifest, parse_manifest
from hopperbench.integrity import GitError, check_submodule
from hopperbench.paths import REPO_ROOT

# 23:59:59 on 2026-04-24 in AoE (UTC-12); a tag dated at or before this counts.
DEADLINE_UTC = datetime(2026, 4, 25, 11, 59, 59, tzinfo=UTC)
EXIT_BAD_INPUT = 1
EXIT_NO_NETWORK = 2
_FIELD_SEP = "\x1f"


class PinError(RuntimeError):
    """A pin step failed; the message is one line."""


class RemoteUnreachable(PinError):
    """The winner's repository cannot be reached from this machine."""


@dataclass(frozen=True)
class TagDate:
    """A tag, the commit it points at, and its date (tagger date, or commit date if lightweight)."""

    tag: str
    date: datetime
    commit: str


def select_deadline_tag(
    tags: Iterable[TagDate],
    deadline: datetime = DEADLINE_UTC,
    accept: Callable[[TagDate], bool] = lambda _tag: True,
) -> TagDate | None:
    """The latest tag dated at or before `deadline` that `accept` admits, or None.

    Ties on the date go to the lexically greatest name so the choice is
    deterministic. Dates must be timezone-aware (git prints offsets; AoE is UTC-12).
    """
    candidates = []
    for tag in tags:
        if tag.date.tzinfo is None:
            raise ValueError(f"tag {tag.tag!r} has a date without a timezone: {tag.date.isoformat()}")
        if tag.date <= deadline:
            candidates.append(tag)
    for tag in sorted(candidates, key=lambda t: (t.date, t.tag), reverse=True):
        if accept(tag):
            return tag
    return None


def parse_tag_refs(text: str) -> list[TagDate]:
    """Parse `git for-each-ref refs/tags` output in TAG_REF_FORMAT."""
    tags = []
    for line in text.splitlines():
        if not line.strip():
            continue
        name, date, peeled, obj = line.split(_FIELD_SEP)
        tags.append(TagDate(tag=name, date=datetime.fromisoformat(date), commit=peeled or obj))
    return tags


TAG_REF_FORMAT = _FIELD_SEP.join(
    ["%(refname:strip=2)", "%(creatordate:iso-strict)", "%(*objectname)", "%(objectname)"]
)


def parse_ls_remote_head(text: str) -> str | None:
    """The commit of `HEAD` in `git ls-remote` output, if listed."""
    for line in text.splitlines():
        sha, _, ref = line.partition("\t")
        if ref == "HEAD":
            return sha
    return None


def update_manifest_text(text: str, track: str, updates: dict[str, str | None]) -> str:
    """Rewrite single-line string keys of the `[track]` table; None removes the key.

    Keys not yet in the table are appended after its `commit` line. Everything else
    (comments, other tables, multi-line arrays) is left as it is.
    """
    lines = text.splitlines(keepends=True)
    header = re.compile(rf"^\[{re.escape(track)}\]\s*(#.*)?$")
    any_header = re.compile(r"^\[[^\]]+\]\s*(#.*)?$")
    start = next((i for i, line in enumerate(lines) if header.match(line.rstrip("\n"))), None)
    if start is None:
        raise PinError(f"human_best/manifest.toml has no [{track}] table")
    end = next((i for i in range(start + 1, len(lines)) if any_header.match(lines[i].rstrip("\n"))), len(lines))
    table = lines[start + 1 : end]
    pending = dict(updates)
    rewritten: list[str] = []
    for line in table:
        key = line.split("=", 1)[0].strip() if "=" in line and not line.startswith((" ", "\t", "#")) else None
        if key in pending:
            value = pending.pop(key)
            if value is not None:
                rewritten.append(f"{key} = {json.dumps(value, ensure_ascii=False)}\n")
            continue
        rewritten.append(line)
    additions = [f"{k} = {json.dumps(v, ensure_ascii=False)}\n" for k, v in pending.items() if v is not None]
    if additions:
        anchor = next((i for i, line in enumerate(rewritten) if line.startswith("commit")), len(rewritten) - 1)
        rewritten[anchor + 1 : anchor + 1] = additions
    return "".join(lines[: start + 1] + rewritten + lines[end:])


def _git(args: list[str], cwd: Path, timeout_s: float = 120) -> str:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true", "SSH_ASKPASS": "true"}
    try:
        result = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        raise PinError(f"`git {' '.join(args)}` timed out after {timeout_s:.0f} s") from None
    if result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or ["no message"])[-1]
        raise PinError(f"`git {' '.join(args)}` failed: {detail}")
    return result.stdout


def list_remote(url: str, timeout_s: float) -> str:
    """`git ls-remote` of HEAD and tags; RemoteUnreachable when the remote cannot be read."""
    try:
        return _git(["ls-remote", url, "HEAD", "refs/tags/*"], REPO_ROOT, timeout_s)
    except PinError as exc:
        raise RemoteUnreachable(
            f"cannot reach {url} ({exc}); run this on a machine with GitHub access"
        ) from None


def ensure_checkout(folder: Path, url: str) -> None:
    """Clone `url` into an absent or empty `folder`, then fetch all tags."""
    if not (folder / ".git").exists():
        if folder.is_dir() and any(folder.iterdir()):
            raise PinError(f"{folder} has files but is not a git checkout; move it aside and run again")
        folder.parent.mkdir(parents=True, exist_ok=True)
        _git(["clone", "--quiet", url, str(folder)], REPO_ROOT, timeout_s=600)
    _git(["fetch", "--quiet", "--tags", "--force", url], folder, timeout_s=600)


def resolve_pin(folder: Path, entry_path: str | None, head: str) -> dict[str, str | None]:
    """Pick the deadline tag's commit if one exists, else `head`; return manifest updates."""
    tags = parse_tag_refs(_git(["for-each-ref", f"--format={TAG_REF_FORMAT}", "refs/tags"], folder))

    def has_entry(tag: TagDate) -> bool:
        if entry_path is None:
            return True
        probe = subprocess.run(
            ["git", "cat-file", "-e", f"{tag.commit}:{entry_path}"], cwd=folder, capture_output=True, check=False
        )
        return probe.returncode == 0

    chosen = select_deadline_tag(tags, accept=has_entry)
    if chosen is not None:
        reason = (
            f"Latest tag dated before 2026-04-24 23:59 AoE that contains the entry file: {chosen.tag} "
            f"({chosen.date.isoformat()}), i.e. what the organisers' tag scan scored; branch head {head}."
        )
        return {"commit": chosen.commit, "pin": "deadline_tag", "deadline_tag": chosen.tag,
                "head_commit": None if head == chosen.commit else head, "pin_reason": reason}
    head_date = datetime.fromisoformat(_git(["show", "-s", "--format=%cI", head], folder).strip())
    kind = "later_commit" if head_date > DEADLINE_UTC else "head_commit"
    reason = (
        f"No tag dated before 2026-04-24 23:59 AoE contains the entry file ({len(tags)} tag(s) seen); "
        f"pinned the branch head, committed {head_date.isoformat()}."
    )
    return {"commit": head, "pin": kind, "deadline_tag": None, "head_commit": None, "pin_reason": reason}


def record_pin(repo_root: Path, submodule: str, url: str, commit: str) -> None:
    """Check `commit` out in the submodule, stage the gitlink and write `.gitmodules`."""
    folder = repo_root / submodule
    _git(["checkout", "--quiet", "--detach", commit], folder)
    # update-index rather than `git add`: exact, and immune to a skip-worktree flag.
    if _staged(repo_root, submodule):
        _git(["update-index", "--no-skip-worktree", submodule], repo_root)
    _git(["update-index", "--add", "--cacheinfo", f"160000,{commit},{submodule}"], repo_root)
    _git(["config", "-f", ".gitmodules", f"submodule.{submodule}.path", submodule], repo_root)
    _git(["config", "-f", ".gitmodules", f"submodule.{submodule}.url", url], repo_root)


def _staged(repo_root: Path, path: str) -> bool:
    return bool(_git(["ls-files", "--stage", "--", path], repo_root).strip())


def main(argv: list[str] | None = None, repo_root: Path = REPO_ROOT) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--track", required=True, help="track name, e.g. gdn_prefill")
    parser.add_argument("--url", help="repository URL to pin (default: the manifest's url)")
    parser.add_argument(
        "--from",
        dest="source",
        help="fetch from this mirror (URL or local path) instead of the URL; the URL is still what is recorded",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve and print; leave gitlink and manifest alone (the checkout is still fetched)",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds allowed for reaching the remote")
    args = parser.parse_args(argv)

    manifest_path = repo_root / MANIFEST_PATH.relative_to(REPO_ROOT)
    try:
        manifest = load_manifest(manifest_path)
        if args.track not in manifest:
            raise PinError(f"no [{args.track}] table in {manifest_path}; choose from {', '.join(manifest)}")
        entry = manifest[args.track]
        url = args.url or entry.url
        source = args.source or url
        remote = list_remote(source, args.timeout)
        head = parse_ls_remote_head(remote)
        if head is None:
            raise PinError(f"{source} has no HEAD (an empty repository?)")
        folder = entry.checkout_dir(repo_root)
        ensure_checkout(folder, source)
        entry_path = f"{entry.source_dir}/{entry.entry_file}" if entry.entry is not None else None
        updates = resolve_pin(folder, entry_path, head)
        if url != entry.url:
            updates["url"] = url
        print(f"{args.track}: {updates['pin']} {updates['commit']} ({updates['pin_reason']})")
        if args.dry_run:
            return 0
        new_text = update_manifest_text(manifest_path.read_text(encoding="utf-8"), args.track, updates)
        parse_manifest(new_text, source=str(manifest_path))  # refuse to write an invalid manifest
        record_pin(repo_root, entry.submodule, url, str(updates["commit"]))
        manifest_path.write_text(new_text, encoding="utf-8")
        status = check_submodule(load_manifest(manifest_path)[args.track], repo_root)
        print(f"{status.state}: {status.message}")
        print(f"now commit: git commit .gitmodules {manifest_path.relative_to(repo_root)} {entry.submodule}")
        return 0 if status.state == "pinned" else EXIT_BAD_INPUT
    except RemoteUnreachable as exc:
        print(f"pin_human_best: {exc}", file=sys.stderr)
        return EXIT_NO_NETWORK
    except (PinError, ManifestError, GitError) as exc:
        print(f"pin_human_best: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
