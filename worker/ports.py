"""The small interfaces the orchestrator talks to. Imports nothing of ours but the schemas.

A NATS message is a ``Delivery``; the transport is a ``TaskSource``; the engine (loader and
model on their thread) is a ``Loading``. Tests give the orchestrator in-memory fakes of each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from worker.schemas import Verdict


class Delivery(Protocol):
    """A task message as fetched: its bytes, and the four ways to settle it."""

    data: bytes
    subject: str

    @property
    def metadata(self) -> Any: ...  # .num_delivered, .sequence.stream

    async def ack(self) -> None: ...

    async def nak(self, delay: float | None = None) -> None: ...

    async def term(self) -> None: ...

    async def in_progress(self) -> None: ...


class TaskSource(Protocol):
    async def fetch(self, batch: int) -> Sequence[Delivery]:
        """Up to ``batch`` deliveries; [] after the fetch timeout or while disconnected."""
        ...

    async def close(self) -> Sequence[Delivery]:
        """Stop fetching for good; return what arrived after the last fetch gave up."""
        ...

    async def idle(self) -> bool:
        """Nothing pending for the consumer and nothing awaiting an ack (burst mode)."""
        ...


@dataclass(frozen=True)
class BatchReport:
    outcomes: dict[int, Verdict]
    load_s: float
    infer_s: float
    loader_restarts: int


class Loading(Protocol):
    """Loads and forward passes; ``run_batch`` is called on the engine thread only."""

    def submit(self, requests: Sequence[tuple[int, str]]) -> None:
        """Start loading (key, image URI) pairs; any thread, never blocks on a rebuild."""
        ...

    def run_batch(self, keys: Sequence[int]) -> BatchReport: ...

    def forget(self, keys: Sequence[int]) -> None: ...
