"""A publisher's files tried at each of its hosts in turn (pipelines/files/hosts.py through
``ModelFiles``): real HTTP servers on 127.0.0.1, one refusing, one serving."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from config.errors import PermanentError
from datasets.uris import SourceConfig
from pipelines.files.fetch import ModelFiles
from pipelines.files.hosts import Hosts
from tests.served_files import Served

QUICK = SourceConfig(connect_timeout_s=1.0, http_timeout_s=1.0, read_timeout_s=1.0)
NAMED = "https://files.example.org/models/"  # the base the files are named (and cached) under
RELATIVE = "moths/classifier_1a2b3c4d.pth"


def _servers(tmp_path: Path, *refusals: int) -> list[Served]:
    servers = []
    for i, refuse in enumerate(refusals):
        root = tmp_path / f"host{i}"
        (root / "moths").mkdir(parents=True)
        (root / RELATIVE).write_bytes(f"weights from host {i}".encode())
        servers.append(Served(root, refuse=refuse))
    return servers


def test_a_host_answering_403_gives_way_to_the_next_and_the_log_says_which_served(tmp_path):
    servers = _servers(tmp_path, 403, 0)
    try:
        hosts = Hosts(NAMED, tuple(s.url("") for s in servers))
        files = ModelFiles(QUICK, tmp_path / "cache", hosts=hosts)
        with capture_logs() as logs:
            assert files.read(NAMED + RELATIVE) == b"weights from host 1"
        assert [s.gets for s in servers] == [1, 1]
        failed = [e for e in logs if e["event"] == "model_file_host_failed"]
        assert len(failed) == 1 and "HTTP 403" in failed[0]["error"]
        downloaded = next(e for e in logs if e["event"] == "model_file_downloaded")
        assert downloaded["served_by"] == servers[1].url(RELATIVE)
        assert downloaded["uri"] == NAMED + RELATIVE  # cached as it is named
        servers[1].stop()  # the next start: from the cache, no host asked
        assert ModelFiles(QUICK, tmp_path / "cache", hosts=hosts).read(NAMED + RELATIVE) == (
            b"weights from host 1"
        )
        assert servers[0].gets == 1
    finally:
        for server in servers:
            server.stop()


def test_when_no_host_serves_the_error_names_each_host_and_its_answer(tmp_path):
    servers = _servers(tmp_path, 403, 410)
    try:
        hosts = Hosts(NAMED, tuple(s.url("") for s in servers))
        files = ModelFiles(QUICK, tmp_path / "cache", hosts=hosts)
        with pytest.raises(PermanentError) as refused:
            files.read(NAMED + RELATIVE)
    finally:
        for server in servers:
            server.stop()
    message = str(refused.value)
    assert "none of its 2 hosts served it" in message
    assert servers[0].url(RELATIVE) + ": HTTP 403" in message
    assert servers[1].url(RELATIVE) + ": HTTP 410" in message
    assert list((tmp_path / "cache").glob("*.json")) == []
