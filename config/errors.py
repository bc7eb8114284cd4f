"""Every error this project raises on purpose, and the one value a failed task carries.

A ``Failure`` (kind, message, retryable) is made once, where the failure is understood (a
loader child, the engine, the store), and travels unchanged to the stored result's
``error``. Its kind is one of ``ErrorKind``, the declared set docs/nats.md lists (a test holds
the two together). The exceptions below are the families: permanent ones are never retried,
transient ones are, with the server's delivery count as the budget.

Imports nothing of ours but the redaction helper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from config.redact import scrub, shorten

MAX_ERROR_MESSAGE_CHARS = 1000

ErrorKind = Literal[
    # Permanent: no retry can help (``retryable: false``).
    "object_missing",
    "corrupt_image",
    "unsupported_format",
    "too_large",
    "access_denied",
    "unreadable",
    "invalid_task",
    "invalid_uri",
    "file_refused",
    "address_refused",
    "redirect_refused",
    "tls_error",
    "http_error",
    "s3_error",
    "result_too_large",
    "invalid_result_subject",
    "invalid_model_output",
    "load_failed",
    "pipeline_not_served",
    # Transient: retried; stored after the last delivery (``retryable: true``).
    "s3_unavailable",
    "http_unavailable",
    "deadline_exceeded",
    "loader_failed",
    "loader_stopped",
    "inference_failed",
    "too_large_for_device",
    "deliveries_exhausted",
    "results_unavailable",  # the store did not confirm a write: a retry's reason, never stored
    # An error raised without naming its kind (a bug to report).
    "internal_error",
    # A pipeline's models could not be loaded on this host: never a task's result. Its tasks
    # are given back and the pipeline is unavailable until a background load succeeds
    # (``UNAVAILABLE_KINDS``; docs/nats.md, "When a pipeline cannot be loaded").
    "model_load_failed",
    "model_too_large",
]
ERROR_KINDS: frozenset[ErrorKind] = frozenset(get_args(ErrorKind))
UNAVAILABLE_KINDS: frozenset[ErrorKind] = frozenset({"model_load_failed", "model_too_large"})
# Why a pipeline is unavailable (``Failure.reason``, the metric's ``reason`` label): its file
# host refused the download, the model cache cannot be written, its models are over the memory
# budget, its load did not finish within its deadline, or anything else its load raised.
LOAD_REASONS = (
    "download_refused",
    "cache_unwritable",
    "over_budget",
    "load_timeout",
    "load_failed",
)


@dataclass(frozen=True)
class Failure:
    """Why a task has no predictions; becomes the result's ``error`` as it is."""

    kind: ErrorKind
    message: str
    retryable: bool = False
    reason: str = ""  # a load failure's: one of ``LOAD_REASONS`` (never in a result)

    def as_dict(self) -> dict[str, Any]:
        """The result's ``error``: the message capped and with every URL in it redacted."""
        return {
            "type": self.kind,
            "message": shorten(scrub(self.message), MAX_ERROR_MESSAGE_CHARS),
            "retryable": self.retryable,
        }


class WorkerError(Exception):
    """Base of every error this project raises on purpose."""

    retryable = False

    def __init__(self, message: str, *, kind: ErrorKind = "internal_error") -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind

    def failure(self) -> Failure:
        return Failure(self.kind, str(self), self.retryable)


class PermanentError(WorkerError):
    """Retrying cannot help: a missing object, corrupt bytes, an invalid task."""


class TransientError(WorkerError):
    """Retrying later may help: S3 5xx or timeouts, results store unavailable, a hung loader."""

    retryable = True


class RetryableRead(TransientError):
    """An object read that another attempt, on a new connection, may complete. ``reason``:
    ``stalled`` (no byte in time), ``throttled`` (429, 503 SlowDown) or ``unavailable``."""

    def __init__(self, message: str, *, kind: ErrorKind, reason: str) -> None:
        super().__init__(message, kind=kind)
        self.reason = reason


class ConfigError(WorkerError):
    """Settings that cannot work; the message has one line per problem, naming the fields."""


# -- tasks ---------------------------------------------------------------------------------
class Undeliverable(PermanentError):
    """Too broken to name its job and task: goes to the dead-letter subject."""


class InvalidTask(PermanentError):
    """Names its job and task but cannot be processed: gets an ``error`` result."""

    def __init__(
        self,
        reason: str,
        *,
        task_id: str,
        job_id: str,
        image_id: str,
        reply_subject: str | None = None,
    ) -> None:
        super().__init__(reason, kind="invalid_task")
        self.task_id = task_id
        self.job_id = job_id
        self.image_id = image_id
        self.reply_subject = reply_subject


# -- the loader ------------------------------------------------------------------------------
class LoaderFailure(TransientError):
    """The loader timed out or a child died; the requests it held are lost."""


class LoaderGaveUp(WorkerError):
    """The loader failed too many times in a row, or no new one could be started; the
    process should give back its tasks and exit for a fresh one (code 3)."""


# -- the device ------------------------------------------------------------------------------
class DeviceFailed(WorkerError):
    """The device failed for good: a sticky CUDA error (an illegal memory access, a device-side
    assert, an uncorrectable ECC error) poisoned this process's context, and every later CUDA
    call fails the same way. No task is to blame and none is failed for it: the process gives
    back every task it holds and exits for a fresh one (code 7). ``error_code``: CUDA's, when
    torch gave one."""

    def __init__(self, message: str, *, error_code: int | None = None) -> None:
        super().__init__(message)
        self.error_code = error_code


# -- results ---------------------------------------------------------------------------------
class ResultsUnavailable(TransientError):
    """The results (or dead-letter) stream did not confirm the write; retry the task.

    ``connection_closed``: our client is closed for good, so retrying in this process is
    pointless (the process is ending; the ack wait redelivers the task elsewhere).
    """

    def __init__(self, message: str, *, connection_closed: bool = False) -> None:
        super().__init__(message, kind="results_unavailable")
        self.connection_closed = connection_closed


class ResultRefused(PermanentError):
    """No retry can store this result (too large for a message, or no valid subject)."""


class ModelLoadFailed(Exception):
    """A pipeline's models could not be loaded, or do not fit the memory budget. ``failure``
    is the result its tasks get; ``cause`` the error the load raised (None: too large)."""

    def __init__(self, failure: Failure, cause: BaseException | None = None) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.cause = cause


class TooLarge(Exception):
    """A body over the cap: ``declared`` by Content-Length, or None when found while
    reading."""

    def __init__(self, declared: int | None, max_bytes: int) -> None:
        super().__init__(f"a body of {declared or 'more than'} bytes, cap {max_bytes}")
        self.declared = declared
        self.max_bytes = max_bytes


class SentUnanswered(Exception):
    """A request that may not be sent twice left in full and no answer came: its connection
    closed (``closed``) or the deadline passed. The server may have acted on it."""

    def __init__(self, closed: bool) -> None:
        super().__init__("the connection closed" if closed else "the deadline passed")
        self.closed = closed


class ServerNotFound(RuntimeError):
    """A server program (nats-server, prometheus) that a local command or a test starts is not
    installed here."""
