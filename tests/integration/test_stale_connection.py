"""A connection that stops answering, its socket still open (a hung server, a paused VM, a
half-open path behind a NAT), against a real nats-server behind a proxy that stops forwarding:
the worker says so, at the default settings, long before the old minutes of silence."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

from tests.helpers import client, http_answer, running_worker, submit, upload_images, wait_results
from tests.tcp_proxy import StallingProxy
from worker.commands.localservers import free_port
from worker.nats.connection import ConnectionState, connect

pytestmark = pytest.mark.integration
SAID_WITHIN_S = 60.0  # 15-20 s to notice, then 6 s (room for a busy runner); it was 4-6 min
SILENT_SAID_S = 45.0  # 3 s of pings at 1 s, then 2 s for the old socket (room for a busy runner)
GAUGE = 'inference_worker_source_connected{source="nats"}'


_get = http_answer


def _gauge(port: int) -> float | None:
    _, body = _get(f"http://127.0.0.1:{port}/metrics")
    for line in body.splitlines():
        if line.startswith(GAUGE):
            return float(line.split()[-1])
    return None


async def _until(port: int, status: int, connected: float, within_s: float) -> str:
    """Until /healthz answers ``status`` and the source gauge reads ``connected``."""
    deadline = time.monotonic() + within_s
    while True:
        code, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/healthz")
        gauge = await asyncio.to_thread(_gauge, port)
        if code == status and gauge == connected:
            return body
        assert time.monotonic() < deadline, (
            f"after {within_s}s /healthz is {code} ({body.strip()}), the gauge {gauge}"
        )
        await asyncio.sleep(0.5)


async def test_a_connection_that_stops_answering_is_reported_and_replaced_when_it_answers(
    own_nats_server, s3_server, bucket, settings_for
):
    # Given a worker on a single nats-server, through a proxy, at the default NATS settings
    proxy = await StallingProxy(own_nats_server.port).start()
    port = free_port()
    settings = settings_for(proxy.url, metrics={"port": port})
    direct = settings_for(own_nats_server.url)  # the same streams, not through the proxy
    (image,) = upload_images(s3_server.client(), bucket, 1)
    try:
        async with running_worker(settings) as app:
            await _until(port, 200, 1.0, 30)
            # When the path stops forwarding, both sockets left open
            proxy.stall()
            stalled_at = time.monotonic()
            # Then the worker says so: the gauge reads 0, /healthz 503 naming the connection
            body = await _until(port, 503, 0.0, SAID_WITHIN_S)
            print(f"said after {time.monotonic() - stalled_at:.1f} s: {body.strip()}")
            assert "nats" in body and "stale" in body, body
            assert app.worker is not None and not app.parts.connection.closed.is_set()
            # And when the path forwards again, the same process serves again
            proxy.resume()
            await _until(port, 200, 1.0, 30)
            async with client(direct) as js:
                await submit(js, direct, "job-after-stall", [image])
                (result,) = await wait_results(js, direct, "job-after-stall", 1, timeout_s=60)
            assert result["status"] == "ok"
    finally:
        await proxy.close()


async def test_a_silent_server_with_unsent_bytes_queued_is_left_and_said(
    own_nats_server, settings_for
):
    """A frozen server stops reading: the client's unsent bytes fill the socket's buffers,
    and nats-py's reconnect waits for that socket to close, which TCP does only after many
    minutes. The worker's connection aborts it: the disconnect is said (stale) and the
    reconnect goes on, the same connection object, once the server answers again."""
    settings = settings_for(
        own_nats_server.url, nats={"ping_interval_s": 1, "max_outstanding_pings": 2}
    )
    state = ConnectionState()
    nc = await connect(settings.nats, state=state)
    assert own_nats_server.proc is not None
    pid = own_nats_server.proc.pid
    payload = b"x" * 50_000
    try:
        try:
            # Given a client publishing large messages when its server freezes
            os.kill(pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            while state.disconnected_at is None and time.monotonic() - frozen_at < SILENT_SAID_S:
                with contextlib.suppress(Exception):  # a full buffer may hold a publish
                    await asyncio.wait_for(nc.publish("stale.fill", payload), 1)
                await asyncio.sleep(0.02)
            # Then the connection is said to be down, as stale, within seconds
            assert state.disconnected_at is not None, (
                f"after {SILENT_SAID_S}s of a frozen server the client still said connected"
            )
            print(f"said after {state.disconnected_at - frozen_at:.1f} s")
            assert state.stale and not state.connected()
        finally:
            os.kill(pid, signal.SIGCONT)
        # And once the server answers again, the same client serves again
        await state.until_connected(30)
        assert state.connected()
        await asyncio.wait_for(nc.flush(), 10)
    finally:
        state.closing = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 10)  # bounded: a stuck socket may never close
