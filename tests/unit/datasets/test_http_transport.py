"""Image reads over kept-alive connections: one connection for many images of an origin, none
shared across a fork, none left open by a failure, none past its deadline."""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
import warnings

import pytest

from config.errors import PermanentError, TooLarge, TransientError
from datasets import http_transport
from datasets.uris import SourceConfig, read_bytes
from tests.listeners import Listener

LOCAL = frozenset({"127.0.0.1"})
CONFIG = SourceConfig(allowed_hosts=LOCAL, reads_in_flight=2)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fds_once_settled(expected: int, timeout_s: float = 10.0) -> int:
    """The process's open descriptors, once down to ``expected`` or after ``timeout_s``: the
    listener's ends (in this process too) close as its handler threads see the client's close."""
    deadline = time.monotonic() + timeout_s
    while open_fds() > expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return open_fds()


@pytest.fixture(autouse=True)
def no_idle_connections():
    http_transport.close_idle()
    yield
    http_transport.close_idle()


def test_many_images_of_one_origin_take_one_connection():
    with Listener(b"IMAGE", keep_alive=True) as listener:
        for _ in range(10):
            assert read_bytes(listener.url("/image"), CONFIG) == b"IMAGE"
    assert len(listener.requests) == 10
    assert listener.connections == 1


def test_reads_at_once_take_a_connection_each_and_keep_at_most_reads_in_flight():
    with Listener(b"IMAGE", keep_alive=True) as listener:
        url = listener.url("/image")
        results: list[bytes] = []
        threads = [
            threading.Thread(target=lambda: results.append(read_bytes(url, CONFIG)))
            for _ in range(6)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert results == [b"IMAGE"] * 6
        assert http_transport.pool().idle_count() <= CONFIG.reads_in_flight


def test_failed_reads_leave_no_descriptor_open():
    with Listener(b"x" * 5000, keep_alive=True) as listener:
        before = open_fds()
        capped = SourceConfig(allowed_hosts=LOCAL, max_bytes=1000, reads_in_flight=2)
        for _ in range(5):
            assert read_bytes(listener.url("/image"), CONFIG) == b"x" * 5000
            with pytest.raises(PermanentError):
                read_bytes(listener.url("/image"), capped)  # too large: closed mid-body
            with pytest.raises(PermanentError):
                read_bytes(listener.url("/redirect?to=/redirect%3Fto%3D/image"), capped)
            assert read_bytes(listener.url("/redirect?to=/image"), CONFIG) == b"x" * 5000
            with pytest.raises(PermanentError):
                read_bytes(listener.url("/endless"), capped)
        kept = CONFIG.reads_in_flight  # each kept connection: our end and the listener's
        assert fds_once_settled(before + 2 * kept) <= before + 2 * kept
        http_transport.close_idle()
        assert fds_once_settled(before) == before


def test_the_object_deadline_holds_on_a_kept_connection_and_it_is_not_kept_after():
    with Listener(b"IMAGE", keep_alive=True, drip_interval_s=0.05) as listener:
        before = open_fds()
        assert read_bytes(listener.url("/image"), CONFIG) == b"IMAGE"
        short = SourceConfig(
            allowed_hosts=LOCAL, reads_in_flight=2, object_deadline_s=0.5, http_timeout_s=5
        )
        with pytest.raises(TransientError) as error:
            read_bytes(listener.url("/drip"), short)  # on the kept connection
        assert error.value.kind == "deadline_exceeded"
        assert listener.connections == 1
        assert http_transport.pool().idle_count() == 0
        assert fds_once_settled(before) == before


def test_a_connection_the_server_closed_while_idle_is_replaced_without_a_failure():
    answered = 0
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def answer_then_hang_up() -> None:  # HTTP/1.1, no "Connection: close", then closed
            nonlocal answered
            for _ in range(3):
                conn, _ = server.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nIMAGE")
                    answered += 1
                    conn.shutdown(socket.SHUT_RDWR)

        responder = threading.Thread(target=answer_then_hang_up, daemon=True)
        responder.start()
        one_attempt = SourceConfig(allowed_hosts=LOCAL, max_attempts=1)
        for _ in range(3):
            assert read_bytes(f"http://127.0.0.1:{port}/x.jpg", one_attempt) == b"IMAGE"
        responder.join(timeout=5)
    assert answered == 3


def test_a_forked_child_never_uses_its_parents_connection():
    with Listener(b"IMAGE", keep_alive=True) as listener:
        url = listener.url("/image")
        assert read_bytes(url, CONFIG) == b"IMAGE"  # the parent's connection, now idle
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: we exit
            pid = os.fork()
        if pid == 0:
            ok = False
            try:
                ok = http_transport.pool().idle_count() == 0 and read_bytes(url, CONFIG) == b"IMAGE"
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert listener.connections == 2  # the child's own
        assert read_bytes(url, CONFIG) == b"IMAGE"  # the parent's, still good
        assert listener.connections == 2


class _Plain:
    """A route to the listener with no policy of its own: what the transport alone does."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.kept = http_transport.Pool(max_origins=1, max_idle_s=None)

    def take(self) -> http.client.HTTPConnection | None:
        return self.kept.take("listener")

    def dial(self, exchange: http_transport.Exchange) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=exchange.timeout_s())

    def wants_body(self, status: int) -> bool:
        return True

    def admit(self, size_bytes: int) -> None:
        pass

    def keeps(self, status: int) -> bool:
        return True

    def give(self, conn: http.client.HTTPConnection) -> None:
        self.kept.give("listener", conn, 2)


def fetched(
    listener: Listener, path: str, exchange: http_transport.Exchange, max_bytes: int = 10**6
) -> http_transport.Answer:
    request = http_transport.Request("GET", path, {}, max_bytes=max_bytes)
    return http_transport.fetch(exchange, request, _Plain(listener.port))


def in_s(seconds: float) -> float:
    return time.monotonic() + seconds


def test_the_transport_never_follows_a_redirect_it_returns_it_with_its_location():
    with Listener(b"IMAGE", keep_alive=True) as listener:
        answer = fetched(listener, "/redirect?to=/image", http_transport.Exchange(in_s(5)))
    assert (answer.status, answer.location) == (302, "/image")
    assert listener.requests == ["/redirect?to=/image"]  # the target was never asked


def test_a_body_over_the_cap_is_too_large_declared_or_found_while_reading():
    with Listener(b"x" * 5000, keep_alive=True) as listener:
        with pytest.raises(TooLarge) as declared:
            fetched(listener, "/image", http_transport.Exchange(in_s(5)), max_bytes=1000)
        assert declared.value.declared == 5000
        with pytest.raises(TooLarge) as read:
            fetched(listener, "/endless", http_transport.Exchange(in_s(5)), max_bytes=100_000)
        assert read.value.declared is None


def test_an_exchange_its_caller_cuts_ends_a_dripping_answer_at_once():
    """The Antenna client's way: no timer of the exchange's own, the event loop cuts it."""
    with Listener(keep_alive=True, drip_interval_s=0.05) as listener:
        exchange = http_transport.Exchange(in_s(60))
        threading.Timer(0.5, exchange.cut).start()
        started = time.monotonic()
        with pytest.raises(OSError):
            fetched(listener, "/drip", exchange)
        assert time.monotonic() - started < 5


def test_an_exchange_with_its_own_timer_ends_a_dripping_answer_at_its_deadline():
    with Listener(keep_alive=True, drip_interval_s=0.05) as listener:
        started = time.monotonic()
        with pytest.raises(OSError):
            fetched(listener, "/drip", http_transport.Exchange(in_s(0.5), cut_at_deadline=True))
        assert time.monotonic() - started < 5
