"""Batch formation and dispatch.

Batches form when the engine thread is free, from every admitted task not yet in a batch
(up to ``batch_size``), not from what one fetch happened to return: tasks trickling in while
a job is published would otherwise lock the worker into batches of one or two. While one
batch runs on the engine thread, the previous one is settled on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any

from worker.claims import Claim
from worker.ports import BatchEngine, BatchReport

SettleBatch = Callable[[list[Claim], BatchReport], Coroutine[Any, Any, None]]


class Batches:
    def __init__(
        self,
        batch_size: int,
        engine: BatchEngine,
        engine_thread: Executor,
        on_batch: Callable[[list[Claim], BatchReport], None],
        settle: SettleBatch,
    ) -> None:
        self._batch_size = batch_size
        self._engine = engine
        self._engine_thread = engine_thread
        self._on_batch = on_batch
        self._settle = settle
        self._waiting: asyncio.Queue[Claim | None] = asyncio.Queue()  # admitted, not in a batch

    def add(self, admitted: list[Claim]) -> None:
        """Start loading ``admitted`` now; they join the next batches."""
        if not admitted:
            return
        self._engine.submit([(h.key, h.task.image_url) for h in admitted])
        for held in admitted:
            self._waiting.put_nowait(held)

    def stop(self) -> list[Claim]:
        """No new batches after the one in hand; return the tasks that will not run."""
        left = []
        while not self._waiting.empty():
            held = self._waiting.get_nowait()
            if held is not None:
                left.append(held)
        self._engine.forget([h.key for h in left])
        self._waiting.put_nowait(None)
        return left

    def forget(self, held: list[Claim]) -> None:
        self._engine.forget([h.key for h in held])

    async def run(self) -> None:
        """Form and run batches until ``stop``; the last batch's settling is awaited."""
        loop = asyncio.get_running_loop()
        settling: asyncio.Task[None] | None = None
        try:
            while batch := await self._next_batch():
                keys = [h.key for h in batch]
                running = loop.run_in_executor(self._engine_thread, self._engine.run_batch, keys)
                if settling is not None:
                    await settling
                report = await running
                self._on_batch(batch, report)
                settling = asyncio.create_task(self._settle(batch, report))
        finally:
            if settling is not None:
                await asyncio.shield(settling)

    async def _next_batch(self) -> list[Claim]:
        """Every waiting task, up to ``batch_size``, once at least one waits; [] to stop."""
        first = await self._waiting.get()
        if first is None:
            return []
        batch = [first]
        while len(batch) < self._batch_size and not self._waiting.empty():
            held = self._waiting.get_nowait()
            if held is None:
                self._waiting.put_nowait(None)  # the next call stops
                break
            batch.append(held)
        return batch
