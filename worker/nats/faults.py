"""Faults for chaos tests on the NATS source, installed by its wiring when a setting asks: a
results stream made slower."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from worker.nats.result_store import ResultStore

log = structlog.get_logger(__name__)


class SlowResultStore(ResultStore):
    """The results stream, each write ``seconds`` longer first: a settle takes that long
    before its result is stored and its task acked (a slow or distant results stream)."""

    def __init__(self, *args: Any, seconds: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seconds = seconds

    async def store(self, result: dict[str, Any]) -> bool:
        log.warning("fault_hook_slow_result_store", seconds=self._seconds)
        await asyncio.sleep(self._seconds)
        return await super().store(result)
