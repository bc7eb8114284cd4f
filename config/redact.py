"""What may be written about a URL: scheme, host and path; never credentials or a query.

Presigned URLs carry ``X-Amz-Signature`` and ``X-Amz-Credential`` in their query string, NATS
URLs may carry a password, and error results are kept for weeks. Every message or log line
that names a URL goes through ``redact_url``; ``scrub`` is the backstop applied to every log
line and stored error message. Imports nothing of ours.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

MAX_SHOWN_CHARS = 300
_SCHEME_URL = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]{1,15})://[^\s\"'<>]*(?:<redacted>)?")
_SECRET_PARAM = re.compile(
    r"(?i)(x-amz-[a-z-]+|signature|awsaccesskeyid|token|password|secret|sig)=[^&\s\"']*"
)

_CREDENTIAL = re.compile(r"\b(Token|Api-Key|Bearer|Basic)\s+[A-Za-z0-9._~+/=-]{8,}")


def redact_url(url: str) -> str:
    """``scheme://host[:port]/path`` of ``url``: no user, password, query or fragment."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<unparseable URL>"
    if ":" in host:
        host = f"[{host}]"
    shown = f"{parts.scheme}://{host}{port}{parts.path}" if parts.scheme else parts.path
    if parts.query or parts.fragment:
        shown += "?<redacted>"
    return shorten(shown)


def shorten(text: str, limit: int = MAX_SHOWN_CHARS) -> str:
    text = "".join(ch if ch.isprintable() else "\N{REPLACEMENT CHARACTER}" for ch in text)
    return text if len(text) <= limit else text[: limit - 1] + "\N{HORIZONTAL ELLIPSIS}"


def scrub(text: str) -> str:
    """``text`` with every URL in it redacted, any ``secret=value`` pair masked, and any
    ``Authorization`` credential (``Token <key>``, ``Api-Key <key>``, ``Bearer <key>``: a page
    that echoes the request's headers) masked."""
    text = _SCHEME_URL.sub(lambda match: redact_url(match.group(0)), text)
    text = _SECRET_PARAM.sub(lambda match: f"{match.group(1)}=<redacted>", text)
    return _CREDENTIAL.sub(lambda match: f"{match.group(1)} <redacted>", text)
