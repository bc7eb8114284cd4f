"""What a task source hands the core, and what the process asks of it.

``SourceLink`` is what the orchestrator is told: the source, its settler and results lookup,
how long a fetch waits and how often held tasks are kept alive, and when the source is gone
for good. ``SourceParts`` is what the process asks of a source's parts besides: its health
(for ``/healthz`` and ``inference_worker_source_connected``), what it does when a pipeline's
models load, and its shutdown. Each source builds its own parts in its own room
(``worker/nats/parts.py``, ``worker/antenna/parts.py``), given the metrics they count into
(made first); ``worker/process/pick_source.py`` picks one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, Protocol

from worker.core.ports import H, Results, Settler, SourceHealth, TaskSource
from worker.core.verdicts import NO_BACKOFF, Backoff

# A coroutine run alongside the orchestrator's loops until the stop event; one that fails
# ends the process.
Helper = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


async def no_inactive_jobs() -> frozenset[str]:
    return frozenset()


@dataclass
class SourceLink(Generic[H]):
    """A source's tasks and its settler share one handle type ``H`` (the JetStream message's,
    the Antenna reservation): mypy holds a source to handing its settler only its own
    deliveries, so no settler checks, or casts, what it is given."""

    kind: str  # "nats" or "antenna": WORKER_SOURCE, and the source metrics' label
    source: TaskSource[H]
    results: Results
    settler: Settler[H]  # the source's side of each verdict
    fetch_wait_s: float  # how long a fetch waits when there are no tasks
    keepalive_tick_s: float  # how often held tasks are kept alive while a model loads
    gone: asyncio.Event | None = None  # set when the source is gone for good (exit 5)
    gone_reason: str = "the task source is gone for good"
    helpers: tuple[tuple[str, Helper], ...] = ()
    # Why the source could not be asked for tasks (refused, never reached), None when it could:
    # an idle burst run ends NOT_SERVED for it.
    unserved: Callable[[], str | None] = lambda: None
    # Burst mode: why the run must end NOT_SERVED now, though tasks are held (Antenna: every
    # call has failed for its unreachable wait), None while it need not.
    given_up: Callable[[], str | None] = lambda: None
    # A stop waits for the fetch in flight and runs the held tasks' batches while the drain
    # time allows, and gives back only the rest: for a source whose give-back costs (Antenna:
    # the TTR, and one of two deliveries).
    finish_held_on_stop: bool = False
    # Finished results are waiting for the source's server to take them (Antenna's posts).
    results_waiting: Callable[[], bool] | None = None
    # How long a task left for another delivery waits (NATS: the nak's delay; Antenna: none,
    # its reservation's TTR decides).
    backoff: Backoff = NO_BACKOFF
    # What a result says of the pipeline's models (NATS's ``model``; Antenna keeps its own).
    model_of: Callable[[str], dict[str, Any]] = lambda _pipeline: {}
    # Jobs whose held tasks are dropped before they run, nothing settled for them at the
    # source: the source knows each is no longer active (Antenna: its listing, read again
    # when due, no longer shows it, and it ignores late results). NATS: none.
    inactive_jobs: Callable[[], Awaitable[frozenset[str]]] = no_inactive_jobs
    # Whether keeping a held task alive extends its lease (NATS: in progress). A source that
    # cannot (Antenna: no call extends a reservation) gets every task of an unavailable
    # pipeline given back, its last delivery included: holding one would not stop its
    # redelivery elsewhere, and Antenna's reservations would stall every pipeline.
    extends_leases: bool = True


class SourceParts(Protocol):
    @property
    def link(self) -> SourceLink[Any]: ...  # once open

    async def open(self) -> None:
        """Connect and provision (NATS); a failure here is the start's."""
        ...

    def problem(self) -> str | None:
        """Why /healthz should answer 503 for the source, or None."""
        ...

    def health(self) -> SourceHealth: ...

    def started(self) -> dict[str, Any]:
        """What the ``worker_started`` line says of the source."""
        ...

    async def loaded(self, pipeline: str) -> None:
        """``pipeline``'s models were loaded (the source publishes or records them)."""
        ...

    async def close(self) -> None:
        """Stop and release everything of the source, each step bounded."""
        ...
