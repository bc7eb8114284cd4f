"""The small interfaces the orchestrator talks to. Imports nothing of ours but the schemas.

A NATS message is a ``Delivery``; the transport is a ``TaskSource``; the results stream is
``Results``; the delivery rules are ``DeliveryRules``; the engine (loader and model on their
thread) is a ``BatchEngine``. Tests give the orchestrator in-memory fakes of each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from config.errors import Failure
from worker.outcome import Outcome
from worker.schemas import Task


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


class Results(Protocol):
    async def exists(self, job_id: str, task_id: str) -> bool:
        """Whether the task's result is stored (ResultsUnavailable when it cannot tell)."""
        ...


class DeliveryRules(Protocol):
    """The delivery rules (``settle.Settler``): every decision about what becomes of a
    delivery: store-then-ack, nak, dead-letter, ack a duplicate, give back."""

    async def settle(self, task: Task, msg: Delivery, delivered: int, outcome: Outcome) -> str: ...

    async def dead_letter(self, msg: Delivery, reason: str) -> str: ...

    async def already_stored(self, msg: Delivery, task: Task) -> None: ...

    async def give_back(self, msg: Delivery) -> None: ...


Runnable = Callable[[str], bool]  # whether a pipeline's batches may run now (the hold)


class TaskSource(Protocol):
    async def fetch(self, batch: int, runnable: Runnable | None = None) -> Sequence[Delivery]:
        """Up to ``batch`` deliveries; [] after the fetch timeout or while disconnected. A
        source that can choose takes from jobs of ``runnable`` pipelines first, and from the
        others only when those have none."""
        ...

    async def close(self) -> Sequence[Delivery]:
        """Stop fetching for good; return what arrived after the last fetch gave up."""
        ...

    async def idle(self) -> bool:
        """Nothing pending for the consumer and nothing awaiting an ack (burst mode)."""
        ...


@dataclass(frozen=True)
class BatchReport:
    outcomes: dict[int, Outcome]
    load_s: float
    infer_s: float
    loader_restarts: int


class BatchEngine(Protocol):
    """Loads and forward passes; ``run_batch`` is called on the engine thread only."""

    def submit(self, requests: Sequence[tuple[int, str]], pipeline: str = "") -> None:
        """Start loading (key, image URI) pairs for ``pipeline``; any thread, never blocks on
        a rebuild."""
        ...

    def ready(self, pipeline: str) -> bool:
        """Whether ``pipeline``'s models are loaded."""
        ...

    def load(self, pipeline: str) -> Failure | None:
        """Load ``pipeline``'s models (blocking, on a thread of its own); the failure its
        tasks get when they cannot be had."""
        ...

    def run_batch(self, keys: Sequence[int], pipeline: str = "") -> BatchReport:
        """One batch, all of ``pipeline``."""
        ...

    def forget(self, keys: Sequence[int]) -> None: ...
