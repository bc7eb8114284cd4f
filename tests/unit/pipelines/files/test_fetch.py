"""Model files by URL (pipelines/files): downloaded once per host, checked against the declared
or recorded sha256, used offline from the cache; refused files leave nothing behind. A real
HTTP server on 127.0.0.1 serves them and counts its GETs."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from config.errors import ConfigError, PermanentError, TransientError
from datasets.uris import SourceConfig
from pipelines.files.fetch import ModelFiles
from tests.listeners import Listener
from tests.served_files import Served

ROOT = Path(__file__).parents[4]
QUICK = SourceConfig(connect_timeout_s=1.0, http_timeout_s=1.0, read_timeout_s=1.0)


def _publish(served: Served, name: str, data: bytes) -> str:
    (served.root / name).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _kept(cache: Path) -> list[str]:
    """What the cache holds besides its lock files."""
    return sorted(p.name for p in cache.glob("*") if not p.name.endswith(".lock"))


def test_a_wrong_digest_is_refused_naming_the_file_and_both_digests(served, tmp_path):
    got = _publish(served, "model.pt", b"weights v1")
    expected = "ab" * 32
    files = ModelFiles(QUICK, tmp_path / "cache")
    with pytest.raises(ConfigError) as refused:
        files.read(served.url("model.pt?token=s3cret"), expected)
    message = str(refused.value)
    assert expected in message and got in message
    assert served.url("model.pt") in message and "s3cret" not in message
    assert _kept(tmp_path / "cache") == []


def test_a_declared_digest_or_prefix_pins_and_the_full_one_is_recorded(served, tmp_path):
    sha = _publish(served, "model-x.pt", b"weights")
    files = ModelFiles(QUICK, tmp_path / "cache")
    fetched = files.fetch(served.url("model-x.pt"), sha[:8])
    assert (fetched.pinned, fetched.sha256, fetched.downloaded) == ("prefix", sha, True)
    assert files.fetch(served.url("model-x.pt"), sha).pinned == "published"
    assert files.read(served.url("model-x.pt"), sha.upper()) == b"weights"
    assert served.gets == 1  # the cached file fits both declarations
    with pytest.raises(ConfigError, match="not a sha256"):
        files.read(served.url("model-x.pt"), "1234")


def test_two_processes_starting_at_once_download_once(tmp_path):
    (tmp_path / "www").mkdir()
    server = Served(tmp_path / "www", delay_s=0.5)  # the first download still going at the second
    try:
        sha = _publish(server, "big.pt", os.urandom(256 * 1024))
        script = (
            "import sys; from pathlib import Path; from pipelines.files.fetch import ModelFiles;"
            "from datasets.uris import SourceConfig;"
            "f = ModelFiles(SourceConfig(), Path(sys.argv[2])).fetch(sys.argv[1]);"
            "print(f.sha256, f.downloaded)"
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, "-c", script, server.url("big.pt"), str(tmp_path / "cache")]
        procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True) for _ in "ab"]
        outputs = sorted(proc.communicate(timeout=60)[0].splitlines()[-1].split() for proc in procs)
    finally:
        server.stop()
    assert [proc.returncode for proc in procs] == [0, 0]
    assert outputs == [[sha, "False"], [sha, "True"]]
    assert server.gets == 1


def test_a_second_start_offline_uses_the_cache(served, tmp_path):
    url = served.url("model.pt")
    sha = _publish(served, "model.pt", b"weights")
    assert ModelFiles(QUICK, tmp_path / "cache").read(url, sha) == b"weights"
    served.stop()  # offline from here
    again = ModelFiles(QUICK, tmp_path / "cache")
    assert again.read(url, sha) == b"weights"
    assert again.read(url) == b"weights"  # nothing declared: the recorded pin holds
    assert again.fetch(url).downloaded is False


def test_a_recorded_digest_pins_the_file(served, tmp_path):
    url = served.url("labels.txt")
    first = _publish(served, "labels.txt", b"moth\n")
    files = ModelFiles(QUICK, tmp_path / "cache")
    fetched = files.fetch(url)
    assert (fetched.pinned, fetched.sha256) == ("recorded", first)
    changed = _publish(served, "labels.txt", b"moth\nbeetle\n")
    assert files.read(url) == b"moth\n"  # the pinned copy, no new download
    assert served.gets == 1
    (tmp_path / "cache" / fetched.path.name).write_bytes(b"damaged")  # type: ignore[union-attr]
    with pytest.raises(ConfigError) as refused:
        files.read(url)  # downloaded again: the server's file changed since
    assert first in str(refused.value) and changed in str(refused.value)
    assert "changed since its first download" in str(refused.value)
    assert fetched.path is not None and not fetched.path.exists()


def test_a_file_over_the_cap_is_refused_and_not_kept(served, tmp_path):
    _publish(served, "huge.pt", b"x" * 10_000)
    files = ModelFiles(QUICK, tmp_path / "cache", max_bytes=1000)
    with pytest.raises(PermanentError, match="over 1000"):
        files.fetch(served.url("huge.pt"))
    assert _kept(tmp_path / "cache") == []


def test_a_server_that_stalls_is_given_up_at_the_deadline(tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))  # connections queue, nothing answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/model.pt"
    files = ModelFiles(
        SourceConfig(connect_timeout_s=0.2, http_timeout_s=0.2, max_attempts=10),
        tmp_path / "cache",
        deadline_s=1.0,
    )
    raised: list[BaseException] = []

    def fetch() -> None:
        try:
            files.fetch(url)
        except BaseException as error:  # noqa: BLE001 - what the test looks at
            raised.append(error)

    thread = threading.Thread(target=fetch, daemon=True)
    try:
        thread.start()
        thread.join(60)  # a bound for the test, far over the deadline
    finally:
        listener.close()
    assert not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], TransientError)
    assert _kept(tmp_path / "cache") == []


def test_an_s3_model_file_whose_endpoint_trickles_its_headers_ends_at_the_deadline(
    tmp_path, monkeypatch
):
    """A header byte every 2 s, inside botocore's read timeout each time: the download (in the
    main process, where no loader timeout reaches) fails as transient by its deadline, with a
    margin for a busy machine, and nothing is kept."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    with Listener(b"weights", head_interval_s=2.0) as endpoint:
        sources = SourceConfig(s3_endpoint_url=endpoint.url(""), read_timeout_s=5.0)
        files = ModelFiles(sources, tmp_path / "cache", deadline_s=5.0)
        raised: list[BaseException] = []

        def fetch() -> None:
            try:
                files.fetch("s3://models/detector.pt")
            except BaseException as error:  # noqa: BLE001 - what the test looks at
                raised.append(error)

        thread = threading.Thread(target=fetch, daemon=True)
        thread.start()
        thread.join(5.0 + 10.0)
        assert not thread.is_alive(), "still downloading 10 s past its deadline"
    assert len(raised) == 1 and isinstance(raised[0], TransientError)
    assert raised[0].kind == "deadline_exceeded"
    assert _kept(tmp_path / "cache") == []


def test_http_elsewhere_than_this_host_needs_the_full_digest(tmp_path):
    files = ModelFiles(QUICK, tmp_path / "cache")
    with pytest.raises(ConfigError, match="use https://"):
        files.fetch("http://models.example.org/model.pt")


def test_a_local_path_is_read_as_it_is_and_checked_when_declared(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"local weights")
    sha = hashlib.sha256(b"local weights").hexdigest()
    files = ModelFiles(QUICK, tmp_path / "cache")
    assert files.fetch(str(path)).pinned == "unpinned"
    assert files.read("file://" + str(path), sha[:12]) == b"local weights"
    with pytest.raises(ConfigError, match=sha):
        files.read(str(path), "0" * 64)
    assert not (tmp_path / "cache").exists()


def test_a_classifier_loads_its_weights_and_labels_by_url_then_offline(served, tmp_path):
    import torch

    from pipelines.declare import Classifier
    from pipelines.models import ClassifierModel, save_classifier

    weights = Path(save_classifier("mobilenet_v3_small", ["moth", "beetle"], str(served.root)))
    sha = hashlib.sha256(weights.read_bytes()).hexdigest()
    stage = Classifier(
        "moths",
        architecture="mobilenet_v3_small",
        weights=served.url("model.pt"),
        weights_digest=sha[:8],
    )
    cache = tmp_path / "cache"
    model = ClassifierModel(stage, QUICK, torch.device("cpu"), files=ModelFiles(QUICK, cache))
    assert (model.algorithm.weights_sha256, model.algorithm.labels) == (sha, ("moth", "beetle"))
    served.stop()
    again = ClassifierModel(stage, QUICK, torch.device("cpu"), files=ModelFiles(QUICK, cache))
    assert again.algorithm.weights_sha256 == sha
    assert served.gets == 2  # the weights and labels.txt, once each


def test_a_redirect_to_another_scheme_is_refused(tmp_path):

    class Redirecting(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("Location", "https://127.0.0.1:9/model.pt")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/model.pt"
        with pytest.raises(PermanentError, match="another scheme"):
            ModelFiles(QUICK, tmp_path / "cache").fetch(url)
    finally:
        server.shutdown()
        server.server_close()
    assert _kept(tmp_path / "cache") == []


def test_a_cache_directory_that_cannot_be_made_is_a_config_error_naming_it(served, tmp_path):
    _publish(served, "model.pt", b"weights")
    (tmp_path / "taken").write_text("a file, not a directory")
    files = ModelFiles(QUICK, tmp_path / "taken" / "cache")
    with pytest.raises(ConfigError, match="WORKER_MODEL__CACHE_DIR: cannot write model files"):
        files.fetch(served.url("model.pt"))


def test_a_part_file_left_by_a_killed_writer_is_cleared_at_the_next_download(served, tmp_path):
    from pipelines.files.store import Store

    url = served.url("model.pt")
    _publish(served, "model.pt", b"weights")
    cache = tmp_path / "cache"
    cache.mkdir()
    left = cache / f".{Store.key(url)[:40]}.abc123.part"
    left.write_bytes(b"half a download")
    ModelFiles(QUICK, cache).fetch(url)
    assert not left.exists()
    assert not [p for p in cache.iterdir() if p.name.endswith(".part")]


def _writes_in(cache: Path, monkeypatch: pytest.MonkeyPatch, refuse: bool) -> list[str]:
    """Every open for writing under ``cache`` from here on (each refused with EROFS when
    ``refuse``): lock files and temporary files both go through ``os.open``."""
    tried: list[str] = []
    real_open = os.open
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def spying(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & writing and str(path).startswith(str(cache)):
            tried.append(str(path))
            if refuse:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spying)
    return tried


@contextlib.contextmanager
def _read_only(cache: Path) -> Iterator[None]:
    """``cache`` made read-only: modes 0555/0444, and as root (who ignores modes) the
    immutable attribute where this filesystem and process allow it."""
    for path in cache.iterdir():
        path.chmod(0o444)
    cache.chmod(0o555)
    immutable = os.geteuid() == 0 and _chattr("+i", cache)
    try:
        yield
    finally:
        if immutable:
            _chattr("-i", cache)
        cache.chmod(0o755)


def _chattr(change: str, path: Path) -> bool:
    try:
        done = subprocess.run(["chattr", change, str(path)], capture_output=True, timeout=10)
    except OSError:
        return False
    return done.returncode == 0


def test_a_filled_cache_that_cannot_be_written_is_used_offline(served, tmp_path, monkeypatch):
    url, cache = served.url("model.pt"), tmp_path / "cache"
    sha = _publish(served, "model.pt", b"weights")
    ModelFiles(QUICK, cache).fetch(url)
    served.stop()
    with _read_only(cache):
        tried = _writes_in(cache, monkeypatch, refuse=False)
        files = ModelFiles(QUICK, cache)
        assert files.read(url) == b"weights"
        assert files.fetch(url, sha).downloaded is False
    assert tried == []  # no lock taken, nothing written


def test_a_file_missing_from_a_read_only_cache_is_an_error_naming_it(served, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    _publish(served, "model.pt", b"weights")
    _writes_in(cache, monkeypatch, refuse=True)
    with pytest.raises(ConfigError) as refused:
        ModelFiles(QUICK, cache).fetch(served.url("model.pt?X-Amz-Signature=s3cret"))
    message = str(refused.value)
    assert served.url("model.pt") in message and "s3cret" not in message
    assert "WORKER_MODEL__CACHE_DIR: cannot write model files" in message
    assert "Read-only file system" in message and "not in the cache" in message
    assert served.gets == 0


def test_a_query_or_a_fragment_makes_another_file(tmp_path):
    """The whole URI is the file: ``dl?model=a`` and ``dl?model=b`` are two entries, each
    with its own bytes, and so are two fragments; credentials are no part of it."""
    from pipelines.files.store import Store

    class ByQuery(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"weights of {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), ByQuery)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        files = ModelFiles(QUICK, tmp_path / "cache")
        assert files.read(f"{base}/dl?model=a") == b"weights of /dl?model=a"
        assert files.read(f"{base}/dl?model=b") == b"weights of /dl?model=b"
        assert files.read(f"{base}/dl?model=a") == b"weights of /dl?model=a"  # cached, its own
        assert files.fetch(f"{base}/dl#1").downloaded and files.fetch(f"{base}/dl#2").downloaded
    finally:
        server.shutdown()
        server.server_close()
    assert len(_kept(tmp_path / "cache")) == 8  # four files, each with its record
    plain = "https://models.example.org/m/model.pt"
    assert Store.key("https://user:secret@models.example.org/m/model.pt") == Store.key(plain)
    assert Store.key(plain + "?sig=1") != Store.key(plain) != Store.key(plain + "#x")


def test_s3_keys_are_taken_as_s3_reads_them(s3_server, bucket, tmp_path):
    """``clf#1.pth`` and ``clf#2.pth`` are two objects (S3 keys may hold ``#``), two entries."""
    from dataclasses import replace

    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="m/clf#1.pth", Body=b"first classifier")
    client.put_object(Bucket=bucket, Key="m/clf#2.pth", Body=b"second classifier")
    sources = replace(QUICK, s3_endpoint_url=s3_server.endpoint_url)
    files = ModelFiles(sources, tmp_path / "cache")
    assert files.read(f"s3://{bucket}/m/clf#1.pth") == b"first classifier"
    assert files.read(f"s3://{bucket}/m/clf#2.pth") == b"second classifier"
    assert files.fetch(f"s3://{bucket}/m/clf#2.pth").downloaded is False


def test_no_lock_file_stays_after_a_download_or_a_failed_one(served, tmp_path):
    _publish(served, "model.pt", b"weights")
    cache = tmp_path / "cache"
    files = ModelFiles(QUICK, cache)
    files.fetch(served.url("model.pt"))
    with pytest.raises(PermanentError):
        files.fetch(served.url("missing.pt"))
    with pytest.raises(ConfigError):
        files.fetch(served.url("model.pt?v=2"), "0" * 64)  # refused: another digest declared
    assert sorted(p.name for p in cache.iterdir() if p.name.endswith(".lock")) == []
    assert len(_kept(cache)) == 2


def test_a_category_map_url_with_a_query_is_read_as_a_map(served, tmp_path):
    import torch

    from pipelines.declare import Classifier
    from pipelines.models import ClassifierModel, save_classifier

    save_classifier("mobilenet_v3_small", ["moth", "beetle"], str(served.root))
    (served.root / "map.json").write_text('{"beetle": 1, "moth": 0}')
    stage = Classifier(
        "moths",
        architecture="mobilenet_v3_small",
        weights=served.url("model.pt?X-Amz-Signature=a"),
        labels=served.url("map.json?X-Amz-Signature=b"),
    )
    files = ModelFiles(QUICK, tmp_path / "cache")
    model = ClassifierModel(stage, QUICK, torch.device("cpu"), files=files)
    assert model.algorithm.labels == ("moth", "beetle")


def test_weights_that_do_not_fit_are_refused_without_the_urls_secret(served, tmp_path):
    import torch

    from pipelines.declare import Classifier
    from pipelines.models import ClassifierModel, save_classifier

    save_classifier("mobilenet_v3_small", ["moth", "beetle", "fly"], str(served.root))
    (served.root / "two.txt").write_text("moth\nbeetle\n")
    stage = Classifier(
        "moths",
        architecture="mobilenet_v3_small",
        weights=served.url("model.pt?X-Amz-Signature=s3cret"),
        labels=served.url("two.txt"),
    )
    files = ModelFiles(QUICK, tmp_path / "cache")
    with pytest.raises(PermanentError, match="do not fit stage") as refused:
        ClassifierModel(stage, QUICK, torch.device("cpu"), files=files)
    assert served.url("model.pt") in str(refused.value) and "s3cret" not in str(refused.value)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_is_transient_naming_the_cache_and_the_bytes(
    served, tmp_path, monkeypatch, code
):
    cache = tmp_path / "cache"
    _publish(served, "model.pt", b"w" * 5000)

    def full(fd: int) -> None:  # the disk fills as the download is written (its only fsync)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(TransientError) as full_disk:
        ModelFiles(QUICK, cache).fetch(served.url("model.pt?sig=s3cret"))
    message = str(full_disk.value)
    assert f"WORKER_MODEL__CACHE_DIR: no space left in {cache}" in message
    assert "5000 bytes needed" in message and served.url("model.pt") in message
    assert "s3cret" not in message
    assert full_disk.value.retryable and not isinstance(full_disk.value, ConfigError)
    assert list(cache.iterdir()) == []  # no part file, no lock left
