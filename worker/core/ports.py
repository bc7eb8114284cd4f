"""The small interfaces the core talks to. Imports nothing of ours but the schemas.

A task as a source delivered it is a ``Delivery``; the transport is a ``TaskSource``; "is
this task's result saved" is ``Results``; what becomes of a delivery is the source's
``DeliveryRules``; the engine (loader and model on their thread) is a ``BatchEngine``. Each
source adapts its own messages to these inside its own room (``worker/nats/``,
``worker/antenna/``); nothing here names a subject or a server. Tests give the orchestrator
in-memory fakes of each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from config.errors import Failure
from worker.core.outcome import Outcome
from worker.core.tasks import Task


class Delivery(Protocol):
    """A task as delivered: its bytes, the pipeline and job its source names for it, how many
    times it was delivered and how many more its source will make, and the verbs to settle it.

    ``pipeline`` "" is the source naming none (the default pipeline serves it); ``job_id``
    None is the task's own ``job_id`` field naming its job.
    """

    @property
    def data(self) -> bytes: ...

    @property
    def pipeline(self) -> str: ...

    @property
    def job_id(self) -> str | None: ...

    @property
    def delivered(self) -> int: ...  # this delivery included; the source's count, not ours

    @property
    def deliveries_left(self) -> int: ...  # 0: this is the last

    def log_fields(self) -> dict[str, Any]:
        """How a log line names this delivery at its source (never a secret)."""
        ...

    async def ack(self) -> None: ...

    async def nak(self, delay_s: float | None = None) -> None: ...

    async def term(self) -> None: ...

    async def in_progress(self) -> None: ...


class Results(Protocol):
    async def exists(self, job_id: str, task_id: str) -> bool:
        """Whether the task's result is saved (ResultsUnavailable when it cannot tell)."""
        ...


class DeliveryRules(Protocol):
    """A source's delivery rules: every decision about what becomes of its deliveries (NATS:
    store-then-ack, nak, dead-letter; Antenna: post, or leave to redelivery)."""

    async def settle(self, task: Task, delivery: Delivery, outcome: Outcome) -> str: ...

    async def dead_letter(self, delivery: Delivery, reason: str) -> str: ...

    async def already_stored(self, delivery: Delivery, task: Task) -> None: ...

    async def give_back(self, delivery: Delivery) -> None: ...


Runnable = Callable[[str], bool]  # whether a pipeline's batches may run now (the hold)


class TaskSource(Protocol):
    async def fetch(self, batch: int, runnable: Runnable | None = None) -> Sequence[Delivery]:
        """Up to ``batch`` deliveries; [] after the fetch wait or while disconnected. A
        source that can choose takes from jobs of ``runnable`` pipelines first, and from the
        others only when those have none."""
        ...

    async def close(self) -> Sequence[Delivery]:
        """Stop fetching for good; return what arrived after the last fetch gave up."""
        ...

    async def idle(self) -> bool:
        """Nothing pending for this process and nothing awaiting its settling (burst mode)."""
        ...


@dataclass(frozen=True)
class SourceHealth:
    """Whether a task source's server answers: NATS, the connection is up; Antenna, its
    calls answer. ``down_s``: seconds since it last did (0 while it does)."""

    connected: bool
    down_s: float


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
