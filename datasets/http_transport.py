"""The one HTTP transport of the worker's clients of servers it does not run: Antenna's API
(``worker.antenna.client``) and http(s) image reads (``datasets.httpget``). It knows sockets,
``http.client`` and time; what an answer means (and which addresses may be reached) is the
caller's.

- A connection pool (``Pool``): idle connections per origin, the most recently used first,
  bounded in number (and, for image reads, in idle time); one the server closed while idle is
  closed, not used. Image reads share one per process (``pool``), never across a fork; the
  Antenna client keeps its own.
- One deadline for the whole exchange (``Exchange``): connect, TLS, request, headers and body
  end by it, however slowly the bytes come. Each read waits at most the time left, and whoever
  keeps time cuts the connection under its reader at the deadline: the exchange's own timer
  (image reads) or the event loop (Antenna calls, also given up when cancelled).
- No redirect followed: a 3xx is an answer like any other, with its Location (``fetch``);
  the caller decides (Antenna: refused; image reads: followed up to a bound, each hop checked
  as the first).
- Size caps: a body declared or read past ``Request.max_bytes`` is ``TooLarge``, found while
  reading, whatever Content-Length says.
- Interim answers (``1xx``: ``103 Early Hints`` from a CDN or proxy, a ``100 Continue`` not
  asked for) are read past to the final answer, by the same deadline; more than
  ``MAX_INTERIM_ANSWERS`` of them is a broken answer (``http.client.HTTPException``).

A kept connection that drops unanswered is tried once more on a fresh one, unless the request
left in full and may not be sent twice (``Request.may_resend``): then ``SentUnanswered``.

Why not urllib3 (installed, through botocore): its pool and ``redirect=False`` fit, but its
timeouts bound each socket operation, not the exchange (a server sending a byte just inside each
read timeout holds the reader for ever), it caps no body, and it resolves and connects on its
own, so image reads could not check the address they connect to.
"""

from __future__ import annotations

import atexit
import http.client
import os
import select
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from config.errors import SentUnanswered, TooLarge

_MAX_ORIGINS = 8
_MAX_IDLE_S = 30.0
_DROPPED = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
MAX_INTERIM_ANSWERS = 8  # 1xx answers read past before the final one; more: a broken answer


class Origin(NamedTuple):
    """An image read's pool key: a connection was made to an address checked under the hosts
    allowed private addresses, so it serves only reads under the same ones."""

    scheme: str
    host: str  # lower case
    port: int
    allowed: frozenset[tuple[str, int | None]]


class _Idle(NamedTuple):
    conn: http.client.HTTPConnection
    since: float  # time.monotonic()


class Pool:
    """Idle connections by origin; thread-safe (a loader child's reader threads share one).
    At most ``max_origins`` origins (the least recently used one closed first), each connection
    idle for at most ``max_idle_s`` (None: as long as the server keeps it)."""

    def __init__(self, max_origins: int = _MAX_ORIGINS, max_idle_s: float | None = _MAX_IDLE_S):
        self._lock = threading.Lock()
        self._idle: OrderedDict[Hashable, list[_Idle]] = OrderedDict()
        self._max_origins = max_origins
        self._max_idle_s = max_idle_s

    def take(self, origin: Hashable) -> http.client.HTTPConnection | None:
        """An idle connection to ``origin`` still open, the most recently used first."""
        stale: list[http.client.HTTPConnection] = []
        found = None
        with self._lock:
            idle = self._idle.get(origin, [])
            now = time.monotonic()
            while idle and found is None:
                conn, since = idle.pop()
                old = self._max_idle_s is not None and now - since > self._max_idle_s
                if old or dropped(conn):
                    stale.append(conn)
                else:
                    found = conn
        for conn in stale:
            conn.close()
        return found

    def give(self, origin: Hashable, conn: http.client.HTTPConnection, per_origin: int) -> None:
        """Keep ``conn`` for the next exchange with ``origin``, or close it when there is no
        room."""
        closing: list[http.client.HTTPConnection] = []
        with self._lock:
            idle = self._idle.setdefault(origin, [])
            self._idle.move_to_end(origin)
            if len(idle) < per_origin:
                idle.append(_Idle(conn, time.monotonic()))
            else:
                closing.append(conn)
            while len(self._idle) > self._max_origins:
                _, evicted = self._idle.popitem(last=False)
                closing += [kept.conn for kept in evicted]
        for old in closing:
            old.close()

    def idle_count(self) -> int:
        with self._lock:
            return sum(len(idle) for idle in self._idle.values())

    def close_all(self) -> None:
        with self._lock:
            everything = [kept.conn for idle in self._idle.values() for kept in idle]
            self._idle.clear()
        for conn in everything:
            conn.close()


def dropped(conn: http.client.HTTPConnection) -> bool:
    """The server closed this idle connection, or sent bytes nobody asked for."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


_pools: dict[int, Pool] = {}
_pools_lock = threading.Lock()


def pool() -> Pool:
    """This process's pool for image reads, made on first use."""
    pid = os.getpid()
    with _pools_lock:
        found = _pools.get(pid)
        if found is None:
            found = _pools[pid] = Pool()
        return found


def close_idle() -> None:
    """Close this process's idle image-read connections (a loader child's stream ending,
    exit)."""
    with _pools_lock:
        found = _pools.pop(os.getpid(), None)
    if found is not None:
        found.close_all()


def _forget_in_child() -> None:
    """A forked child drops the parent's pools unused (their sockets are the parent's)."""
    global _pools_lock
    _pools_lock = threading.Lock()  # a fork may have copied it held by another thread
    _pools.clear()


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(close_idle)


class Exchange:
    """One exchange's deadline and connection: cut under its reader at the deadline (a
    blocked read then ends at once) unless released first, and how far its request went:
    ``sending`` once it starts to be written, ``sent`` once written in full (from then on the
    server may act on it). ``cut_at_deadline``: a timer of its own cuts it; otherwise the
    caller does (``cut``)."""

    def __init__(self, deadline: float, *, cut_at_deadline: bool = False) -> None:
        self.deadline = deadline  # time.monotonic()
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._sock: socket.socket | None = None
        self._over = False
        self.was_cut = False
        self.sending = False
        self.sent = False
        self._timer: threading.Timer | None = None
        if cut_at_deadline:
            self._timer = threading.Timer(self.remaining_s(), self.cut)
            self._timer.daemon = True
            self._timer.start()

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def timeout_s(self, read_timeout_s: float | None = None) -> float:
        """How long the next read may wait: the time left, at most ``read_timeout_s``;
        TimeoutError once the deadline has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the exchange's deadline passed")
        return left if read_timeout_s is None else min(left, read_timeout_s)

    def mark(self, *, sending: bool = False, sent: bool = False) -> None:
        with self._lock:
            self.sending = self.sending or sending
            self.sent = self.sent or sent

    def hold(self, conn: http.client.HTTPConnection) -> None:
        """``conn`` is the one to cut from now on; ConnectionAbortedError when the exchange
        was cut already."""
        with self._lock:
            self._conn, self._sock = conn, conn.sock
            cut = self.was_cut
        if cut:
            conn.close()
            raise ConnectionAbortedError("the exchange was cut at its deadline")

    def track(self) -> None:
        """Note the socket the held connection has made since (``http.client`` connects on
        the first request): an answer that closes the connection takes it from ``conn.sock``,
        and it is still the one to cut."""
        with self._lock:
            if self._conn is not None and self._conn.sock is not None:
                self._sock = self._conn.sock

    def cut(self) -> None:
        """Shut the connection down under its reader, unless the exchange is over."""
        with self._lock:
            if self._over:
                return
            self.was_cut = True
            conn = self._conn
            sock = conn.sock if conn is not None and conn.sock is not None else self._sock
            if sock is not None:
                try:
                    # The plain socket's shutdown, also for a TLS socket (whose own would
                    # tear down its TLS state under a reader in another thread).
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    pass  # closed already: nothing is blocked on it

    def how_far(self) -> bool | None:
        """Whether the request was sent in full (None: it was being written)."""
        with self._lock:
            return True if self.sent else None if self.sending else False

    def release(self) -> bool:
        """No cut from now on; False when it was cut already (its connection is not
        reusable)."""
        with self._lock:
            self._over = True
        if self._timer is not None:
            self._timer.cancel()
        return not self.was_cut


class FinalResponse(http.client.HTTPResponse):
    """An answer read past its interim ``1xx`` answers (``http.client`` skips ``100`` only,
    and takes ``103 Early Hints`` for the answer). ``101`` is final: it is never asked for,
    and the caller refuses it as any other unexpected status."""

    def begin(self) -> None:
        for _ in range(MAX_INTERIM_ANSWERS + 1):
            super().begin()
            if not 100 <= self.status < 200 or self.status == 101:
                return
            self.headers = self.msg = None  # type: ignore[assignment]  # read the next one
        raise http.client.HTTPException(f"more than {MAX_INTERIM_ANSWERS} interim answers")


@dataclass(frozen=True)
class Request:
    method: str
    target: str  # path and query
    headers: Mapping[str, str]  # sent as given (a Host or Accept-Encoding here replaces
    # http.client's own)
    max_bytes: int
    body: bytes | None = None
    may_resend: bool = True  # the server takes it twice as once
    read_timeout_s: float | None = None  # one read; None: the deadline alone
    chunk_bytes: int = 64 * 1024


@dataclass(frozen=True)
class Answer:
    status: int
    location: str
    content_type: str
    body: bytes = field(repr=False)


class Route(Protocol):
    """How one caller reaches its server: the connections it may use, which bodies it reads
    and which connections it keeps."""

    def take(self) -> http.client.HTTPConnection | None:
        """An idle connection still open, or None."""

    def dial(self, exchange: Exchange) -> http.client.HTTPConnection:
        """A new connection, held by ``exchange`` before any I/O its deadline must bound."""

    def wants_body(self, status: int) -> bool:
        """Whether an answer with ``status`` is read (if not, its connection is closed)."""

    def admit(self, size_bytes: int) -> None:
        """Room for a body of ``size_bytes`` (the cap when not declared), asked before it is
        read; raises to refuse."""

    def keeps(self, status: int) -> bool:
        """Whether a connection whose answer had ``status`` may serve the next exchange."""

    def give(self, conn: http.client.HTTPConnection) -> None:
        """Keep ``conn`` for the next exchange (or close it)."""


def fetch(exchange: Exchange, request: Request, route: Route) -> Answer:
    """One request and its answer, by ``exchange``'s deadline; no redirect followed. Raises
    what the connection raised (OSError, HTTPException), TooLarge or SentUnanswered."""
    try:
        conn, response = _ask(exchange, request, route)
        try:
            answer, keep = _answer(exchange, request, route, conn, response)
        except TimeoutError:
            conn.close()
            if not request.may_resend:
                raise SentUnanswered(closed=False) from None
            raise
        except BaseException:
            conn.close()
            raise
        if exchange.release() and keep and exchange.remaining_s() > 0:
            route.give(conn)
        else:
            conn.close()
        return answer
    finally:
        exchange.release()


def _ask(
    exchange: Exchange, request: Request, route: Route
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """The request sent and its answer's headers, on a kept connection or, when that one
    drops unanswered, once more on a fresh one."""
    for attempt in range(2):
        kept = route.take() if attempt == 0 else None
        conn = kept if kept is not None else route.dial(exchange)
        exchange.hold(conn)
        conn.response_class = FinalResponse
        try:
            if conn.sock is not None:
                conn.sock.settimeout(exchange.timeout_s(request.read_timeout_s))
            exchange.mark(sending=True)
            conn.request(request.method, request.target, request.body, dict(request.headers))
            exchange.track()
            exchange.mark(sent=True)  # in full: the server may act on it from here
            return conn, conn.getresponse()
        except _DROPPED:
            conn.close()
            if exchange.sent and not request.may_resend:
                raise SentUnanswered(closed=True) from None
            if kept is not None and not exchange.was_cut:
                continue  # the server closed the idle connection: once on a fresh one
            raise
        except TimeoutError:  # the socket's own timeout: the deadline, on this thread
            conn.close()
            if exchange.sent and not request.may_resend:
                raise SentUnanswered(closed=False) from None
            raise
        except BaseException:
            conn.close()
            raise
    raise AssertionError("unreachable")  # pragma: no cover


def _answer(
    exchange: Exchange,
    request: Request,
    route: Route,
    conn: http.client.HTTPConnection,
    response: http.client.HTTPResponse,
) -> tuple[Answer, bool]:
    """The answer, its body read when the route wants it, and whether its connection may be
    kept."""
    status = response.status
    location = response.getheader("Location") or ""
    kind = response.getheader("Content-Type") or ""
    if not route.wants_body(status):
        return Answer(status, location, kind, b""), False
    declared = response.getheader("Content-Length")
    size = int(declared) if declared and declared.isdigit() else None
    if size is not None and size > request.max_bytes:
        raise TooLarge(size, request.max_bytes)
    route.admit(request.max_bytes if size is None else size)
    body = _body(exchange, request, conn, response)
    whole = response.isclosed() or response.length == 0  # read1 leaves it open at 0
    keep = whole and not response.will_close and route.keeps(status)
    if keep:
        response.close()  # its file only: the connection's socket stays, for the next one
    return Answer(status, location, kind, body), keep


def _body(
    exchange: Exchange,
    request: Request,
    conn: http.client.HTTPConnection,
    response: http.client.HTTPResponse,
) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        if conn.sock is not None:  # None once an answer that closes it came: the first
            # timeout holds, and the cut
            conn.sock.settimeout(exchange.timeout_s(request.read_timeout_s))
        chunk = response.read1(request.chunk_bytes)  # at most one read of the socket
        if not chunk:
            break
        total += len(chunk)
        if total > request.max_bytes:
            raise TooLarge(None, request.max_bytes)
        chunks.append(chunk)
    if exchange.was_cut or exchange.remaining_s() <= 0:
        raise OSError("cut off at the deadline")  # a cut socket reads as the body's end
    if response.length:  # the server closed before the Content-Length it declared
        raise http.client.IncompleteRead(b"".join(chunks), response.length)
    return b"".join(chunks)
