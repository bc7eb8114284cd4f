"""How the run ends: one value (``Exit``), decided here, and one event (``stop``) that every
loop watches.

Every way to end comes in through this room: the caller's stop (SIGTERM), a crossed resource
limit (``limit``), a part that failed (``failed``: the one entrance for a failed device too),
the source gone for good (``end_when_gone``), and burst mode's end, idle or not served
(``end_when_idle``, ``not_served``). The first reason recorded is the one reported, but a
failed device wins over any: a new process gets a new CUDA context. The rooms that end the
run call down into this one; none calls back up into the orchestrator.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sized
from typing import Any

import structlog

from config.errors import DeviceFailed, LoaderGaveUp
from worker.core.availability import Availability
from worker.core.exits import STOPPED, Exit, ExitReason
from worker.core.link import SourceLink
from worker.health.liveness import Liveness

log = structlog.get_logger(__name__)
# Loads of one pipeline that failed, with --until-idle: the run ends NOT_SERVED (exit 6) rather
# than wait on its file host for ever (its tasks are given back for another host).
_BURST_LOAD_TRIES = 3


class Endings:
    def __init__(self, liveness: Liveness, device: str, held: Sized) -> None:
        self.exit: Exit = STOPPED  # how the process ends; the first reason to stop wins
        self.stop = asyncio.Event()  # set by a stop, a failure, a limit, burst mode
        self._liveness = liveness
        self._device = device  # the device the engine runs on, as the settings chose it
        self._held = held  # the held tasks, counted in the device_failed line

    def end(self, exit: Exit) -> None:
        """Stop working, for ``exit``; the first reason recorded is the one reported."""
        if self.exit == STOPPED:
            self.exit = exit
        self.stop.set()

    def limit(self, reason: str) -> None:
        """A resource limit was crossed (``BatchObserver``): drained, exits 4."""
        if self.exit == STOPPED:
            log.error(
                "resource_limit_exceeded",
                reason=reason,
                action="finishing this batch, giving back the rest, exiting 4",
            )
        self.end(Exit(ExitReason.RESOURCE_LIMIT, reason))

    def idle(self) -> None:
        """Burst mode: nothing pending or held; the run ends as a stop does (exit 0)."""
        log.info("idle_stopping", reason="--until-idle: nothing pending or held")
        self.stop.set()

    def not_served(self, why: str) -> None:
        """Burst mode found work it could not do (the source refused, gave up, or a pipeline
        cannot be loaded): its held tasks are given back by the drain, exits 6."""
        log.error("idle_not_served", reason=why, exit_code=ExitReason.NOT_SERVED.code)
        self.end(Exit(ExitReason.NOT_SERVED, why))

    def failed(self, part: str, error: BaseException | None) -> None:
        """``part`` ended raising ``error``. A failed device comes in here only, the moment the
        engine raised it (``Batches``), and again when its part ended (said once)."""
        if isinstance(error, DeviceFailed):
            self._device_failed(error)
            return
        if isinstance(error, LoaderGaveUp):
            log.error("exiting_for_a_restart", reason=str(error), exit_code=3)
            self.end(Exit(ExitReason.LOADER_FAILING, str(error)))
            return
        log.error("worker_part_failed", part=part, exc_info=error, exit_code=1)
        self.end(Exit(ExitReason.FAILED, f"{part} failed: {type(error).__name__}: {error}"))

    def _device_failed(self, error: DeviceFailed) -> None:
        """The device failed for good: no batch can run on it again, and no task is to blame.
        Said once, the moment the engine raised: /healthz answers ``restart`` and one error
        line names the error and the device; then the drain gives back every held task, the
        failed batch's too (no result is stored for them), without running another batch,
        and the process exits 7, over any other reason to stop that came first (a SIGTERM's
        drain, a crossed limit): a new process gets a new CUDA context."""
        if self.exit.reason is ExitReason.DEVICE_FAILED:
            return
        device = self._device
        self._liveness.must_restart(f"device {device} failed: {error}")
        log.error(
            "device_failed",
            error=str(error),
            device=device,
            held=len(self._held),
            exit_code=ExitReason.DEVICE_FAILED.code,
            action="giving back every held task, exiting for a new process",
        )
        self.exit = Exit(ExitReason.DEVICE_FAILED, f"device {device} failed: {error}")
        self.stop.set()


async def end_when_gone(link: SourceLink[Any], endings: Endings) -> None:
    """A source gone for good gives nothing ever again: end the process (exit 5)."""
    if link.gone is None:
        await asyncio.Event().wait()
        return
    await link.gone.wait()
    endings.end(Exit(ExitReason.SOURCE_GONE, link.gone_reason))


async def end_when_idle(
    link: SourceLink[Any], held: Sized, availability: Availability, endings: Endings
) -> None:
    """Burst mode: stop once nothing is held and the consumers have nothing pending, seen
    twice in a row (an advisory is stored a moment after its task leaves the consumer); or
    end NOT_SERVED, held tasks or not, once the source says it has given up
    (``SourceLink.given_up``) or a pipeline failed ``_BURST_LOAD_TRIES`` loads."""
    idle_before = False
    while not endings.stop.is_set():
        await asyncio.sleep(link.fetch_wait_s)
        given_up = link.given_up() or availability.given_up(_BURST_LOAD_TRIES)
        if given_up is not None:  # its held tasks are given back by the drain
            endings.not_served(given_up)
            return
        idle = len(held) == 0 and await link.source.idle() and len(held) == 0
        if idle and idle_before:
            why = link.unserved()
            if why is None:
                endings.idle()
            else:
                endings.not_served(why)
        idle_before = idle
