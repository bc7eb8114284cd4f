"""How a worker process ends, as a value: a reason with the exit code supervisord sees.

Imports nothing of ours. The orchestrator decides the reason; the entry point only maps it
to the code, so no caller unwraps an exception to learn why the process stopped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ExitReason(enum.Enum):
    """The documented exit codes (README, "Exit codes")."""

    STOPPED = 0  # SIGTERM/SIGINT: drained and gave back what it held
    FAILED = 1  # a part of the worker failed (logged); held tasks were given back
    LOADER_FAILING = 3  # the DataLoader failed WORKER_LOADER__MAX_CONSECUTIVE_FAILURES in a row
    RESOURCE_LIMIT = 4  # a WORKER_GUARDS__* limit was crossed; drained, wants a fresh process
    NATS_CLOSED = 5  # the NATS client closed for good; a fresh process reconnects

    @property
    def code(self) -> int:
        return int(self.value)


@dataclass(frozen=True)
class Exit:
    reason: ExitReason
    detail: str = ""

    @property
    def code(self) -> int:
        return self.reason.code


STOPPED = Exit(ExitReason.STOPPED)
