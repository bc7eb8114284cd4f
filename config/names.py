"""The one rule that turns a settings field path into its environment variable's name."""

from __future__ import annotations

PREFIX = "WORKER_"
NESTED_DELIMITER = "__"


def env_name(*path: str | int) -> str:
    """``env_name("loader", "timeout_s")`` is ``WORKER_LOADER__TIMEOUT_S``."""
    return PREFIX + NESTED_DELIMITER.join(str(part).upper() for part in path)
