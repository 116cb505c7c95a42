"""tools/download_workloads.py against a local fake of the Hugging Face dataset (no network)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import socket
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import save_file

from hopperbench.paths import REPO_ROOT, shared_contest_data_dir
from hopperbench.tracks import TRACKS
from hopperbench.workloads import load_workloads

DSA = TRACKS["dsa_attention"]
REVISION = "testrev"


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("download_workloads", REPO_ROOT / "tools" / "download_workloads.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


def _dsa_dataset(root: Path, num_tokens: tuple[int, ...] = (2, 3, 1)) -> list[str]:
    """A flashinfer-trace copy of the DSA track; returns the blob paths, dataset-relative."""
    (root / "definitions" / DSA.op_type).mkdir(parents=True)
    shutil.copy(DSA.definition_path, root / "definitions" / DSA.op_type / f"{DSA.definition_name}.json")
    blob_dir = root / "blob" / "workloads" / DSA.op_type / DSA.definition_name
    blob_dir.mkdir(parents=True)
    lines, blobs = [], []
    for i, t in enumerate(num_tokens):
        rel = f"blob/workloads/{DSA.op_type}/{DSA.definition_name}/{DSA.definition_name}_w{i}.safetensors"
        save_file({"sparse_indices": torch.full((t, 2048), i, dtype=torch.int32)}, str(root / rel))
        blobs.append(rel)
        inputs = {
            "sparse_indices": {"type": "safetensors", "path": f"./{rel}", "tensor_key": "sparse_indices"},
            "sm_scale": {"type": "scalar", "value": 0.1352337788608801},
        }
        workload = {"uuid": f"w{i}", "axes": {"num_tokens": t, "num_pages": 8462}, "inputs": inputs}
        lines.append(
            json.dumps({"definition": DSA.definition_name, "solution": None, "workload": workload, "evaluation": None})
        )
    jsonl = root / "workloads" / DSA.op_type / f"{DSA.definition_name}.jsonl"
    jsonl.parent.mkdir(parents=True)
    jsonl.write_text("\n".join(lines) + "\n")
    return blobs


class FakeHub:
    """Serves a dataset dir like `.../resolve/<rev>/<path>`; blobs go through an LFS-style redirect."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.truncate: set[str] = set()  # paths whose body is cut short
        self.wrong_sha: set[str] = set()  # paths announced with a wrong sha256
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                prefix = f"/resolve/{REVISION}/"
                if self.path.startswith("/cdn/"):
                    return self._send_file(self.path.removeprefix("/cdn/"))
                if not self.path.startswith(prefix):
                    return self.send_error(404)
                rel = self.path.removeprefix(prefix)
                path = hub.root / rel
                if not path.is_file():
                    return self.send_error(404)
                if rel.endswith(".safetensors"):
                    sha = hashlib.sha256(path.read_bytes()).hexdigest()
                    if rel in hub.wrong_sha:
                        sha = "0" * 64
                    self.send_response(302)
                    self.send_header("Location", f"/cdn/{rel}")
                    self.send_header("X-Linked-Etag", f'"{sha}"')
                    self.send_header("X-Linked-Size", str(path.stat().st_size))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                return self._send_file(rel)

            def _send_file(self, rel: str) -> None:
                data = (hub.root / rel).read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[: len(data) // 2] if rel in hub.truncate else data)
                self.wfile.flush()
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/resolve"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[tuple[FakeHub, list[str]]]:
    root = tmp_path / "hub"
    blobs = _dsa_dataset(root)
    fake = FakeHub(root)
    yield fake, blobs
    fake.close()


def _run(base_url: str, dest: Path, *extra: str) -> int:
    return tool.main(
        ["--track", "dsa_attention", "--base-url", base_url, "--revision", REVISION, "--dest", str(dest), *extra]
    )


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    return lines[0]


def test_download_writes_flashinfer_trace_layout_read_as_official(hub, tmp_path: Path) -> None:
    fake, blobs = hub
    dest = tmp_path / "dest"
    assert _run(fake.url, dest) == 0
    assert _files(dest) == _files(fake.root)  # no .part left, nothing extra
    for rel in _files(fake.root):
        assert (dest / rel).read_bytes() == (fake.root / rel).read_bytes()
    workloads = load_workloads("dsa_attention", dest)
    assert [w.data_source for w in workloads] == ["official"] * 3
    assert all(set(w.blob_inputs) == {"sparse_indices"} and not w.missing_blob_inputs for w in workloads)


def test_max_workloads_limits_the_blobs(hub, tmp_path: Path) -> None:
    fake, blobs = hub
    dest = tmp_path / "dest"
    assert _run(fake.url, dest, "--max-workloads", "1") == 0
    assert [b for b in blobs if (dest / b).is_file()] == blobs[:1]
    workloads = load_workloads("dsa_attention", dest)
    assert [w.missing_blob_inputs for w in workloads] == [(), ("sparse_indices",), ("sparse_indices",)]


def test_missing_blob_is_an_error(hub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake, blobs = hub
    (fake.root / blobs[1]).unlink()
    dest = tmp_path / "dest"
    assert _run(fake.url, dest) == 1
    assert "HTTP 404" in _error_line(capsys)
    assert not (dest / blobs[1]).exists()
    assert not [f for f in _files(dest) if f.endswith(".part")]


def test_connection_refused_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dest = tmp_path / "dest"
    assert _run(f"http://127.0.0.1:{port}/resolve", dest) == 1
    assert "cannot reach 127.0.0.1" in _error_line(capsys)
    assert not dest.exists() or _files(dest) == []


def test_interrupted_download_leaves_no_file(hub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake, blobs = hub
    fake.truncate.add(blobs[0])
    dest = tmp_path / "dest"
    assert _run(fake.url, dest) == 1
    assert "interrupted" in _error_line(capsys)
    assert not (dest / blobs[0]).exists()
    assert not [f for f in _files(dest) if f.endswith(".part")]


def test_checksum_mismatch_leaves_no_file(hub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake, blobs = hub
    fake.wrong_sha.add(blobs[2])
    dest = tmp_path / "dest"
    assert _run(fake.url, dest) == 1
    assert "checksum mismatch" in _error_line(capsys)
    assert not (dest / blobs[2]).exists() and (dest / blobs[1]).is_file()
    assert not [f for f in _files(dest) if f.endswith(".part")]


def test_corrupt_blob_is_refused_and_an_existing_good_file_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    blobs = _dsa_dataset(src, num_tokens=(2,))
    dest = tmp_path / "dest"
    assert tool.main(["--track", "dsa_attention", "--from", str(src), "--dest", str(dest)]) == 0
    good = (dest / blobs[0]).read_bytes()
    (dest / blobs[0]).write_bytes(b"garbage")  # an invalid local blob is fetched again ...
    (src / blobs[0]).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")  # ... and this one is refused
    assert tool.main(["--track", "dsa_attention", "--from", str(src), "--dest", str(dest)]) == 1
    assert "not a valid safetensors file" in _error_line(capsys)
    assert (dest / blobs[0]).read_bytes() == b"garbage"  # the refused file never replaced it
    (src / blobs[0]).write_bytes(good)
    assert tool.main(["--track", "dsa_attention", "--from", str(src), "--dest", str(dest)]) == 0
    assert (dest / blobs[0]).read_bytes() == good


def test_import_of_a_flat_layout(tmp_path: Path) -> None:
    trace_copy = tmp_path / "trace"
    blobs = _dsa_dataset(trace_copy)
    flat = tmp_path / "flat" / DSA.definition_name
    flat.mkdir(parents=True)
    shutil.copy(trace_copy / "definitions" / DSA.op_type / f"{DSA.definition_name}.json", flat)
    shutil.copy(trace_copy / "workloads" / DSA.op_type / f"{DSA.definition_name}.jsonl", flat)
    shutil.copy(trace_copy / blobs[0], flat)  # one blob beside the files, the others absent
    dest = tmp_path / "dest"
    assert tool.main(["--track", "dsa_attention", "--from", str(tmp_path / "flat"), "--dest", str(dest)]) == 0
    assert (dest / "definitions" / DSA.op_type / f"{DSA.definition_name}.json").is_file()
    assert (dest / blobs[0]).read_bytes() == (trace_copy / blobs[0]).read_bytes()
    workloads = load_workloads("dsa_attention", dest)
    assert [w.data_source for w in workloads] == ["official"] * 3
    assert [w.missing_blob_inputs for w in workloads] == [(), ("sparse_indices",), ("sparse_indices",)]


def test_import_of_a_dir_without_the_track_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tool.main(["--track", "moe", "--from", str(tmp_path), "--dest", str(tmp_path / "dest")]) == 1
    assert "holds no data for track moe" in _error_line(capsys)


def test_import_of_the_shared_contest_data(tmp_path: Path) -> None:
    shared = shared_contest_data_dir()
    if shared is None:
        pytest.skip("../shared/contest_data is absent")
    dest = tmp_path / "dest"
    assert tool.main(["--track", "all", "--from", str(shared), "--dest", str(dest)]) == 0
    # MoE: the official JSONL (3dbeca5a) names all eight tensors as blobs, none of which exist.
    moe = load_workloads("moe", dest)
    assert len(moe) == 19 and {w.data_source for w in moe} == {"official"}
    tensor_inputs = {"routing_logits", "routing_bias", "hidden_states", "hidden_states_scale", "gemm1_weights",
                     "gemm1_weights_scale", "gemm2_weights", "gemm2_weights_scale"}  # fmt: skip
    assert all(set(w.missing_blob_inputs) == tensor_inputs and not w.blob_inputs for w in moe)
    embedded_moe = load_workloads("moe", tmp_path / "nothing")
    assert [(w.uuid, w.axes, w.scalars) for w in moe] == [(w.uuid, w.axes, w.scalars) for w in embedded_moe]
    # GDN and DSA have no public JSONL: definitions only, the embedded lists stay in use.
    for track, count in (("gdn_prefill", 100), ("dsa_attention", 23)):
        workloads = load_workloads(track, dest)
        assert len(workloads) == count and {w.data_source for w in workloads} == {"synthesized"}
        assert (dest / "definitions" / TRACKS[track].op_type / f"{TRACKS[track].definition_name}.json").is_file()


def test_bad_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert tool.main(["--track", "nope", "--from", str(tmp_path)]) == 1
    assert "unknown track 'nope'" in _error_line(capsys)
    with pytest.raises(SystemExit) as exc:
        tool.main(["--max-workloads", "0"])
    assert exc.value.code == 2
