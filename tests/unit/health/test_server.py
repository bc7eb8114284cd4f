"""The metrics server: no number of idle or half-open connections exhausts threads or fds."""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request

from prometheus_client import CollectorRegistry

from worker.health.server import HealthServer, Probes


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def healthz(port: int, path: str = "/healthz") -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return int(response.status)


def until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_three_hundred_idle_connections_hold_neither_threads_nor_descriptors():
    server = HealthServer(
        "127.0.0.1",
        0,
        CollectorRegistry(),
        Probes(lambda: None, lambda: None),
        max_connections=8,
        connection_deadline_s=1.0,
    )
    server.start()
    threads_before, fds_before = threading.active_count(), open_fds()
    clients = []
    try:
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.sendall(b"GET /metr")  # half a request line, then nothing
            clients.append(sock)
        # Ours are 300 client sockets; the server keeps at most 8 of its own ends open.
        assert until(lambda: open_fds() - fds_before - len(clients) <= 8, 5)
        assert threading.active_count() - threads_before <= 2 * 8
        # The slow ones are cut at their deadline and the server answers again.
        assert until(lambda: _answers(server.port), 10)
    finally:
        for sock in clients:
            sock.close()
        server.close()


def _answers(port: int) -> bool:
    try:
        return healthz(port) == 200
    except OSError:
        return False


def test_healthz_says_why_the_process_is_unhealthy():
    reason: list[str | None] = [None]
    server = HealthServer(
        "127.0.0.1", 0, CollectorRegistry(), Probes(lambda: None, lambda: reason[0])
    )
    server.start()
    try:
        assert healthz(server.port) == 200
        reason[0] = "nats: disconnected for 61s (timeout 60s)"
        for path in ("/healthz", "/readyz"):  # not ready; /healthz answers as /readyz
            try:
                healthz(server.port, path)
            except urllib.error.HTTPError as error:
                assert error.code == 503
                assert error.read().decode().startswith("nats: disconnected")
            else:
                raise AssertionError(f"expected 503 from {path}")
        assert healthz(server.port, "/livez") == 200  # a restart would not mend it
    finally:
        server.close()


def test_idle_local_connections_to_the_healthwatch_listener_cannot_shut_its_probe_out():
    server = HealthServer(
        "127.0.0.1", 0, CollectorRegistry(), Probes(lambda: None, lambda: None), healthz_port=0
    )
    server.start()
    assert server.healthz_port is not None
    for count in (10, 100):  # more than the listener had slots; more than it has
        clients = [
            socket.create_connection(("127.0.0.1", server.healthz_port), timeout=5)
            for _ in range(count)
        ]
        try:
            # Given ``count`` idle connections held open, when healthwatch probes, it is answered
            assert healthz(server.healthz_port) == 200
            assert healthz(server.healthz_port) == 200
        finally:
            for sock in clients:
                sock.close()
    server.close()


def test_readyz_never_shows_a_secret_of_a_load_error():
    """An unavailable pipeline's load error can name a presigned or tokened URL; the probe's
    body, ready (the note) or not, shows it redacted, as logs and results do."""
    secret = "X-Amz-Signature=abc123secret"
    url = f"https://h.example/w.pt?{secret}&token=t0psecret"
    error = f"moth_binary: model_load_failed: GET {url}"
    reason: list[str | None] = [None]
    probes = Probes(lambda: None, lambda: reason[0], ready_note=lambda: error)
    server = HealthServer("127.0.0.1", 0, CollectorRegistry(), probes)
    server.start()
    try:
        url = f"http://127.0.0.1:{server.port}/readyz"
        with urllib.request.urlopen(url, timeout=5) as response:
            body = response.read().decode()
        assert body.startswith("ok: moth_binary: model_load_failed: GET https://h.example/w.pt")
        reason[0] = error
        try:
            urllib.request.urlopen(url, timeout=5)
        except urllib.error.HTTPError as refused:
            body += refused.read().decode()
        assert "h.example/w.pt" in body and "abc123secret" not in body
        assert "t0psecret" not in body
    finally:
        server.close()
