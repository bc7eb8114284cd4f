"""Antenna's reservations as deliveries, and how many more this process can keep.

A task reserved from Antenna is a ``Delivered`` task (the core's port) whose handle is its
``Reservation``, which runs out ``ttr_s`` after it was made: Antenna then delivers it again
(once). Its job and pipeline are the job's it was reserved from; its delivery count is the one
in its reply subject, against Antenna's ``max_deliver``. There is no call to extend, release
or give back a reservation: a task not posted is "left to Antenna's redelivery", said in the
log.

``Reservations`` keeps what is reserved and not settled, and the rate at which this process
settles tasks while it holds some (its busy rate): ``allowed`` is how many more it may reserve
so that everything reserved is finished within ``finish_within_s`` of its reservation, and
never fewer than one batch while it holds none (the rate then cannot stop it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from config.names import env_name
from worker.core.ports import Delivered

log = structlog.get_logger(__name__)
_DECAY_AFTER_BUSY_S = 120.0  # the rate follows the last two minutes or so of work


def delivered_of(reply_subject: str, unknown: int) -> int:
    """The delivery count in a JetStream ack subject (``$JS.ACK.<stream>.<consumer>.<delivered>.
    <stream seq>...``, or with a domain and account hash before the stream); ``unknown``
    when the subject is not one (then the delivery is treated as the last)."""
    tokens = reply_subject.split(".")
    if tokens[:2] != ["$JS", "ACK"]:
        return unknown
    index = 4 if len(tokens) == 9 else 6 if len(tokens) >= 11 else -1
    if index < 0 or not _digits(tokens[index]):
        return unknown
    return max(1, int(tokens[index]))


def _digits(token: str) -> bool:
    """ASCII digits only: ``'²'.isdigit()`` is true and ``int('²')`` fails."""
    return token.isascii() and token.isdigit()


@dataclass(eq=False)
class Reservation:
    """One reserved task, the handle of its ``Delivered`` (the Antenna settler's own): the job
    it was reserved from and that job's pipeline, its image and reply subject, and when the
    reservation runs out."""

    job: int  # the job it was reserved from
    pipeline: str  # that job's pipeline slug
    image_id: str
    reply_subject: str
    reserved_at: float  # time.monotonic()
    expires_at: float
    on_settled: Callable[[Reservation, bool], None] = field(repr=False)
    settled: bool = False

    def seconds_left(self, now: float | None = None) -> float:
        return self.expires_at - (time.monotonic() if now is None else now)

    def posted(self) -> None:
        """Its end was recorded: its result posted (or, unusable, logged)."""
        self._settle(posted=True)

    def left_to_redelivery(self) -> None:
        """Nothing posted: Antenna delivers it again once the reservation runs out."""
        if not self.settled:
            log.info(
                "task_left_to_redelivery",
                job_id=self.job,
                image_id=self.image_id,
                redelivered_in_s=round(max(0.0, self.seconds_left()), 1),
                hint="Antenna delivers a task again once its reservation runs out",
            )
        self._settle(posted=False)

    def _settle(self, posted: bool) -> None:
        if not self.settled:
            self.settled = True
            self.on_settled(self, posted)


AntennaDelivered = Delivered[Reservation]


class Reservations:
    """What is reserved and not settled, and the busy rate; one event loop owns it."""

    def __init__(
        self, ttr_s: float, finish_within_s: float, first_size: int, *, batch_size: int
    ) -> None:
        self.ttr_s = ttr_s
        self.finish_within_s = finish_within_s
        self.first_size = first_size  # WORKER_ANTENNA__RESERVATION_SIZE (or the batch size)
        self.floor = max(1, min(first_size, batch_size))  # one batch: WORKER_LOADER__BATCH_SIZE
        self._floor_said: str | None = None  # the rate last said to be overridden
        self._reserved: dict[int, Reservation] = {}
        self._busy_s = 0.0
        self._settled = 0.0
        self._since = time.monotonic()

    def __len__(self) -> int:
        return len(self._reserved)

    def _tick(self) -> None:
        now = time.monotonic()
        if self._reserved:
            self._busy_s += now - self._since
        self._since = now
        if self._busy_s > _DECAY_AFTER_BUSY_S:
            self._busy_s /= 2
            self._settled /= 2

    def add(self, delivery: Reservation) -> None:
        self._tick()
        self._reserved[id(delivery)] = delivery

    def settled(self, delivery: Reservation, posted: bool) -> None:
        self._tick()
        self._reserved.pop(id(delivery), None)
        if posted:
            self._settled += 1

    def rate_per_s(self) -> float | None:
        """Tasks settled per second of holding some; None before a few were."""
        self._tick()
        if self._settled < 2 or self._busy_s <= 0:
            return None
        return self._settled / self._busy_s

    def allowed(self) -> int:
        """How many more tasks may be reserved now. With none held, at least ``floor`` (one
        batch, at most ``first_size``), whatever the rate: a reservation then waits behind
        nothing of ours. Else none while the oldest reservation is older than
        ``finish_within_s`` (this process is behind), and otherwise what the busy rate
        finishes within it, less what is held (before a rate is measured: ``first_size``,
        less what is held).

        The rate limits what would queue behind what is held; it never stops reserving: it
        is measured only while tasks are held, so a rule that allowed none with none held
        would never see it change again (a slow result post once measured a rate that
        finishes less than one task within ``finish_within_s``: nothing more was reserved
        for good while /healthz said ok). The batch's worth, not one task: what is reserved
        with nothing held goes through as one batch and one result post, which is about the
        time one task alone takes (the forward pass, the post and Antenna's answer are per
        batch), so one task would cut the throughput by the batch size and finish nothing
        sooner; and the rate one-task reservations measure is one task per batch time, so a
        floor of one would keep it there. One batch, not ``first_size``: a reservation size
        over the batch size (``WORKER_ANTENNA__RESERVATION_SIZE`` 64, batches of 8) is several
        batches in turn, which a slow rate does not finish within the TTR (0.05 tasks/s: 64
        tasks need some 1,280 s against a 30 s TTR), so they would run out, come back and lose
        one of their deliveries. When the rate allows less than the floor, that is said once
        per rate (``antenna_reservation_floor``)."""
        held = len(self._reserved)
        oldest = self.oldest_age_s()
        if oldest is not None and oldest > self.finish_within_s:
            return 0
        rate = self.rate_per_s()
        budget = self.first_size if rate is None else int(rate * self.finish_within_s)
        if not held:
            if rate is not None and budget < self.floor:
                self._say_floor(rate, budget)
            else:
                self._floor_said = None
            return max(self.floor, budget)
        return max(0, budget - held)

    def _say_floor(self, rate: float, budget: int) -> None:
        """Once per rate (to two significant figures): the floor, not the rate, decides."""
        shown = f"{rate:.2g}"
        if shown == self._floor_said:
            return
        self._floor_said = shown
        log.info(
            "antenna_reservation_floor",
            rate_per_s=round(rate, 3),
            finish_within_s=self.finish_within_s,
            allowed_by_rate=budget,
            floor=self.floor,
            hint=f"nothing is held: one batch ({env_name('loader', 'batch_size')}, at most "
            f"{env_name('antenna', 'reservation_size')}) is reserved whatever the rate, which "
            f"finishes fewer within {env_name('antenna', 'finish_within_s')}",
        )

    def oldest_age_s(self) -> float | None:
        if not self._reserved:
            return None
        return time.monotonic() - min(d.reserved_at for d in self._reserved.values())

    def oldest_seconds_left(self) -> float:
        """Seconds before the oldest held reservation runs out; the TTR when none is held."""
        if not self._reserved:
            return self.ttr_s
        now = time.monotonic()
        return min(d.seconds_left(now) for d in self._reserved.values())

    def reserved(self) -> list[Reservation]:
        return list(self._reserved.values())

    def metrics(self) -> dict[str, Any]:
        return {"held": len(self._reserved), "oldest_seconds_left": self.oldest_seconds_left()}
