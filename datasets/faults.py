"""Faults for chaos tests, installed by the wiring only when a WORKER_FAULTS__* setting asks.

Production constructors carry no test parameters and the hot path no test checks: a fault
is a subclass or wrapper put in place of the real part.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from datasets.images import DecodePlan
from datasets.loader import Loaded, MakeStream, RequestStream
from datasets.reads import Read
from datasets.uris import SourceConfig


def claim_once(path: str) -> bool:
    """True for the one caller, in any process, that creates ``path``."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class DropOnceStream(RequestStream):
    """The first loader child to claim ``drop_once_file`` loses its next result the way it
    happens in production: the result cannot be pickled, the queue's feeder thread drops it,
    and the child lives on as if it had been sent."""

    def __init__(
        self,
        requests: Any,
        reports: Any,
        plan: DecodePlan,
        sources: SourceConfig,
        drop_once_file: str,
    ) -> None:
        super().__init__(requests, reports, plan, sources)
        self.drop_once_file = drop_once_file

    def finish(self, read: Read) -> Loaded:
        loaded = super().finish(read)
        if claim_once(self.drop_once_file):
            return loaded._replace(failure=threading.Lock())  # type: ignore[arg-type]
        return loaded


def dropping_once(path: str) -> MakeStream:
    """Streams whose children drop one result, once, across the whole process tree."""
    return functools.partial(DropOnceStream, drop_once_file=path)
