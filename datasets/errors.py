"""The few named errors. Permanent ones are never retried; transient ones are."""

from __future__ import annotations


class WorkerError(Exception):
    """Base of every error this project raises on purpose."""

    retryable = False

    def __init__(self, message: str, *, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind or type(self).__name__


class PermanentError(WorkerError):
    """Retrying cannot help: a missing object, corrupt bytes, an invalid task."""


class TransientError(WorkerError):
    """Retrying later may help: S3 5xx or timeouts, results store unavailable, a hung loader."""

    retryable = True
