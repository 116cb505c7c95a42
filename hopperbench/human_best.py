"""The `human_best/manifest.toml` schema and loader.

Each top-level table of the manifest describes one track's contest winner: the
git submodule that pins its public code, the commit the superproject's gitlink
must point at, where the solution lives inside that checkout and how it is
called. Unknown facts are spelled "unknown" rather than guessed, so the guard
(`hopperbench.integrity`) and the sides builder can say why a human side is
missing instead of running something unverified.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hopperbench.paths import HUMAN_BEST_DIR

UNKNOWN = "unknown"
MANIFEST_PATH = HUMAN_BEST_DIR / "manifest.toml"
SUBMODULE_PARENT = "human_best"

_SHA1 = re.compile(r"[0-9a-f]{40}")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_GITHUB_URL = re.compile(r"https://github\.com/(?P<slug>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)")

# How the pinned commit relates to what the organisers scored (their scan took the
# latest tag per definition pushed before the deadline).
PinKind = Literal[
    "deadline_tag",  # the latest tag before 2026-04-24 23:59 AoE: the scored code
    "later_commit",  # a commit after the deadline (the scored tag is unknown or absent)
    "head_commit",  # the branch head, made before the deadline, with no qualifying tag
    "unknown",  # no commit known
]
Language = Literal["triton", "cuda", "cpp", "python", "cutedsl", "tilelang", "unknown"]


class ManifestError(ValueError):
    """The manifest cannot be read or does not validate; the message is one line."""


def _relative_posix(value: str, what: str) -> str:
    path = PurePosixPath(value)
    if not value or path.is_absolute() or ".." in path.parts or "\\" in value:
        raise ValueError(f"{what} must be a relative POSIX path without '..', got {value!r}")
    return value


class HumanEntry(BaseModel):
    """One track's winner, as pinned in the superproject."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    track: str
    team: str = Field(min_length=1)
    placement: str = Field(min_length=1)
    definition: str = Field(min_length=1)
    # `human_best/<name>`: the submodule path inside the superproject.
    submodule: str
    url: str
    # The commit the gitlink pins (40 lowercase hex), or "unknown".
    commit: str
    pin: PinKind
    pin_reason: str = Field(min_length=1)
    # The tag the pin came from, when pin == "deadline_tag".
    deadline_tag: str | None = None
    # The branch head last seen by the pin tool, when it differs from `commit`.
    head_commit: str | None = None
    # Folder inside the submodule that the solution is packed from; entry and
    # solution files are relative to it. None when unknown.
    source_dir: str | None = None
    solution_files: tuple[str, ...] = ()
    # `<file relative to source_dir>::<function>`; None when unknown.
    entry: str | None = None
    entry_confirmed: bool = False
    language: Language
    destination_passing: bool | Literal["unknown"]
    dependencies: tuple[str, ...] = ()
    license: str = Field(min_length=1)
    # Short clause for "human side unavailable: <team>'s code (<repo>) <availability>".
    availability: str = Field(min_length=1)
    notes: str = ""
    hazards: tuple[str, ...] = ()

    @field_validator("submodule")
    @classmethod
    def _submodule_under_human_best(cls, value: str) -> str:
        parts = PurePosixPath(_relative_posix(value, "submodule")).parts
        if len(parts) != 2 or parts[0] != SUBMODULE_PARENT:
            raise ValueError(f"submodule must be '{SUBMODULE_PARENT}/<name>', got {value!r}")
        return value

    @field_validator("url")
    @classmethod
    def _github_url(cls, value: str) -> str:
        if not _GITHUB_URL.fullmatch(value):
            raise ValueError(f"url must be https://github.com/<owner>/<repo> (no .git, no slash), got {value!r}")
        return value

    @field_validator("commit")
    @classmethod
    def _commit_sha_or_unknown(cls, value: str) -> str:
        if value != UNKNOWN and not _SHA1.fullmatch(value):
            raise ValueError(f"commit must be 40 lowercase hex digits or {UNKNOWN!r}, got {value!r}")
        return value

    @field_validator("head_commit")
    @classmethod
    def _head_sha(cls, value: str | None) -> str | None:
        if value is not None and not _SHA1.fullmatch(value):
            raise ValueError(f"head_commit must be 40 lowercase hex digits, got {value!r}")
        return value

    @field_validator("source_dir")
    @classmethod
    def _source_dir_relative(cls, value: str | None) -> str | None:
        return None if value is None else _relative_posix(value, "source_dir")

    @field_validator("solution_files")
    @classmethod
    def _solution_files_relative(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_relative_posix(v, "solution file") for v in value)

    @field_validator("entry")
    @classmethod
    def _entry_format(cls, value: str | None) -> str | None:
        if value is None:
            return None
        file, sep, function = value.partition("::")
        if not sep or "::" in function or not file or not _IDENTIFIER.fullmatch(function):
            raise ValueError(f"entry must be '<file>::<function>', got {value!r}")
        _relative_posix(file, "entry file")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> HumanEntry:
        if (self.commit == UNKNOWN) != (self.pin == "unknown"):
            raise ValueError(f"pin {self.pin!r} does not fit commit {self.commit!r} (unknown goes with unknown)")
        if self.pin == "deadline_tag" and not self.deadline_tag:
            raise ValueError("pin 'deadline_tag' needs deadline_tag (the tag name)")
        if self.entry is not None:
            if self.source_dir is None:
                raise ValueError("entry is set but source_dir is not")
            if self.entry_file not in self.solution_files:
                raise ValueError(f"entry file {self.entry_file!r} is not among solution_files")
        return self

    @property
    def repo_slug(self) -> str:
        """`owner/name` of the GitHub repository."""
        match = _GITHUB_URL.fullmatch(self.url)
        assert match is not None  # validated above
        return match["slug"]

    @property
    def name(self) -> str:
        """The submodule's folder name under human_best/."""
        return PurePosixPath(self.submodule).name

    @property
    def commit_known(self) -> bool:
        return self.commit != UNKNOWN

    @property
    def entry_file(self) -> str:
        if self.entry is None:
            raise ValueError(f"{self.track}: the winner's entry point is unknown")
        return self.entry.split("::")[0]

    @property
    def entry_function(self) -> str:
        if self.entry is None:
            raise ValueError(f"{self.track}: the winner's entry point is unknown")
        return self.entry.split("::")[1]

    def checkout_dir(self, repo_root: Path) -> Path:
        """Where the submodule's working tree lives in a checkout rooted at `repo_root`."""
        return repo_root / self.submodule

    def solution_paths(self, repo_root: Path) -> list[Path]:
        """Absolute paths of the solution files (they exist only in a populated checkout)."""
        if self.source_dir is None:
            return []
        base = self.checkout_dir(repo_root) / self.source_dir
        return [base / f for f in self.solution_files]


def _one_line(error: ValidationError, track: str) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "entry"
    message = first["msg"].removeprefix("Value error, ")
    more = f" (+{error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"[{track}] {where}: {message}{more}"


def parse_manifest(text: str, source: str = "manifest.toml") -> dict[str, HumanEntry]:
    """Parse manifest text: one top-level table per track name."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{source}: not valid TOML: {exc}") from None
    entries: dict[str, HumanEntry] = {}
    for track, table in raw.items():
        if not isinstance(table, dict):
            raise ManifestError(f"{source}: top-level key {track!r} must be a table [{track}]")
        if "track" in table:
            raise ManifestError(f"{source}: [{track}] has a 'track' key; the table name is the track")
        try:
            entries[track] = HumanEntry.model_validate({"track": track, **table})
        except ValidationError as exc:
            raise ManifestError(f"{source}: {_one_line(exc, track)}") from None
    if not entries:
        raise ManifestError(f"{source}: no track tables")
    return entries


def load_manifest(path: Path = MANIFEST_PATH) -> dict[str, HumanEntry]:
    """Load and validate `human_best/manifest.toml` -> {track name: HumanEntry}."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc.strerror}") from None
    return parse_manifest(text, source=str(path))
