"""A shaped network in front of a local HTTP endpoint (S3 or an image server), for the
benchmarks and tests: S3's latency and bandwidth on 127.0.0.1.

    python -m testing.shapednet UPSTREAM_PORT LISTEN_PORT SHAPE_JSON

Each request waits for a first-byte delay drawn from a log-normal distribution (median
``first_byte_median_s``, 99th percentile ``first_byte_p99_s``; AWS plans for ~30 ms and a tail
to ~300 ms), its response is paced to ``bytes_per_s`` per connection (90 MB/s, AWS's figure
per request) and optionally to ``total_bytes_per_s`` across connections. A fraction of requests
(or the first few GETs, for tests) can be dropped (connection closed), stalled (no byte until
the client gives up, at most ``stall_s``) or throttled (503 SlowDown, as S3 answers).

It speaks just enough HTTP/1.1 to know where each request and response ends (Content-Length;
otherwise the connection is relayed until it closes), keeps counts of its own (requests, the
most in flight at once, the connection each request came on), and answers
``GET /__shaped__/stats`` itself with them as JSON. It listens on 127.0.0.1 only, serves at
most ``max_connections`` at once, and exits when its parent does. ``ShapedProxy`` starts and
stops it as a child process, so its relaying does not share a GIL with what it measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

STATS_PATH = "/__shaped__/stats"
_CHUNK_BYTES = 1024 * 1024  # large: fewer wake-ups per MB, so the relay costs little CPU
_HEAD_MAX_BYTES = 64 * 1024
_Z99 = 2.3263  # the standard normal's 99th percentile
_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@dataclass(frozen=True)
class Shape:
    first_byte_median_s: float = 0.030
    first_byte_p99_s: float = 0.300
    bytes_per_s: float = 90e6  # per connection; 0 = no cap
    total_bytes_per_s: float = 0.0  # across connections; 0 = no cap
    drop_fraction: float = 0.0
    stall_fraction: float = 0.0
    throttle_fraction: float = 0.0
    drop_first: int = 0  # the first N GETs are dropped (deterministic, for tests), then
    stall_first: int = 0  # the next N stalled, then
    throttle_first: int = 0  # the next N throttled
    stall_s: float = 60.0  # longest a stalled request is held
    max_connections: int = 256
    seed: int = 0

    def delay_s(self, rng: random.Random) -> float:
        if self.first_byte_median_s <= 0:
            return 0.0
        ratio = max(1.0, self.first_byte_p99_s / self.first_byte_median_s)
        sigma = math.log(ratio) / _Z99
        return rng.lognormvariate(math.log(self.first_byte_median_s), sigma)


UNSHAPED = Shape(first_byte_median_s=0.0, bytes_per_s=0.0)


@dataclass
class Stats:
    connections: int = 0
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    dropped: int = 0
    stalled: int = 0
    throttled: int = 0
    bytes_sent: int = 0
    gets: list[tuple[int, str, str]] = field(default_factory=list)  # (connection, path, fate)


class _Relay:
    def __init__(self, upstream_port: int, shape: Shape) -> None:
        self.upstream_port = upstream_port
        self.shape = shape
        self.stats = Stats()
        self.rng = random.Random(shape.seed)
        self.ids = itertools.count(1)
        self.open = 0
        self.total_next = 0.0  # when the shared bandwidth is free again

    def fate(self, method: str) -> str:
        if method != "GET":
            return "ok"
        n = len(self.stats.gets)
        s = self.shape
        faults = (
            ("dropped", s.drop_first, s.drop_fraction),
            ("stalled", s.stall_first, s.stall_fraction),
            ("throttled", s.throttle_first, s.throttle_fraction),
        )
        for name, first, _ in faults:  # the first GETs: so many dropped, then stalled, ...
            if n < first:
                return name
            n -= first
        draw = self.rng.random()
        for name, _, fraction in faults:
            if draw < fraction:
                return name
            draw -= fraction
        return "ok"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open >= self.shape.max_connections:
            writer.close()
            return
        self.open += 1
        self.stats.connections += 1
        conn = next(self.ids)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                request = await _read_message_head(reader)
                if request is None:
                    return
                head, method, path, headers = request
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                if path == STATS_PATH:
                    await _answer(writer, 200, json.dumps(asdict(self.stats)).encode())
                    continue
                arrived = time.monotonic()
                fate = self.fate(method)
                self.stats.requests += 1
                if method == "GET":
                    self.stats.gets.append((conn, path, fate))
                if fate == "dropped":
                    self.stats.dropped += 1
                    return
                if fate == "stalled":
                    self.stats.stalled += 1
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(reader.read(), self.shape.stall_s)
                    return
                if fate == "throttled":
                    self.stats.throttled += 1
                    await _answer(writer, 503, _SLOWDOWN, b"Content-Type: application/xml\r\n")
                    continue
                if upstream is None:
                    upstream = await asyncio.open_connection(
                        "127.0.0.1", self.upstream_port, limit=_CHUNK_BYTES
                    )
                self.stats.in_flight += 1
                self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight)
                try:
                    keep_client, keep_upstream = await self._relay(
                        method, head + body, upstream, writer, arrived
                    )
                finally:
                    self.stats.in_flight -= 1
                if not keep_upstream:
                    upstream[1].close()
                    upstream = None
                if not keep_client:
                    return
        except (OSError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            self.open -= 1
            for w in (writer, upstream[1] if upstream else None):
                if w is not None:
                    w.close()

    async def _relay(
        self,
        method: str,
        request: bytes,
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        writer: asyncio.StreamWriter,
        arrived: float,
    ) -> tuple[bool, bool]:
        """One exchange; whether the client's connection, and the upstream one, can serve
        another. The client's is kept alive as S3 keeps it, whatever the local endpoint
        does, whenever the response's end is known."""
        up_reader, up_writer = upstream
        up_writer.write(request)
        await up_writer.drain()
        response = await _read_message_head(up_reader)
        while response is not None and response[2].startswith("1"):  # interim: 100 Continue
            writer.write(response[0])
            response = await _read_message_head(up_reader)
        if response is None:
            return False, False
        head, _version, status, headers = response
        await asyncio.sleep(max(0.0, arrived + self.shape.delay_s(self.rng) - time.monotonic()))
        no_body = method == "HEAD" or status in ("204", "304")
        length = None if no_body else headers.get("content-length")
        left = 0 if no_body else int(length) if length and length.isdigit() else -1
        lines = [line for line in head.split(b"\r\n") if line]
        lines = [line for line in lines if not line.lower().startswith(b"connection:")]
        if left < 0:  # relayed until the upstream closes: so is the client's connection
            lines.append(b"Connection: close")
        writer.write(b"\r\n".join(lines) + b"\r\n\r\n")
        started = time.monotonic()
        sent = 0
        # At most 50 ms of the connection's bandwidth per chunk: a slow link still trickles.
        rate = self.shape.bytes_per_s
        chunk_bytes = min(_CHUNK_BYTES, max(16 * 1024, int(rate * 0.05))) if rate else _CHUNK_BYTES
        while left != 0:
            if left < 0:
                chunk = await up_reader.read(chunk_bytes)
            else:
                chunk = await up_reader.readexactly(min(left, chunk_bytes))
            if not chunk:
                return False, False
            if left > 0:
                left -= len(chunk)
            sent += len(chunk)
            await self._pace(started, sent, len(chunk))
            writer.write(chunk)
            await writer.drain()
            self.stats.bytes_sent += len(chunk)
        await writer.drain()
        return left == 0, left == 0 and headers.get("connection", "").lower() != "close"

    async def _pace(self, started: float, sent: int, chunk: int) -> None:
        s = self.shape
        now = time.monotonic()
        wait = started + sent / s.bytes_per_s - now if s.bytes_per_s > 0 else 0.0
        if s.total_bytes_per_s > 0:
            start = max(now, self.total_next)
            self.total_next = start + chunk / s.total_bytes_per_s
            wait = max(wait, start - now)
        if wait > 0:
            await asyncio.sleep(wait)


async def _read_message_head(
    reader: asyncio.StreamReader,
) -> tuple[bytes, str, str, dict[str, str]] | None:
    """(raw head, first word, second word, lower-cased headers), or None at a clean EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as error:
        if error.partial:
            raise
        return None
    except asyncio.LimitOverrunError:
        raise ValueError("message head too long") from None
    lines = head.decode("latin-1").split("\r\n")
    words = lines[0].split(" ")
    if len(words) < 2:
        raise ValueError("malformed start line")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return head, words[0], words[1], headers


async def _answer(
    writer: asyncio.StreamWriter, status: int, body: bytes, extra: bytes = b""
) -> None:
    reason = {200: b"OK", 503: b"Slow Down"}[status]
    writer.write(
        b"HTTP/1.1 %d %s\r\nContent-Length: %d\r\n%s\r\n" % (status, reason, len(body), extra)
        + body
    )
    await writer.drain()


async def _main(upstream_port: int, port: int, shape: Shape, parent: int) -> None:
    relay = _Relay(upstream_port, shape)
    server = await asyncio.start_server(relay.serve, "127.0.0.1", port, limit=_HEAD_MAX_BYTES)
    async with server:
        while os.getppid() == parent:  # noqa: ASYNC110 - the parent is gone: so are we
            await asyncio.sleep(0.5)
        os._exit(0)  # at once, without waiting for the connections still open


class ShapedProxy:
    """The shaped network as a child process on a free port of 127.0.0.1."""

    def __init__(self, upstream_port: int, shape: Shape) -> None:
        from worker.commands.localservers import free_port

        self.upstream_port = upstream_port
        self.shape = shape
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ShapedProxy:
        from worker.commands.localservers import wait_port

        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "testing.shapednet",
                str(self.upstream_port),
                str(self.port),
                json.dumps(asdict(self.shape)),
            ]
        )
        try:
            wait_port(self.port, self._proc, "shaped network")
        except BaseException:
            self.stop()
            raise
        return self

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + STATS_PATH, timeout=5) as response:
            stats: dict[str, Any] = json.loads(response.read())
        return stats

    def stop(self) -> None:
        from worker.commands.localservers import stop_process

        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process(proc, wait_s=5.0)

    def __enter__(self) -> ShapedProxy:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    upstream_arg, port_arg, shape_arg = sys.argv[1:4]
    asyncio.run(
        _main(int(upstream_arg), int(port_arg), Shape(**json.loads(shape_arg)), os.getppid())
    )
