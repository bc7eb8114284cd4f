"""Antenna's worker-facing HTTP API, one call at a time: the only module that calls it. Each call
is one exchange of ``datasets.http_transport`` (pool, deadline, no redirect, size cap); whether
its answer is Antenna's is ``worker.antenna.answers``' to say; this module keeps the token, the
call's deadline on the event loop, and whether Antenna is available.

Every call carries ``Authorization: <scheme> <key>`` (``WORKER_ANTENNA__AUTH_SCHEME``: ``Token``
by default, or ``Api-Key``); the key lives in a ``SecretStr`` and is
read only where the header is made, so no log line, error or result can carry it. A call is
believed only when its answer is one Antenna gives:

- no redirect is followed: a 3xx is ``BadAnswer`` naming where it pointed (the token goes to
  the configured origin only);
- a 2xx counts only with the JSON body its endpoint answers (``answers.BY_ENDPOINT``); an HTML
  page, a body cut short, one over ``_MAX_BODY_BYTES`` or nested deeper than
  ``answers.MAX_DEPTH``, a field of the wrong type: ``BadAnswer`` naming what was wrong;
- one deadline for the whole exchange (connect, TLS, request, headers, body): a call that has
  no complete answer by then is given up and its connection closed under it
  (``AntennaUnreachable``), however slowly the bytes come. The exchange runs on a daemon
  thread of its own, so a call given up holds neither the event loop nor the process's exit.

Connections are kept alive (``http_transport.Pool``, a small one for the one origin): one TCP
and TLS handshake per connection, not per call (docs/antenna.md, Connections). A reused
connection that drops unanswered is tried once more on a fresh one only when that cannot make
Antenna act twice: the request never left in full, or Antenna takes it twice as once (a GET, a
result, a registration); a reservation sent in full is not sent again (``Unanswered``): sent
twice it reserves twice, and the first reservation's tasks would reach no worker until
Antenna's TTR. A reservation sent in full whose answer does not come by the deadline is
``Unanswered`` too: Antenna may have reserved tasks for it all the same.

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
import dataclasses
import http.client
import ssl
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import SecretStr

from config.errors import SentUnanswered, TooLarge, TransientError
from config.names import env_name
from config.redact import redact_url, scrub, shorten
from datasets.http_transport import Exchange, Pool, Request, fetch
from worker.antenna.answers import (
    SHOWN_BODY_CHARS,
    NotAntennas,
    Received,
    Reply,
    anonymous,
    checked_reply,
)
from worker.core.threads import in_daemon_thread

_MAX_BODY_BYTES = 64 * 1024 * 1024  # a register answer echoes every category map
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


def api_root(base_url: str) -> str:
    """``base_url`` with a trailing slash; a URL without ``/api/`` gets ``/api/v2/``."""
    root = base_url.rstrip("/")
    if "/api/" not in root + "/":
        root += "/api/v2"
    return root + "/"


class _Origin:
    """Antenna's one origin as the transport reaches it (a ``http_transport.Route``): its
    kept connections, and new ones made by ``http.client`` (which resolves the configured
    host and, over https, checks its certificate with the default context)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._url = urllib.parse.urlsplit(root)
        self._pool = Pool(max_origins=1, max_idle_s=None)
        self._tls: ssl.SSLContext | None = None
        self.made = 0

    def take(self) -> http.client.HTTPConnection | None:
        return self._pool.take(self.root)

    def dial(self, exchange: Exchange) -> http.client.HTTPConnection:
        timeout_s = exchange.timeout_s()
        host, port, scheme = self._url.hostname or "", self._url.port, self._url.scheme
        self.made += 1
        if scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()  # SSL_CERT_FILE is honoured
            return http.client.HTTPSConnection(host, port, timeout=timeout_s, context=self._tls)
        if scheme != "http":
            raise AntennaUnreachable(
                f"{env_name('antenna', 'base_url')} {redact_url(self.root)} is not an http(s) URL"
            )
        return http.client.HTTPConnection(host, port, timeout=timeout_s)

    def wants_body(self, status: int) -> bool:
        return True  # an error's body says why

    def admit(self, size_bytes: int) -> None:
        pass  # capped at _MAX_BODY_BYTES, no budget beyond it

    def keeps(self, status: int) -> bool:
        return True

    def give(self, conn: http.client.HTTPConnection) -> None:
        self._pool.give(self.root, conn, _MAX_IDLE_CONNECTIONS)

    def close(self) -> None:
        self._pool.close_all()


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
        self.count = count
        self._origin = _Origin(self.root)
        self._path = urllib.parse.urlsplit(self.root).path
        self.unreachable_since: float | None = None  # time.monotonic()
        self.last_problem = ""

    @property
    def connections_made(self) -> int:
        return self._origin.made

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
        # A deadline of its own is a result post's (the poster's); the client's, every other call's.
        setting = env_name("antenna", "post_timeout_s" if timeout_s else "request_timeout_s")
        timeout_s = timeout_s or self._timeout_s
        where = f"{method} {redact_url(self.root + path)}"
        started = time.monotonic()
        exchange = Exchange(started + timeout_s)
        # The request went out in full and its answer did not come in time: Antenna is slow.
        slow = f"Antenna too slow ({where}): no complete answer within {timeout_s:g}s ({setting})"
        running = in_daemon_thread(
            self._call_blocking, exchange, (method, path, body, endpoint), slow
        )
        running.add_done_callback(_retrieved)
        try:
            reply = await asyncio.wait_for(asyncio.shield(running), timeout_s)
        except TimeoutError:
            exchange.cut()
            sent = exchange.how_far()
            if sent is None:  # being written: the cut socket ends the write at once
                await asyncio.wait({running}, timeout=_SETTLE_S)
                sent = exchange.sent
            message = slow if sent else slow.replace("too slow", "unreachable", 1)
            self._unavailable(endpoint, message, started)
            if sent and not _replayable(method, endpoint):
                raise Unanswered(f"{message} {_NOT_SENT_AGAIN}") from None
            raise AntennaUnreachable(message) from None
        except AntennaUnreachable as error:
            self._unavailable(endpoint, str(error), started, isinstance(error, BadAnswer))
            raise
        except BaseException:  # cancelled (a stop): the thread must not go on
            exchange.cut()
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
        self, exchange: Exchange, call: tuple[str, str, bytes | None, str], slow: str
    ) -> Reply:
        method, path, body, endpoint = call
        where = f"{method} {redact_url(self.root + path)}"
        try:
            answer = fetch(exchange, self._request(method, path, body, endpoint), self._origin)
        except AntennaUnreachable as error:
            raise type(error)(self._masked(str(error))) from None
        except TooLarge as error:
            raise BadAnswer(_too_large(error)) from None
        except SentUnanswered as error:
            raise Unanswered(self._masked(_unanswered(where, error))) from None
        except Exception as error:  # noqa: BLE001 - OSError, HTTPException, TLS: no answer
            if exchange.was_cut:
                raise AntennaUnreachable(f"Antenna unreachable ({where}): given up") from None
            if isinstance(error, TimeoutError) and exchange.sent:  # the deadline, as the socket's
                raise AntennaUnreachable(slow) from None
            reason = getattr(error, "reason", None) or error
            raise AntennaUnreachable(
                f"Antenna unreachable ({where}): {type(error).__name__} "
                f"{shorten(scrub(self._masked(str(reason).strip())), SHOWN_BODY_CHARS)}"
            ) from None
        received = Received(answer.status, answer.location, answer.content_type, answer.body)
        try:
            reply = checked_reply(where, endpoint, received, self.root, self._masked)
        except NotAntennas as error:  # a page echoing our headers: the token never shown
            raise BadAnswer(self._masked(str(error))) from None
        if anonymous(reply) and self._token.get_secret_value():
            return dataclasses.replace(reply, unknown_scheme=self._scheme)
        return reply

    def _request(self, method: str, path: str, body: bytes | None, endpoint: str) -> Request:
        return Request(
            method,
            self._path + path,
            self._headers(body is not None),
            max_bytes=_MAX_BODY_BYTES,
            body=body,
            may_resend=_replayable(method, endpoint),
            chunk_bytes=_READ_BYTES,
        )

    def _masked(self, text: str) -> str:
        """``text`` as it may be shown: the token masked wherever it occurs."""
        secret = self._token.get_secret_value()
        return text.replace(secret, _MASK) if secret else text

    def close(self) -> None:
        self._origin.close()

    def _headers(self, has_body: bool) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "inference-worker"}
        secret = self._token.get_secret_value()
        if secret:
            headers["Authorization"] = f"{self._scheme} {secret}"
        if has_body:
            headers["Content-Type"] = "application/json"
        return headers


def _too_large(error: TooLarge) -> str:
    if error.declared is not None:
        return f"an answer of {error.declared} bytes, over {error.max_bytes}"
    return f"an answer over {error.max_bytes} bytes"


def _unanswered(where: str, error: SentUnanswered) -> str:
    if error.closed:
        return (
            f"Antenna unreachable ({where}): the connection closed after the request was "
            f"sent, with no answer; {_NOT_SENT_AGAIN}"
        )
    return (
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
