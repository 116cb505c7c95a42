"""Fetch the official definitions, workloads and blobs of the contest tracks into `benchmark_data/`.

    uv run tools/download_workloads.py --track all
    uv run tools/download_workloads.py --track moe,dsa_attention --max-workloads 3
    uv run tools/download_workloads.py --from ../shared/contest_data

The source is the Hugging Face dataset `flashinfer-ai/mlsys26-contest` at a pinned revision
(`--revision`); the destination gets flashinfer-trace layout (`definitions/<op_type>/<def>.json`,
`workloads/<op_type>/<def>.jsonl`, `blob/workloads/<op_type>/<def>/*.safetensors`), which
`hopperbench.workloads.load_workloads` reads as official data.

`--from DIR` imports a local copy instead: either the same flashinfer-trace layout, or the flat
layout of `../shared/contest_data` (`<def>/<def>.json`, `<def>/<def>.jsonl`, blobs beside them).
A local copy may lack blobs or a track's JSONL: missing blobs are reported and their inputs are
synthesized later (the workload stays official, `WorkloadSpec.missing_blob_inputs` records them);
a track without a JSONL keeps the embedded workload list. Downloading, every file must exist.

Every file is written to `<name>.part`, fsynced, verified (definitions and workloads parse as
flashinfer-bench models; blobs parse as safetensors and match the sha256 and size the Hugging Face
LFS headers announce) and only then renamed into place: an interrupted or failed run never leaves
a half-written file. Errors are one line on stderr with exit status 1.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Protocol

from flashinfer_bench.data import Definition, SafetensorsInput, Trace, load_jsonl_file
from pydantic import ValidationError
from safetensors import safe_open
from tqdm import tqdm

from hopperbench.paths import BENCHMARK_DATA_DIR
from hopperbench.tracks import Track, UnknownTrackError, parse_track_list

DATASET_URL = "https://huggingface.co/datasets/flashinfer-ai/mlsys26-contest/resolve"
PINNED_REVISION = "5dc85caf6224d8dcee9c87ac5aff036e8597f389"
TIMEOUT_S = 60.0
COPY_CHUNK = 1 << 20


class DownloadError(Exception):
    """A download or import step failed; the message is the one line shown to the user."""


class MissingFileError(DownloadError):
    """The source does not have the requested file."""


@dataclass(frozen=True)
class Expected:
    """What the source announces about a file, when it does (Hugging Face LFS headers)."""

    sha256: str | None = None
    size: int | None = None


class Source(Protocol):
    description: str
    # A local copy may lack blobs or JSONLs; the remote dataset must have them all.
    partial_ok: bool

    def fetch(self, track: Track, rel_path: str, out: BinaryIO) -> Expected:
        """Write the dataset file `rel_path` (dataset-relative, POSIX) into `out`."""
        ...


# ---------------------------------------------------------------------------------------------
# Sources


class _HeaderRecorder(urllib.request.HTTPRedirectHandler):
    """Keeps the headers of redirect responses: Hugging Face puts the LFS sha256 there."""

    def __init__(self) -> None:
        self.headers: list[object] = []

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        self.headers.append(headers)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _announced(header_sets: list[object]) -> Expected:
    sha256, size = None, None
    for headers in header_sets:
        etag = (headers.get("X-Linked-Etag") or "").strip('"')  # type: ignore[attr-defined]
        if re.fullmatch(r"[0-9a-f]{64}", etag):
            sha256 = etag
        linked_size = headers.get("X-Linked-Size")  # type: ignore[attr-defined]
        if linked_size and linked_size.isdigit():
            size = int(linked_size)
    return Expected(sha256=sha256, size=size)


@dataclass
class RemoteSource:
    base_url: str = DATASET_URL
    revision: str = PINNED_REVISION
    timeout_s: float = TIMEOUT_S
    partial_ok: bool = False

    @property
    def description(self) -> str:
        return f"{self.base_url}/{self.revision}"

    def fetch(self, track: Track, rel_path: str, out: BinaryIO) -> Expected:
        url = f"{self.base_url.rstrip('/')}/{self.revision}/{rel_path}"
        recorder = _HeaderRecorder()
        opener = urllib.request.build_opener(recorder)
        try:
            with opener.open(url, timeout=self.timeout_s) as response:
                expected = _announced([*recorder.headers, response.headers])
                length = response.headers.get("Content-Length")
                received = 0
                while chunk := response.read(COPY_CHUNK):
                    out.write(chunk)
                    received += len(chunk)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise MissingFileError(f"not found (HTTP 404): {url}") from None
            raise DownloadError(f"HTTP {e.code} {e.reason} for {url}") from None
        except urllib.error.URLError as e:
            raise DownloadError(
                f"cannot reach {url.split('/')[2]} ({e.reason}); no network? use --from DIR to import a local copy"
            ) from None
        except (OSError, EOFError) as e:  # timeouts, resets, http.client.IncompleteRead
            raise DownloadError(f"download of {url} interrupted ({type(e).__name__}: {e})") from None
        if length is not None and received != int(length):
            raise DownloadError(f"download of {url} interrupted: {received} of {length} bytes")
        return expected


@dataclass
class LocalSource:
    """A local copy in flashinfer-trace layout or the flat `<def>/<def>.json(l)` layout."""

    root: Path
    partial_ok: bool = True

    @property
    def description(self) -> str:
        return str(self.root)

    def layout(self, track: Track) -> str:
        trace_files = [
            self.root / "definitions" / track.op_type / f"{track.definition_name}.json",
            self.root / "workloads" / track.op_type / f"{track.definition_name}.jsonl",
        ]
        if any(p.is_file() for p in trace_files):
            return "flashinfer-trace"
        if (self.root / track.definition_name).is_dir():
            return "flat"
        raise DownloadError(f"{self.root} holds no data for track {track.name} (neither layout)")

    def local_path(self, track: Track, rel_path: str) -> Path:
        if self.layout(track) == "flashinfer-trace":
            return self.root / rel_path
        # Flat layout: every file of a definition sits in <root>/<def>/ under its own name.
        return self.root / track.definition_name / PurePosixPath(rel_path).name

    def fetch(self, track: Track, rel_path: str, out: BinaryIO) -> Expected:
        path = self.local_path(track, rel_path)
        try:
            with open(path, "rb") as f:
                shutil.copyfileobj(f, out, COPY_CHUNK)
        except FileNotFoundError:
            raise MissingFileError(f"not in the local copy: {path}") from None
        except OSError as e:
            raise DownloadError(f"cannot read {path}: {e.strerror}") from None
        return Expected()


# ---------------------------------------------------------------------------------------------
# Writing and verifying


class _HashingWriter:
    """A file wrapper that hashes what passes through."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self._f.write(data)


def write_atomically(dest: Path, fill: Callable[[BinaryIO], Expected], verify: Callable[[Path], None]) -> None:
    """Fill `dest.part`, fsync, check announced sha256/size, `verify`, rename; never leave a partial file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    try:
        with open(part, "wb") as f:
            writer = _HashingWriter(f)
            expected = fill(writer)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        if expected.size is not None and writer.size != expected.size:
            raise DownloadError(f"size mismatch for {dest.name}: expected {expected.size} bytes, got {writer.size}")
        digest = writer.sha256.hexdigest()
        if expected.sha256 is not None and digest != expected.sha256:
            raise DownloadError(f"checksum mismatch for {dest.name}: expected sha256 {expected.sha256}, got {digest}")
        verify(part)
        os.replace(part, dest)
        _fsync_dir(dest.parent)
    finally:
        part.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _verify_definition(track: Track) -> Callable[[Path], None]:
    def verify(path: Path) -> None:
        try:
            definition = Definition.model_validate_json(path.read_bytes())
        except ValidationError as e:
            raise DownloadError(f"{track.definition_name}.json is not a valid definition ({_first_error(e)})") from None
        if definition.name != track.definition_name:
            raise DownloadError(f"definition file names {definition.name!r}, expected {track.definition_name!r}")

    return verify


def _verify_workloads(track: Track) -> Callable[[Path], None]:
    def verify(path: Path) -> None:
        for trace in _read_traces(path, track):
            if trace.definition != track.definition_name:
                raise DownloadError(f"{track.definition_name}.jsonl has a line for {trace.definition!r}")

    return verify


def _verify_safetensors(path: Path) -> None:
    try:
        with safe_open(str(path), framework="pt") as f:
            list(f.keys())
    except Exception as e:  # safetensors raises its own and builtin types for a bad header
        raise DownloadError(f"{path.name.removesuffix('.part')} is not a valid safetensors file ({e})") from None


def _read_traces(path: Path, track: Track) -> list[Trace]:
    try:
        return load_jsonl_file(Trace, path)
    except ValidationError as e:
        raise DownloadError(f"{track.definition_name}.jsonl is not a workload file ({_first_error(e)})") from None
    except ValueError as e:
        raise DownloadError(f"{track.definition_name}.jsonl is not a workload file ({e})") from None


def _first_error(e: ValidationError) -> str:
    first = e.errors()[0]
    return f"{'.'.join(map(str, first['loc']))}: {first['msg']}"


# ---------------------------------------------------------------------------------------------
# One track


@dataclass
class TrackReport:
    track: str
    workloads: int | None = None  # None: no JSONL, the embedded list stays in use
    blobs_wanted: int = 0
    blobs_present: int = 0
    blobs_missing: list[str] = field(default_factory=list)

    def line(self, dest: Path) -> str:
        if self.workloads is None:
            return (
                f"{self.track}: definition only (no workload JSONL in the source; "
                f"the embedded list stays in use) -> {dest}"
            )
        text = f"{self.track}: {self.workloads} workloads, {self.blobs_present}/{self.blobs_wanted} blobs -> {dest}"
        if self.blobs_missing:
            text += f" ({len(self.blobs_missing)} blobs missing: their inputs will be synthesized)"
        return text


def blob_paths(traces: list[Trace], max_workloads: int | None) -> list[str]:
    """Distinct dataset-relative blob paths of the first `max_workloads` workloads, in order."""
    paths: dict[str, None] = {}
    for trace in traces[:max_workloads]:
        for spec in trace.workload.inputs.values():
            if isinstance(spec, SafetensorsInput):
                paths[_safe_rel_path(spec.path)] = None
    return list(paths)


def _safe_rel_path(path: str) -> str:
    """The normalised dataset-relative path; refuses paths that would leave the destination."""
    parts = [p for p in PurePosixPath(path).parts if p != "."]
    if not parts or PurePosixPath(path).is_absolute() or ".." in parts:
        raise DownloadError(f"refusing blob path {path!r} outside the dataset")
    return "/".join(parts)


def sync_track(track: Track, source: Source, dest: Path, max_workloads: int | None, progress: tqdm) -> TrackReport:
    report = TrackReport(track=track.name)
    definition_rel = f"definitions/{track.op_type}/{track.definition_name}.json"
    workloads_rel = f"workloads/{track.op_type}/{track.definition_name}.jsonl"

    def get(rel: str, verify: Callable[[Path], None]) -> None:
        progress.set_postfix_str(PurePosixPath(rel).name[-48:], refresh=False)
        write_atomically(dest / rel, lambda out: source.fetch(track, rel, out), verify)
        progress.update(1)

    get(definition_rel, _verify_definition(track))
    try:
        get(workloads_rel, _verify_workloads(track))
    except MissingFileError:
        if not source.partial_ok:
            raise
        # A stale JSONL from an earlier import would otherwise keep claiming official data.
        (dest / workloads_rel).unlink(missing_ok=True)
        return report
    traces = _read_traces(dest / workloads_rel, track)
    report.workloads = len(traces)
    wanted = blob_paths(traces, max_workloads)
    report.blobs_wanted = len(wanted)
    progress.total = (progress.total or 0) + len(wanted)
    progress.refresh()
    for rel in wanted:
        target = dest / rel
        if target.is_file() and _is_valid_safetensors(target):
            progress.update(1)
        else:
            try:
                get(rel, _verify_safetensors)
            except MissingFileError:
                if not source.partial_ok:
                    raise
                report.blobs_missing.append(rel)
                progress.update(1)
                continue
        report.blobs_present += 1
    return report


def _is_valid_safetensors(path: Path) -> bool:
    try:
        _verify_safetensors(path)
    except DownloadError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--track", default="all", help="all, or a comma list of track names (default: all)")
    parser.add_argument(
        "--max-workloads", type=int, default=None, metavar="N", help="fetch blobs of the first N workloads only"
    )
    parser.add_argument(
        "--from",
        dest="from_dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="import a local copy instead of downloading",
    )
    parser.add_argument(
        "--dest", type=Path, default=BENCHMARK_DATA_DIR, help=f"destination (default: {BENCHMARK_DATA_DIR})"
    )
    parser.add_argument("--revision", default=PINNED_REVISION, help="dataset revision (default: the pinned one)")
    parser.add_argument(
        "--base-url", default=DATASET_URL, help="dataset resolve URL, for mirrors (default: Hugging Face)"
    )
    args = parser.parse_args(argv)
    if args.max_workloads is not None and args.max_workloads < 1:
        parser.error(f"--max-workloads must be >= 1, got {args.max_workloads}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        tracks = parse_track_list(args.track)
        if args.from_dir is not None:
            if not args.from_dir.is_dir():
                raise DownloadError(f"--from {args.from_dir}: not a directory")
            source: Source = LocalSource(root=args.from_dir.resolve())
        else:
            source = RemoteSource(base_url=args.base_url, revision=args.revision)
        reports = []
        with tqdm(total=2 * len(tracks), unit="file", desc="workloads") as progress:
            for track in tracks:
                progress.set_description(track.name)
                reports.append(sync_track(track, source, args.dest, args.max_workloads, progress))
    except (DownloadError, UnknownTrackError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted (no partial file was kept)", file=sys.stderr)
        return 130
    print(f"source: {source.description}")
    for report in reports:
        print(report.line(args.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
