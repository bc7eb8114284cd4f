"""structlog set up once: JSON off a terminal, console on one; stdlib loggers routed through.

Every log line is scrubbed (``config.redact.scrub``) and has the secrets it is given (Antenna's
token) masked wherever they occur in its values: a server's answer that echoes the token (an
image id, a reason) is logged as it came, and the token must not reach the log with it. Only
what is logged is masked, never the data itself.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

import structlog

from config.redact import scrub

_MASK = "<redacted>"
_NOT_MASKED = frozenset({"exc_info", "_record", "_from_structlog"})  # not shown as they are


def configure_logging(
    level: str = "INFO", *, json: bool | None = None, secrets: Iterable[str] = ()
) -> None:
    """``secrets``: values masked in every log line (empty ones are ignored)."""
    use_json = (not sys.stderr.isatty()) if json is None else json
    scrub_secrets = _Scrubber(secrets)
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        scrub_secrets,
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            scrub_secrets,  # again: a formatted traceback may quote a URL or a secret
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Chatty libraries: keep their warnings, drop their debug chatter.
    for name in ("botocore", "boto3", "urllib3", "nats", "s3transfer", "werkzeug"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))


class _Scrubber:
    """No URL query string, credential, password or given secret reaches a log line, whoever
    wrote it: every string value scrubbed, the secrets masked in nested values too."""

    def __init__(self, secrets: Iterable[str]) -> None:
        # Longest first: a secret that contains another is masked whole.
        self._secrets = tuple(sorted({s for s in secrets if s}, key=len, reverse=True))

    def __call__(
        self, _logger: object, _name: str, event_dict: structlog.types.EventDict
    ) -> structlog.types.EventDict:
        for key, value in event_dict.items():
            if key in _NOT_MASKED:
                continue  # the exception itself (formatted later, then masked) and its record
            value = self._masked(value)
            event_dict[key] = scrub(value) if isinstance(value, str) else value
        return event_dict

    def _masked(self, value: Any) -> Any:
        if not self._secrets:
            return value
        if isinstance(value, str):
            for secret in self._secrets:
                value = value.replace(secret, _MASK)
            return value
        if isinstance(value, list):
            return [self._masked(item) for item in value]
        if isinstance(value, tuple):
            return tuple(self._masked(item) for item in value)
        if isinstance(value, dict):
            return {self._masked(k): self._masked(v) for k, v in value.items()}
        return value
