"""The source policy: what a task's URL may reach, how much it may read, for how long."""

from __future__ import annotations

import ipaddress
import os
import threading
from collections.abc import Callable

import pytest

from config.errors import PermanentError, TransientError
from datasets.httpget import refused_address
from datasets.uris import SourceConfig, read_bytes
from tests.listeners import Listener

LOCAL = frozenset({"127.0.0.1"})


# -- file:// ---------------------------------------------------------------------------------
def refused(uri: str, config: SourceConfig) -> str:
    with pytest.raises(PermanentError) as error:
        read_bytes(uri, config)
    return error.value.kind


def test_file_urls_are_refused_by_default_even_for_files_that_exist(tmp_path):
    path = tmp_path / "a.jpg"
    path.write_bytes(b"abc")
    assert refused(f"file://{path}", SourceConfig()) == "file_refused"
    assert refused("file:///proc/self/environ", SourceConfig()) == "file_refused"


def test_under_a_root_regular_files_are_read_and_nothing_else_is(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    (root / "a.jpg").write_bytes(b"abc")
    (tmp_path / "secret.txt").write_text("AWS_SECRET_ACCESS_KEY=x")
    (root / "escape.jpg").symlink_to(tmp_path / "secret.txt")
    os.mkfifo(root / "fifo.jpg")
    config = SourceConfig(file_roots=(str(root),))

    assert read_bytes(f"file://{root}/a.jpg", config) == b"abc"
    assert read_bytes(f"file://localhost{root}/a.jpg", config) == b"abc"
    assert refused(f"file://{root}/escape.jpg", config) == "file_refused"
    assert refused(f"file://{root}/../secret.txt", config) == "file_refused"
    assert refused(f"file://{root}/fifo.jpg", config) == "file_refused"  # and did not block
    assert refused(f"file://otherhost{root}/a.jpg", config) == "file_refused"
    assert refused("file:///dev/zero", SourceConfig(file_roots=("/dev",))) == "file_refused"
    assert refused(f"file://{root}/none.jpg", config) == "object_missing"


def test_a_file_over_the_byte_cap_is_too_large(tmp_path):
    (tmp_path / "big.jpg").write_bytes(b"x" * 2048)
    config = SourceConfig(file_roots=(str(tmp_path),), max_bytes=1024)
    assert refused(f"file://{tmp_path}/big.jpg", config) == "too_large"


# -- http(s):// ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "255.255.255.255",
        "::1",
        "fe80::1",
        "fc00::1",
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
        "2002:7f00:1::1",
        "ff02::1",
    ],
)
def test_private_loopback_link_local_multicast_and_reserved_addresses_are_refused(address):
    assert refused_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["8.8.8.8", "52.216.0.1", "2600:1f18::1"])
def test_public_addresses_are_not_refused(address):
    assert not refused_address(ipaddress.ip_address(address))


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "localhost", "127.1", "2130706433", "0x7f000001", "[::1]", "[::ffff:7f00:1]"],
)
def test_urls_to_loopback_by_any_spelling_never_reach_the_listener(host):
    with Listener(b"IMAGE") as listener:
        url = f"http://{host}:{listener.port}/image?X-Amz-Signature=SECRET"
        with pytest.raises(PermanentError) as error:
            read_bytes(url, SourceConfig())
        assert error.value.kind in ("address_refused", "object_missing", "invalid_uri")
        assert "SECRET" not in str(error.value)
    assert listener.requests == []


def test_an_allowed_host_is_read_and_so_is_the_s3_endpoints_host():
    with Listener(b"IMAGE") as listener:
        assert read_bytes(listener.url("/image"), SourceConfig(allowed_hosts=LOCAL)) == b"IMAGE"
        endpoint = SourceConfig(s3_endpoint_url=f"http://127.0.0.1:{listener.port}")
        assert read_bytes(listener.url("/image?X-Amz-Signature=s"), endpoint) == b"IMAGE"
    assert len(listener.requests) == 2


def test_a_redirect_is_checked_again_and_refused_when_it_leads_somewhere_private():
    with Listener(b"IMAGE") as allowed, Listener(b"METADATA") as internal:
        target = internal.url("/image", host="localhost")  # not the allowed name
        with pytest.raises(PermanentError) as error:
            read_bytes(allowed.url(f"/redirect?to={target}"), SourceConfig(allowed_hosts=LOCAL))
        assert error.value.kind == "address_refused"
        assert internal.requests == []
        ok = allowed.url("/redirect?to=/image")
        assert read_bytes(ok, SourceConfig(allowed_hosts=LOCAL)) == b"IMAGE"


def test_redirects_are_bounded_and_never_change_scheme():
    with Listener() as listener:
        loop = listener.url("/redirect?to=/redirect%3Fto%3D/image")
        config = SourceConfig(allowed_hosts=LOCAL, max_redirects=1)
        with pytest.raises(PermanentError, match="redirects"):
            read_bytes(loop, config)
        to_https = listener.url(f"/redirect?to=https://127.0.0.1:{listener.port}/image")
        with pytest.raises(PermanentError, match="another scheme"):
            read_bytes(to_https, SourceConfig(allowed_hosts=LOCAL))


def test_the_byte_cap_holds_while_reading_whatever_the_server_declares():
    with Listener(b"x" * 5000) as listener:
        config = SourceConfig(allowed_hosts=LOCAL, max_bytes=1000)
        with pytest.raises(PermanentError) as declared:
            read_bytes(listener.url("/image"), config)
        with pytest.raises(PermanentError) as undeclared:
            read_bytes(listener.url("/endless"), config)
    assert declared.value.kind == undeclared.value.kind == "too_large"


def test_a_server_that_drips_one_byte_at_a_time_is_cut_at_the_object_deadline():
    with Listener(drip_interval_s=0.05) as listener:
        config = SourceConfig(allowed_hosts=LOCAL, object_deadline_s=0.5, http_timeout_s=5)
        with pytest.raises(TransientError) as error:
            read_bytes(listener.url("/drip"), config)
    assert error.value.kind == "deadline_exceeded"


def test_the_s3_endpoints_allowance_is_its_host_and_port_not_every_port_on_that_host():
    with Listener(b"IMAGE") as other:
        config = SourceConfig(s3_endpoint_url=f"http://127.0.0.1:{other.port + 1}")
        with pytest.raises(PermanentError) as error:
            read_bytes(other.url("/image"), config)
        assert error.value.kind == "address_refused"
        assert (
            read_bytes(
                other.url("/image"),
                SourceConfig(allowed_hosts=frozenset({f"127.0.0.1:{other.port}"})),
            )
            == b"IMAGE"
        )
    assert len(other.requests) == 1


def test_nat64_addresses_are_unwrapped_and_checked():
    assert refused_address(ipaddress.ip_address("64:ff9b::a9fe:a9fe"))  # 169.254.169.254
    assert not refused_address(ipaddress.ip_address("64:ff9b::808:808"))  # 8.8.8.8


def test_a_tls_server_that_never_finishes_its_handshake_is_cut_at_the_object_deadline():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, then says nothing
        port = silent.getsockname()[1]
        config = SourceConfig(allowed_hosts=LOCAL, object_deadline_s=0.5, http_timeout_s=30)
        with pytest.raises(TransientError) as error:
            read_bytes(f"https://127.0.0.1:{port}/x.jpg", config)
    assert error.value.kind == "deadline_exceeded"


def test_a_body_cut_short_of_its_content_length_is_transient_not_a_corrupt_image():
    import socket
    import threading

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def answer_half() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)

        responder = threading.Thread(target=answer_half, daemon=True)
        responder.start()
        with pytest.raises(TransientError):
            one_attempt = SourceConfig(allowed_hosts=LOCAL, max_attempts=1)
            read_bytes(f"http://127.0.0.1:{port}/x.jpg", one_attempt)
        responder.join(timeout=5)


def test_an_invalid_request_target_is_reported_without_its_query():
    with Listener() as listener:
        url = listener.url("/a\x01b?key=AIzaSECRET")
        with pytest.raises(PermanentError) as error:
            read_bytes(url, SourceConfig(allowed_hosts=LOCAL))
    assert "AIzaSECRET" not in str(error.value)
    assert listener.requests == []


# -- interim answers ---------------------------------------------------------------------------
def test_an_image_answered_early_hints_first_is_read_from_the_final_answer():
    with Listener(b"IMAGE", keep_alive=True) as listener:
        config = SourceConfig(allowed_hosts=LOCAL)
        assert read_bytes(listener.url("/hints"), config) == b"IMAGE"
        assert read_bytes(listener.url("/hints"), config) == b"IMAGE"  # on the kept connection


def test_a_server_that_sends_interim_answers_for_ever_is_cut_as_transient():
    with Listener(drip_interval_s=0.01) as listener:
        config = SourceConfig(allowed_hosts=LOCAL, object_deadline_s=2.0, max_attempts=1)
        with pytest.raises(TransientError) as error:
            read_bytes(listener.url("/hints-forever"), config)
    assert error.value.kind == "http_unavailable"  # a broken answer, not a permanent HTTP 103


# -- S3: one deadline from the request to the last byte ----------------------------------------
def read_in_time(read: Callable[[], bytes], deadline_s: float) -> BaseException | None:
    """What ``read`` raised, waited for its deadline and a margin for a busy machine (its
    thread is left to the server's stop when it has not ended by then)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            read()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            raised.append(error)

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    reader.join(timeout=deadline_s + 10.0)
    assert not reader.is_alive(), f"still reading {deadline_s + 10.0:g}s in"
    return raised[0] if raised else None


def test_an_s3_endpoint_that_trickles_its_headers_is_cut_at_the_object_deadline(monkeypatch):
    # A header byte every 2 s: inside botocore's read timeout (5 s) each time.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    with Listener(b"IMAGE", head_interval_s=2.0) as endpoint:
        config = SourceConfig(
            s3_endpoint_url=endpoint.url(""), object_deadline_s=5.0, read_timeout_s=5.0
        )
        error = read_in_time(lambda: read_bytes("s3://bucket/a.jpg", config), 5.0)
    assert isinstance(error, TransientError)
    assert error.kind == "deadline_exceeded"
