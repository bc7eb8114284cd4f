"""The small interfaces the core talks to, in tasks and results, never a broker's verbs.

A task as a source delivered it, read once, is a ``Delivered`` (with the source's own opaque
handle); the transport is a ``TaskSource``; "is this task's result saved" is ``Results``; the
core's ``Verdict`` on a task is carried out by the source's ``Settler``; the engine (loader and
model on their thread) is a ``BatchEngine``. Each source adapts its own messages to these inside
its own room (``worker/nats/``, ``worker/antenna/``); nothing here names a subject or a server.
Tests give the orchestrator in-memory fakes of each.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from config.errors import Failure
from worker.core.outcome import Outcome
from worker.core.results import Settled
from worker.core.tasks import Read
from worker.core.verdicts import Verdict

H = TypeVar("H")  # a source's own handle on a delivered message: opaque to the core


@dataclass(frozen=True)
class CoreSettings:
    """What the core reads of the settings, taken once by the assembly
    (``worker/process/slices.py``)."""

    batch_size: int  # WORKER_LOADER__BATCH_SIZE: most tasks per fetch and per batch
    max_held: int  # tasks held at once (``config.derived.max_held_tasks``)
    hold_per_load: float  # WORKER_MODEL__HOLD_PER_LOAD: the engine's hold after a load
    drain_timeout_s: float  # WORKER_HEALTH__DRAIN_TIMEOUT_S: from the stop to the give-back
    device: str  # this process's device (``config.derived.chosen_device``), named if it fails
    load_deadline_s: float = 900.0  # WORKER_MODEL__LOAD_DEADLINE_S: a model load's bound


@dataclass(frozen=True)
class Delivered(Generic[H]):
    """A task as its source delivered it, read once (``tasks.read_task``): the task (or the
    failure that stops it, or nothing that names one), how many times the source delivered it
    (this time included: the source's count, not ours) and how many more deliveries it will
    make (0: this is the last). ``handle`` is the source's own, handed back to its settler."""

    read: Read
    delivered: int
    deliveries_left: int
    handle: H
    log_fields: Mapping[str, Any] = field(default_factory=dict)  # never a secret


class Results(Protocol):
    async def exists(self, job_id: str, task_id: str) -> bool:
        """Whether the task's result is saved (ResultsUnavailable when it cannot tell)."""
        ...


class Settler(Protocol[H]):
    """A source's side of every verdict: its own wire actions for it, and what it did."""

    async def settle(self, delivered: Delivered[H], verdict: Verdict) -> Settled:
        """Carry out ``verdict`` (``verdicts.Decision``) for ``delivered``."""
        ...

    async def keep_alive(self, delivered: Delivered[H]) -> None:
        """The task is still being worked on: its source need not deliver it again yet."""
        ...


# Whether a pipeline's batches may run now (the hold), or at all (its models can be had).
Runnable = Callable[[str], bool]


class TaskSource(Protocol[H]):
    async def fetch(
        self, batch: int, runnable: Runnable | None = None, available: Runnable | None = None
    ) -> Sequence[Delivered[H]]:
        """Up to ``batch`` deliveries; [] after the fetch wait or while disconnected. A
        source that can choose takes from jobs of ``runnable`` pipelines first, and from the
        others only when those have none; never from jobs of a pipeline ``available`` says
        no to (its models cannot be loaded on this host)."""
        ...

    async def close(self) -> Sequence[Delivered[H]]:
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
