"""Antenna's worker-facing HTTP API, one call at a time: the only module that speaks HTTP to it.

Every call carries ``Authorization: <scheme> <key>`` (``WORKER_ANTENNA__AUTH_SCHEME``: ``Token``
by default, or ``Api-Key``); the key lives in a ``SecretStr`` and is
read only where the header is made, so no log line, error or result can carry it. A call is
believed only when its answer is one Antenna gives:

- no redirect is followed: a 3xx is ``BadAnswer`` naming where it pointed (the token goes to
  the configured origin only);
- a 2xx counts only with the JSON body its endpoint answers (``answers.BY_ENDPOINT``); an HTML
  page, a body cut short, one over ``_MAX_BODY_BYTES`` or nested deeper than ``_MAX_DEPTH``, a
  field of the wrong type: ``BadAnswer`` naming what was wrong;
- one deadline for the whole exchange (connect, TLS, request, headers, body): a call that has
  no complete answer by then is given up and its connection closed under it
  (``AntennaUnreachable``), however slowly the bytes come. The exchange runs on a daemon
  thread of its own, so a call given up holds neither the event loop nor the process's exit.

Connections are kept alive (``http.client``, a small pool for the one origin): one TCP and TLS
handshake per connection, not per call (docs/antenna.md, Connections). A reused connection that
drops unanswered is tried once more on a fresh one only when that cannot make Antenna act twice:
the request never left in full, or Antenna takes it twice as once (a GET, a result, a
registration); a reservation sent in full is not sent again (``Unanswered``): sent twice it
reserves twice, and the first reservation's tasks would reach no worker until Antenna's TTR. A
reservation sent in full whose answer does not come by the deadline is ``Unanswered`` too:
Antenna may have reserved tasks for it all the same.

The token is masked in what is shown (``Reply.text``, ``Reply.why``, every error message), never
in what is parsed: a token that happens to occur in the data (an image id) leaves it intact.
Where parsed values are logged (a malformed task's image id), the log processor masks it
(``config.logging.configure_logging``'s ``secrets``, given the token by the CLI).

Each call is counted by endpoint and status (``count``); the time since calls first found
Antenna unavailable (no answer, a bad one, or 502/503/504) is ``unreachable_since``, cleared by
any other answer.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pydantic
from pydantic import SecretStr

from config.errors import TransientError
from config.names import env_name
from config.redact import redact_url, scrub, shorten
from datasets.keepalive import dropped
from worker.antenna.answers import BY_ENDPOINT, wrong_fields
from worker.core.threads import in_daemon_thread

_SHOWN_BODY_CHARS = 300
_MAX_BODY_BYTES = 64 * 1024 * 1024  # a register answer echoes every category map
_MAX_DEPTH = 64
_READ_BYTES = 64 * 1024
_MAX_IDLE_CONNECTIONS = 8
_UNAVAILABLE_STATUSES = frozenset({502, 503, 504})  # a proxy with no Antenna behind it, or
# Antenna without its queue: blocked on Antenna all the same


class AntennaUnreachable(TransientError):
    """No usable HTTP answer: refused, reset, timed out, a name that does not resolve, or an
    answer that is not Antenna's (``BadAnswer``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="http_unavailable")


class BadAnswer(AntennaUnreachable):
    """An HTTP answer that cannot be believed: a redirect, a 2xx that is not the endpoint's
    JSON, a body cut short or too large."""


class Unanswered(AntennaUnreachable):
    """The request left in full and no answer came (its connection dropped, or the deadline
    passed): Antenna may have acted on it. Raised, not sent again, for a request Antenna would
    act on twice."""


# POSTs Antenna takes twice as once, so that one whose connection dropped unanswered may be
# sent again: a result (its save dedupes detections on image and box, a job's progress is a
# set of image ids, and acking a task acked already changes nothing) and a registration (it
# creates only what is missing). A reservation (``tasks``) is not: sent twice, it reserves twice.
_REPLAYABLE_POSTS = frozenset({"result", "register"})
_NOT_SENT_AGAIN = "not sent again, since Antenna may have acted on it"
_SETTLE_S = 1.0  # how long a call given up mid-write waits for its thread to say how far
_MASK = "<redacted>"


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any  # the parsed JSON as Antenna sent it (checked against its endpoint's schema
    # when 2xx), or None
    text: str  # the start of the answer, scrubbed, the token masked: for messages
    said: str = ""  # its ``detail`` or ``error``, scrubbed, the token masked: for messages

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def why(self) -> str:
        """One line for a log or an error: the status and what Antenna said."""
        return f"HTTP {self.status}: {shorten(self.said or self.text, _SHOWN_BODY_CHARS)}"


def api_root(base_url: str) -> str:
    """``base_url`` with a trailing slash; a URL without ``/api/`` gets ``/api/v2/``."""
    root = base_url.rstrip("/")
    if "/api/" not in root + "/":
        root += "/api/v2"
    return root + "/"


class _Exchange:
    """One call's connection, so that the event loop can close it under the thread at the
    deadline (a blocked read then ends at once), and how far its request went: ``sending``
    once the thread starts to write it, ``sent`` once it is written in full (from then on
    Antenna may act on it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self.aborted = False
        self.sending = False
        self.sent = False

    def mark(self, *, sending: bool = False, sent: bool = False) -> None:
        with self._lock:
            self.sending = self.sending or sending
            self.sent = self.sent or sent

    def hold(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._conn = conn
            if self.aborted:
                _close(conn)
                raise AntennaUnreachable("the call was given up")

    def abort(self) -> bool | None:
        """Close the connection under the thread; whether the request was sent in full by
        then (None: it was being written, and the thread alone knows how far it got)."""
        with self._lock:
            self.aborted = True
            if self._conn is not None:
                _close(self._conn)
            return True if self.sent else None if self.sending else False


def _close(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    try:
        if sock is not None:
            sock.shutdown(2)  # SHUT_RDWR: a read blocked on it returns now
        conn.close()
    except Exception:  # noqa: BLE001 - closed already, by the thread itself
        pass


class AntennaClient:
    def __init__(
        self,
        base_url: str,
        token: SecretStr,
        timeout_s: float,
        count: Callable[[str, str], None] = lambda _endpoint, _status: None,
        scheme: str = "Token",
    ) -> None:
        self.root = api_root(base_url)
        self._token = token
        self._scheme = scheme
        self._timeout_s = timeout_s
        self.count = count  # set by the wiring once the metrics exist
        self._url = urllib.parse.urlsplit(self.root)
        self._idle: list[http.client.HTTPConnection] = []
        self._idle_lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None
        self.connections_made = 0
        self.unreachable_since: float | None = None  # time.monotonic()
        self.last_problem = ""

    def shown(self) -> str:
        """The API root as it may be written in a log line."""
        return redact_url(self.root)

    async def get(self, path: str, endpoint: str, params: Mapping[str, Any] | None = None) -> Reply:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        return await self.call("GET", path + query, None, endpoint)

    async def post(
        self, path: str, endpoint: str, body: bytes, timeout_s: float | None = None
    ) -> Reply:
        """POST ``body`` (JSON bytes, made once by the caller so a retry sends the same)."""
        return await self.call("POST", path, body, endpoint, timeout_s)

    async def call(
        self,
        method: str,
        path: str,
        body: bytes | None,
        endpoint: str,
        timeout_s: float | None = None,
    ) -> Reply:
        """One call, ended at its deadline; AntennaUnreachable when no usable answer came."""
        timeout_s = timeout_s or self._timeout_s
        where = f"{method} {redact_url(self.root + path)}"
        exchange = _Exchange()
        started = time.monotonic()
        deadline = started + timeout_s
        running = in_daemon_thread(
            self._call_blocking, exchange, method, path, body, endpoint, deadline
        )
        running.add_done_callback(_retrieved)
        try:
            reply = await asyncio.wait_for(asyncio.shield(running), timeout_s)
        except TimeoutError:
            sent = exchange.abort()
            if sent is None:  # being written: the closed socket ends the write at once
                await asyncio.wait({running}, timeout=_SETTLE_S)
                sent = exchange.sent
            message = f"Antenna unreachable ({where}): no complete answer within {timeout_s:g}s"
            self._unavailable(endpoint, message, started)
            if sent and not _replayable(method, endpoint):
                raise Unanswered(f"{message} {_NOT_SENT_AGAIN}") from None
            raise AntennaUnreachable(message) from None
        except AntennaUnreachable as error:
            self._unavailable(endpoint, str(error), started, isinstance(error, BadAnswer))
            raise
        except BaseException:  # cancelled (a stop): the thread must not go on
            exchange.abort()
            raise
        self.count(endpoint, str(reply.status))
        if reply.status in _UNAVAILABLE_STATUSES:
            self._mark_unavailable(f"Antenna unavailable ({where}): {reply.why()}", started)
        else:
            self.unreachable_since = None
        return reply

    def _unavailable(self, endpoint: str, message: str, since: float, bad: bool = False) -> None:
        self.count(endpoint, "bad_answer" if bad else "unreachable")
        self._mark_unavailable(message, since)

    def _mark_unavailable(self, message: str, since: float) -> None:
        """Antenna gave no usable answer to a call made at ``since``: unavailable from then
        (a call that ran to its deadline counts from its start)."""
        self.last_problem = message
        if self.unreachable_since is None:
            self.unreachable_since = since

    def _call_blocking(
        self,
        exchange: _Exchange,
        method: str,
        path: str,
        body: bytes | None,
        endpoint: str,
        deadline: float,
    ) -> Reply:
        where = f"{method} {redact_url(self.root + path)}"
        try:
            status, location, kind, raw = self._exchange(
                exchange, method, path, body, endpoint, deadline
            )
        except AntennaUnreachable as error:
            raise type(error)(self._masked(str(error))) from None
        except Exception as error:  # noqa: BLE001 - OSError, HTTPException, TLS: no answer
            if exchange.aborted:
                raise AntennaUnreachable(f"Antenna unreachable ({where}): given up") from None
            reason = getattr(error, "reason", None) or error
            raise AntennaUnreachable(
                f"Antenna unreachable ({where}): {type(error).__name__} "
                f"{shorten(scrub(self._masked(str(reason).strip())), _SHOWN_BODY_CHARS)}"
            ) from None
        try:
            return _reply(where, endpoint, status, location, kind, raw, self.root, self._masked)
        except BadAnswer as error:  # a page echoing our headers: the token never shown
            raise BadAnswer(self._masked(str(error))) from None

    def _masked(self, text: str) -> str:
        """``text`` as it may be shown: the token masked wherever it occurs."""
        secret = self._token.get_secret_value()
        return text.replace(secret, _MASK) if secret else text

    def _connection(self, timeout_s: float) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection still open (and so reused), or a new one."""
        with self._idle_lock:
            while self._idle:
                conn = self._idle.pop()
                if not dropped(conn):
                    conn.timeout = timeout_s
                    if conn.sock is not None:
                        conn.sock.settimeout(timeout_s)
                    return conn, True
                conn.close()
        host = self._url.hostname or ""
        port = self._url.port
        scheme = self._url.scheme
        self.connections_made += 1
        if scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()  # SSL_CERT_FILE is honoured
            return http.client.HTTPSConnection(
                host, port, timeout=timeout_s, context=self._tls
            ), False
        if scheme != "http":
            raise AntennaUnreachable(
                f"{env_name('antenna', 'base_url')} {self.shown()} is not an http(s) URL"
            )
        return http.client.HTTPConnection(host, port, timeout=timeout_s), False

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._idle_lock:
            if len(self._idle) < _MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _headers(self, has_body: bool) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "inference-worker"}
        secret = self._token.get_secret_value()
        if secret:
            headers["Authorization"] = f"{self._scheme} {secret}"
        if has_body:
            headers["Content-Type"] = "application/json"
        return headers

    def _exchange(
        self,
        exchange: _Exchange,
        method: str,
        path: str,
        body: bytes | None,
        endpoint: str,
        deadline: float,
    ) -> tuple[int, str, str, bytes]:
        """Status, Location, Content-Type and body of one exchange."""
        headers, target = self._headers(body is not None), self._url.path + path
        for attempt in range(2):
            conn, reused = self._connection(_left(deadline))
            exchange.hold(conn)
            exchange.mark(sending=True)
            sent = False
            where = f"{method} {redact_url(self.root + path)}"
            try:
                conn.request(method, target, body, headers)
                sent = True  # in full: Antenna may act on it from here
                exchange.mark(sent=True)
                response = conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()
                if sent and not _replayable(method, endpoint):
                    raise Unanswered(
                        f"Antenna unreachable ({where}): the connection closed after the "
                        f"request was sent, with no answer; {_NOT_SENT_AGAIN}"
                    ) from None
                if reused and attempt == 0 and not exchange.aborted:
                    continue  # the server closed the idle connection: once on a fresh one
                raise
            except TimeoutError:  # the socket's own timeout: the deadline, on this thread
                conn.close()
                if sent and not _replayable(method, endpoint):
                    raise _late(where) from None
                raise
            except BaseException:
                conn.close()
                raise
            return self._answer(conn, response, deadline, where, _replayable(method, endpoint))
        raise AssertionError("unreachable")  # pragma: no cover

    def _answer(
        self,
        conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        deadline: float,
        where: str,
        replayable: bool,
    ) -> tuple[int, str, str, bytes]:
        """Status, Location, Content-Type and body of an answer; its connection kept for the
        next call where the answer allows. A body not in by the deadline of a request that may
        not be sent again is ``Unanswered``."""
        try:
            raw = _body(conn, response, deadline)
        except TimeoutError:
            conn.close()
            if not replayable:
                raise _late(where) from None
            raise
        except BaseException:
            conn.close()
            raise
        if response.will_close:
            conn.close()
        else:
            self._give_back(conn)
        return (
            response.status,
            response.getheader("Location") or "",
            response.getheader("Content-Type") or "",
            raw,
        )


def _late(where: str) -> Unanswered:
    return Unanswered(
        f"Antenna unreachable ({where}): no complete answer by the call's deadline after the "
        f"request was sent; {_NOT_SENT_AGAIN}"
    )


def _replayable(method: str, endpoint: str) -> bool:
    """Whether Antenna takes this request twice as once (so it may be sent again when it may
    have reached Antenna)."""
    return method == "GET" or endpoint in _REPLAYABLE_POSTS


def _retrieved(future: asyncio.Future[Reply]) -> None:
    """A call given up still ends on its thread: its error is nobody's to report."""
    if not future.cancelled():
        future.exception()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the call's deadline passed")
    return left


def _body(
    conn: http.client.HTTPConnection, response: http.client.HTTPResponse, deadline: float
) -> bytes:
    length = response.getheader("Content-Length")
    if length and length.isdigit() and int(length) > _MAX_BODY_BYTES:
        raise BadAnswer(f"an answer of {int(length)} bytes, over {_MAX_BODY_BYTES}")
    chunks: list[bytes] = []
    size = 0
    while True:
        if conn.sock is not None:
            conn.sock.settimeout(_left(deadline))
        chunk = response.read(_READ_BYTES)
        if not chunk:
            raw = b"".join(chunks)
            if length and length.isdigit() and len(raw) < int(length):  # read(n) does not say
                raise http.client.IncompleteRead(raw, int(length) - len(raw))
            return raw
        size += len(chunk)
        if size > _MAX_BODY_BYTES:
            raise BadAnswer(f"an answer over {_MAX_BODY_BYTES} bytes")
        chunks.append(chunk)


_STRUCTURE = re.compile(rb'["\[\]{}]')
# The rest of a string after its opening quote. Possessive: matched once, from a known start,
# in linear time or not at all (a pattern that may backtrack, tried at every offset, went
# quadratic on an unterminated string of escaped quotes, holding the GIL: the process froze).
_STRING_REST = re.compile(rb'(?:[^"\\]++|\\.)*+"', re.DOTALL)
_QUOTE = ord('"')
_OPENS = frozenset(b"[{")


def json_depth(raw: bytes) -> int:
    """How deeply ``raw``'s arrays and objects nest (strings skipped), without parsing it: one
    pass, linear whatever ``raw`` holds, stopping once past ``_MAX_DEPTH`` or at a string that
    never ends (then it is not JSON, as ``json.loads`` says next)."""
    depth = deepest = 0
    at = 0
    while (found := _STRUCTURE.search(raw, at)) is not None:
        byte, at = raw[found.start()], found.end()
        if byte == _QUOTE:
            rest = _STRING_REST.match(raw, at)
            if rest is None:
                return deepest
            at = rest.end()
        elif byte in _OPENS:
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > _MAX_DEPTH:
                    return deepest
        else:
            depth -= 1
    return deepest


def _parsed(raw: bytes) -> tuple[Any, str]:
    """The JSON in ``raw`` and "", or None and why it is not JSON the worker reads."""
    if not raw:
        return None, "an empty body"
    if json_depth(raw) > _MAX_DEPTH:
        return None, f"JSON nested deeper than {_MAX_DEPTH}"
    try:
        return json.loads(raw), ""
    except (ValueError, RecursionError):
        return None, "not JSON"


def _reply(
    where: str,
    endpoint: str,
    status: int,
    location: str,
    kind: str,
    raw: bytes,
    root: str,
    masked: Callable[[str], str],
) -> Reply:
    """``raw`` parsed as it came; only what is shown (``text``, ``said``) is masked."""
    # Masked before it is cut, so that a token across the cut shows none of itself.
    head = masked(raw[: _SHOWN_BODY_CHARS * 4].decode("utf-8", "replace"))
    text = scrub(head[:_SHOWN_BODY_CHARS])
    if 300 <= status < 400:
        pointed = redact_url(urllib.parse.urljoin(root, location)) if location else "nowhere"
        raise BadAnswer(
            f"Antenna answered {where} with HTTP {status}, a redirect to {pointed}: redirects "
            f"are not followed (is {env_name('antenna', 'base_url')} Antenna's own address?)"
        )
    body, why = _parsed(raw)
    said = body.get("detail") or body.get("error") if isinstance(body, dict) else None
    shown = shorten(scrub(masked(str(said))), _SHOWN_BODY_CHARS) if said else ""
    if not 200 <= status < 300:
        return Reply(status, body, text, shown)
    if body is None:
        raise BadAnswer(
            f"Antenna answered {where} with HTTP {status} and {why} "
            f"({kind or 'no Content-Type'}): {shorten(text, 120)}"
        )
    schema = BY_ENDPOINT.get(endpoint)
    if schema is not None:
        try:
            schema.model_validate(body)
        except pydantic.ValidationError as error:
            raise BadAnswer(
                f"Antenna answered {where} with HTTP {status} and a body that is not its "
                f"{endpoint} answer: {wrong_fields(error)}"
            ) from None
    return Reply(status, body, text, shown)
