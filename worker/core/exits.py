"""Every exit code of every command, in one place (docs/operating.md's table is checked against it).

Imports nothing of ours. How a worker process ends is a value: the orchestrator decides the
reason, the entry point only maps it to the code, so no caller unwraps an exception to learn
why the process stopped.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass


class ExitReason(enum.Enum):
    """How ``run`` ends: the codes supervisord sees."""

    STOPPED = 0  # SIGTERM/SIGINT: drained and gave back what it held (or stopped while starting)
    FAILED = 1  # a part of the worker failed (logged); held tasks were given back
    CONFIG = 2  # settings that cannot work: one `config error:` line per problem
    LOADER_FAILING = 3  # the DataLoader failed WORKER_LOADER__MAX_CONSECUTIVE_FAILURES in a row
    RESOURCE_LIMIT = 4  # a WORKER_GUARDS__* limit was crossed; drained, wants a fresh process
    SOURCE_GONE = 5  # the task source is gone for good (NATS: the client closed); restart
    NOT_SERVED = 6  # --until-idle found nothing to do because it could not ask (refused, down)
    DEVICE_FAILED = 7  # a sticky device error (CUDA context poisoned); held tasks given back

    @property
    def code(self) -> int:
        return int(self.value)


class JobEnd(enum.IntEnum):
    """How ``watch`` and ``submit --wait`` end: how the job stands (missing wins over error)."""

    ALL_OK = 0  # every task ended ok
    NO_TASKS = 1  # the job has no tasks on its subjects, the streams do not exist, or no NATS
    CONFIG = 2
    SOME_ERROR = 10  # every task has a result, some ended in error
    SOME_MISSING = 11  # some had no result when it stopped (the timeout)


class CommandExit(enum.IntEnum):
    """How the commands that run once end (submit, results, check, provision, register,
    models fetch, demo)."""

    OK = 0
    FAILED = 1  # NATS not reachable in time, nothing to submit, not ready, a demo task missing
    CONFIG = 2


# A second SIGTERM/SIGINT while draining: out at once, with the shell's code for the signal.
FORCED_BY = (signal.SIGTERM, signal.SIGINT)


def forced_exit_code(signum: int) -> int:
    return 128 + signum


def documented() -> dict[str, set[int]]:
    """Each command's exit codes, as docs/operating.md's table lists them."""
    once = {CommandExit.OK, CommandExit.FAILED, CommandExit.CONFIG}
    return {
        "run": {r.code for r in ExitReason} | {forced_exit_code(s) for s in FORCED_BY},
        "watch": {int(c) for c in JobEnd},
        "submit --wait": {int(c) for c in JobEnd},
        "submit": {int(c) for c in once},
        "results": {int(c) for c in once},
        "check": {int(c) for c in once},
        "provision": {int(c) for c in once},
        "register": {int(c) for c in once},
        "models fetch": {int(c) for c in once},
        "demo": {int(CommandExit.OK), int(CommandExit.FAILED)},
        "healthwatch": {int(CommandExit.OK)},
    }


@dataclass(frozen=True)
class Exit:
    reason: ExitReason
    detail: str = ""

    @property
    def code(self) -> int:
        return self.reason.code


STOPPED = Exit(ExitReason.STOPPED)
