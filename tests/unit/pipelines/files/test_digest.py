"""What is checked of a model file (pipelines/files/digest.py through ``ModelFiles``): the
size its publisher states, the sha256 recorded at its first download (AMI's 8-hex name
suffix is no digest), and in strict mode the sha256 the operator verified. Real files on disk,
served by a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from config.errors import ConfigError
from datasets.uris import SourceConfig
from pipelines.files.fetch import ModelFiles
from pipelines.registry import resolve

QUICK = SourceConfig(connect_timeout_s=1.0, http_timeout_s=1.0, read_timeout_s=1.0)


def _kept(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob("*") if not p.name.endswith(".lock"))


def _sized(served, name: str, size_bytes: int) -> tuple[str, Any]:
    from pipelines.files.hosts import Hosts

    base = served.url("")
    return base + name, Hosts(base, (base,), {name: size_bytes})


def test_a_file_of_another_size_than_published_is_refused_and_not_kept(served, tmp_path):
    (served.root / "short.pt").write_bytes(b"x" * 90)
    uri, hosts = _sized(served, "short.pt", 100)
    files = ModelFiles(QUICK, tmp_path / "cache", hosts=hosts)
    with pytest.raises(ConfigError, match=r"short\.pt refused.*expected 100 bytes, got 90 bytes"):
        files.read(uri)
    (served.root / "long.pt").write_bytes(b"x" * 5000)
    uri, hosts = _sized(served, "long.pt", 100)
    files = ModelFiles(QUICK, tmp_path / "cache", hosts=hosts)
    with pytest.raises(ConfigError, match=r"long\.pt refused.*expected 100 bytes, got 5000 bytes"):
        files.read(uri)  # its Content-Length: refused before its body is read
    assert _kept(tmp_path / "cache") == []
    (served.root / "right.pt").write_bytes(b"x" * 100)
    uri, hosts = _sized(served, "right.pt", 100)
    assert ModelFiles(QUICK, tmp_path / "cache", hosts=hosts).read(uri) == b"x" * 100


def test_a_body_longer_than_published_without_a_length_is_refused(tmp_path):
    class Unsized(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends with the connection: no Content-Length

        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"y" * 4096)

        def log_message(self, *_args: Any) -> None:
            pass

    from pipelines.files.hosts import Hosts

    server = ThreadingHTTPServer(("127.0.0.1", 0), Unsized)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        files = ModelFiles(QUICK, tmp_path / "cache", hosts=Hosts(base, (base,), {"m.pt": 100}))
        with pytest.raises(ConfigError, match=r"expected 100 bytes, got more than 100 bytes"):
            files.read(base + "m.pt")
    finally:
        server.shutdown()
        server.server_close()
    assert _kept(tmp_path / "cache") == []


def _ami_binary(served) -> tuple[str, str | None]:
    """The moth / non-moth classifier's weights as AMI's catalogue declares them, from a
    mirror on 127.0.0.1 holding other bytes under AMI's name."""
    stage = resolve("moth_binary", "", served.url("ami")).classifier
    assert stage is not None and isinstance(stage.weights, str)
    assert stage.weights.endswith("_b4fe3efe.pth")
    path = served.root / "ami" / stage.weights.removeprefix(served.url("ami/"))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"weights under AMI's name")
    return stage.weights, stage.weights_digest


def test_amis_name_suffix_is_no_digest_the_first_sha256_is_recorded_and_held(served, tmp_path):
    uri, declared = _ami_binary(served)
    files = ModelFiles(QUICK, tmp_path / "cache")
    first = files.fetch(uri, declared)  # the suffix b4fe3efe is not checked as a digest
    assert (first.pinned, first.downloaded) == ("recorded", True)
    assert first.sha256 == hashlib.sha256(b"weights under AMI's name").hexdigest()
    assert first.path is not None
    first.path.write_bytes(b"planted in the cache!!!!")  # the cached file changed on disk
    (served.root / "ami" / uri.removeprefix(served.url("ami/"))).write_bytes(b"other bytes")
    with pytest.raises(ConfigError) as refused:
        files.read(uri, declared)
    assert "its content changed since its first download" in str(refused.value)
    assert first.sha256 in str(refused.value)
    assert first.path.exists() is False  # never served as the model's


def test_strict_mode_refuses_a_file_without_a_verified_sha256(served, tmp_path):
    from pipelines.files.fetch import Pins

    uri, declared = _ami_binary(served)
    name = uri.rpartition("/")[2]
    strict = ModelFiles(QUICK, tmp_path / "cache", pins=Pins({}, strict=True))
    with pytest.raises(ConfigError) as refused:
        strict.fetch(uri, declared)
    assert f"add {name}=<its sha256> to WORKER_MODEL__FILE_DIGESTS" in str(refused.value)
    assert "WORKER_MODEL__REQUIRE_DIGESTS is true" in str(refused.value)
    assert served.gets == 0  # refused before any download
    wrong = ModelFiles(QUICK, tmp_path / "cache", pins=Pins({name: "ab" * 32}, strict=True))
    with pytest.raises(ConfigError, match=f"expected sha256 {'ab' * 32}"):
        wrong.fetch(uri, declared)
    sha = hashlib.sha256(b"weights under AMI's name").hexdigest()
    verified = ModelFiles(QUICK, tmp_path / "cache", pins=Pins({name: sha}, strict=True))
    assert verified.fetch(uri, declared).pinned == "verified"
    assert verified.status(uri, declared) == ("verified", True)


def test_amis_hosts_are_tried_in_order_current_first():
    from pipelines.ami import catalogue

    hosts = catalogue.file_hosts("", (), True)
    assert hosts.bases == (catalogue.AMI_CURRENT_BASE, catalogue.AMI_BASE)
    assert hosts.size_of(catalogue.AMI_BASE + catalogue.BINARY.weights) == 94_373_731
    assert (
        catalogue.file_hosts("", (), False).size_of(catalogue.AMI_BASE + catalogue.BINARY.weights)
        is None
    )
