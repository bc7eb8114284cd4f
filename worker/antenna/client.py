"""Antenna's worker-facing HTTP API, one call at a time: the only module that speaks HTTP to it.

Every call carries ``Authorization: Token <key>``; the key lives in a ``SecretStr`` and is
read only where the header is made, so no log line, error or result can carry it. Calls run
on a thread of their own (``urllib``), each with its timeout; each one is counted by endpoint
and status (``count``).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr

from config.errors import TransientError
from config.redact import redact_url, scrub, shorten

_SHOWN_BODY_CHARS = 300


class AntennaUnreachable(TransientError):
    """No HTTP answer: refused, reset, timed out, or a name that does not resolve."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="http_unavailable")


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any  # the parsed JSON, or None when the answer was not JSON
    text: str  # the start of the answer, scrubbed: for messages

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def why(self) -> str:
        """One line for a log or an error: the status and what Antenna said."""
        said = (
            self.body.get("detail") or self.body.get("error")
            if isinstance(self.body, dict)
            else None
        )
        return f"HTTP {self.status}: {shorten(scrub(str(said or self.text)), _SHOWN_BODY_CHARS)}"


def api_root(base_url: str) -> str:
    """``base_url`` with a trailing slash; a URL without ``/api/`` gets ``/api/v2/``."""
    root = base_url.rstrip("/")
    if "/api/" not in root + "/":
        root += "/api/v2"
    return root + "/"


class AntennaClient:
    def __init__(
        self,
        base_url: str,
        token: SecretStr,
        timeout_s: float,
        count: Callable[[str, str], None] = lambda _endpoint, _status: None,
    ) -> None:
        self.root = api_root(base_url)
        self._token = token
        self._timeout_s = timeout_s
        self.count = count  # set by the wiring once the metrics exist

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
        """One call; AntennaUnreachable when no HTTP answer came."""
        try:
            reply = await asyncio.to_thread(
                self._call_blocking, method, path, body, timeout_s or self._timeout_s
            )
        except AntennaUnreachable:
            self.count(endpoint, "unreachable")
            raise
        self.count(endpoint, str(reply.status))
        return reply

    def _call_blocking(self, method: str, path: str, body: bytes | None, timeout_s: float) -> Reply:
        headers = {"Accept": "application/json", "User-Agent": "inference-worker"}
        secret = self._token.get_secret_value()
        if secret:
            headers["Authorization"] = f"Token {secret}"
        if body is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.root + path, body, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return _reply(response.status, response.read())
        except urllib.error.HTTPError as error:
            with error:
                return _reply(error.code, error.read())
        except (OSError, ValueError) as error:  # URLError, timeouts, resets, a bad URL
            where = f"{method} {redact_url(self.root + path)}"
            reason = getattr(error, "reason", error)
            raise AntennaUnreachable(
                f"Antenna unreachable ({where}): {type(error).__name__} {scrub(str(reason))}"
            ) from None


def _reply(status: int, raw: bytes) -> Reply:
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = None
    text = raw[:_SHOWN_BODY_CHARS].decode("utf-8", "replace")
    return Reply(status, body, scrub(text))
