"""Which served pipelines are unavailable on this host, and when each one's load is tried again.

A pipeline whose models cannot be loaded, for any reason of the host or of its file host (a
download refused, a cache that cannot be written, over the memory budget, a broken file, a
plugin's exception: nothing a task carries), is *unavailable*: its held tasks are given back
(``verdicts.decide``), none more of it is fetched (the sources' ``available``), and its load is
tried again in the background (``retry_loads``), never by fetching a task, after ``first_s``,
then twice as long each time up to ``max_s``. One ``pipeline_unavailable`` line when it becomes
so, one ``pipeline_available`` line when it loads again. ``/readyz`` and the metric
``inference_worker_pipeline_unavailable`` read ``unavailable()``.

The state has one owner, this object, on the event loop; the batches, the admission, the
sources and the probes ask it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from config.errors import UNAVAILABLE_KINDS, Failure

log = structlog.get_logger(__name__)
RETRY_S = 30.0
RETRY_MAX_S = 600.0


@dataclass(frozen=True)
class Unavailable:
    """Why a pipeline is unavailable (``reason``: one of ``config.errors.LOAD_REASONS``), its
    load's error, since when, and when its load is tried next."""

    reason: str
    error: str
    since_s: float
    retry_in_s: float  # the wait before the next load (doubled after each failed one)
    retry_at_s: float
    loads_failed: int = 1  # loads that failed since it became unavailable


def may_give_back(deliveries_left: int, holds_last: bool) -> bool:
    """Whether a task of an unavailable pipeline is given back: always where the source
    cannot extend a lease (``holds_last`` false: holding it would not stop its redelivery),
    else unless on its last delivery (a give-back would end it as a final error)."""
    return deliveries_left > 0 or not holds_last


def is_unavailable(failure: Failure | None) -> bool:
    """Whether ``failure`` is a pipeline's load failing (the host's trouble), not a task's."""
    return failure is not None and failure.kind in UNAVAILABLE_KINDS


class Availability:
    def __init__(
        self,
        first_s: float = RETRY_S,
        max_s: float = RETRY_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._first_s = first_s
        self._max_s = max(max_s, first_s)
        self._clock = clock
        self._lost: dict[str, Unavailable] = {}
        self._watchers: list[Callable[[], None]] = []

    def available(self, pipeline: str) -> bool:
        return pipeline not in self._lost

    def unavailable(self) -> dict[str, Unavailable]:
        """Each unavailable pipeline and why, now."""
        return dict(self._lost)

    def failure(self, pipeline: str) -> Failure | None:
        """What its load last failed with, while ``pipeline`` is unavailable."""
        lost = self._lost.get(pipeline)
        if lost is None:
            return None
        return Failure("model_load_failed", lost.error, reason=lost.reason)

    def watch(self, changed: Callable[[], None]) -> None:
        """``changed()`` after any pipeline becomes unavailable or available again."""
        self._watchers.append(changed)

    def lost(self, pipeline: str, failure: Failure) -> None:
        """``pipeline`` could not be loaded: unavailable from now, its load tried again after
        the first wait. Said once; a pipeline unavailable already keeps its schedule."""
        if pipeline in self._lost:
            return
        now = self._clock()
        self._lost[pipeline] = Unavailable(
            _reason(failure), failure.message, now, self._first_s, now + self._first_s
        )
        log.error(
            "pipeline_unavailable",
            pipeline=pipeline,
            reason=_reason(failure),
            error=failure.message,
            retry_in_s=self._first_s,
            action="giving back its held tasks and fetching none of it; its load is tried "
            "again in the background",
        )
        self._changed()

    def failed_again(self, pipeline: str, failure: Failure) -> None:
        """A background load failed: the next one after twice the last wait (``max_s`` at
        most)."""
        was = self._lost.get(pipeline)
        if was is None:
            return
        wait_s = min(was.retry_in_s * 2, self._max_s)
        now = self._clock()
        self._lost[pipeline] = Unavailable(
            _reason(failure),
            failure.message,
            was.since_s,
            wait_s,
            now + wait_s,
            was.loads_failed + 1,
        )
        log.warning(
            "pipeline_still_unavailable",
            pipeline=pipeline,
            reason=_reason(failure),
            error=failure.message,
            retry_in_s=wait_s,
        )

    def restored(self, pipeline: str) -> None:
        """``pipeline`` loaded: available again, its tasks fetched again."""
        was = self._lost.pop(pipeline, None)
        if was is None:
            return
        unavailable_s = round(self._clock() - was.since_s, 1)
        log.info("pipeline_available", pipeline=pipeline, unavailable_s=unavailable_s)
        self._changed()

    def given_up(self, loads: int) -> str | None:
        """Burst mode's reason to end: the pipelines whose last ``loads`` loads all failed,
        each with its error; None while there is none."""
        named = [
            f"{name} ({lost.reason}: {lost.error})"
            for name, lost in self._lost.items()
            if lost.loads_failed >= loads
        ]
        if not named:
            return None
        return (
            f"pipelines that could not be loaded on this host after {loads} tries, their "
            f"tasks given back for another host: {'; '.join(named)}"
        )

    def retry_in_s(self, pipeline: str) -> float:
        """Until ``pipeline``'s next load (0 when it is available): a task of it given back
        waits at least this long, or it would come back before anything could change."""
        lost = self._lost.get(pipeline)
        return 0.0 if lost is None else max(0.0, lost.retry_at_s - self._clock())

    def due(self) -> list[str]:
        """The unavailable pipelines whose next load is due now."""
        now = self._clock()
        return [name for name, lost in self._lost.items() if lost.retry_at_s <= now]

    def wait_s(self) -> float:
        """Until the next load is due (inf when none is unavailable)."""
        now = self._clock()
        return min((lost.retry_at_s - now for lost in self._lost.values()), default=float("inf"))

    def _changed(self) -> None:
        for changed in self._watchers:
            changed()


async def tell_loaded(loaded: Callable[[str], Awaitable[None]], pipeline: str) -> None:
    """``loaded(pipeline)`` after a background load: a failure to tell the source (NATS's
    algorithms publish timing out) is said, never the end of the retries; the pipeline is
    loaded and served, and its next load tells the source again."""
    try:
        await loaded(pipeline)
    except Exception as error:  # noqa: BLE001 - the source's boundary
        log.warning(
            "pipeline_loaded_not_told",
            pipeline=pipeline,
            error=f"{type(error).__name__}: {error}",
            action="serving it; the source is told again at its next load",
        )


def _reason(failure: Failure) -> str:
    return failure.reason or ("over_budget" if failure.kind == "model_too_large" else "load_failed")


async def retry_loads(
    availability: Availability,
    load: Callable[[str], Awaitable[Failure | None]],
    stop: asyncio.Event,
    tick: Callable[[], Awaitable[None]],
    tick_s: float,
) -> None:
    """Until ``stop``: each unavailable pipeline's load tried again when due (``load``: on a
    thread of its own, through the engine), and ``tick`` every ``tick_s`` while any is
    unavailable, a load in progress included (its held tasks kept alive)."""
    changed = asyncio.Event()  # a pipeline lost meanwhile: its first retry is scheduled now
    availability.watch(changed.set)
    while not stop.is_set():
        changed.clear()
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(changed.wait())]
        try:
            await asyncio.wait(
                waits,
                timeout=max(0.01, min(availability.wait_s(), tick_s)),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for waiting in waits:
                waiting.cancel()
        if stop.is_set():
            return
        if availability.unavailable():
            await tick()
        for pipeline in availability.due():
            failure = await _ticking(load(pipeline), tick, tick_s)
            if failure is None:
                availability.restored(pipeline)
            else:
                availability.failed_again(pipeline, failure)


async def _ticking(
    loading: Awaitable[Failure | None], tick: Callable[[], Awaitable[None]], tick_s: float
) -> Failure | None:
    """``loading`` awaited, ``tick`` every ``tick_s`` while it is pending: a slow retry (a
    download up to its deadline) keeps the held tasks alive and the watchdog fed."""
    pending = asyncio.ensure_future(loading)
    try:
        while not (await asyncio.wait({pending}, timeout=tick_s))[0]:
            await tick()
    finally:
        if not pending.done():
            pending.cancel()
    return pending.result()
