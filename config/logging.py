"""structlog set up once: JSON off a terminal, console on one; stdlib loggers routed through."""

from __future__ import annotations

import logging
import sys

import structlog

from config.redact import scrub


def configure_logging(level: str = "INFO", *, json: bool | None = None) -> None:
    use_json = (not sys.stderr.isatty()) if json is None else json
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        _scrub_secrets,
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
            _scrub_secrets,  # again: a formatted traceback may quote a URL
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


def _scrub_secrets(
    _logger: object, _name: str, event_dict: structlog.types.EventDict
) -> structlog.types.EventDict:
    """No URL query string, credential or password reaches a log line, whoever wrote it."""
    for key, value in event_dict.items():
        if isinstance(value, str):
            event_dict[key] = scrub(value)
    return event_dict
