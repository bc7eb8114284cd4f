"""Which jobs this process holds reservations of that Antenna no longer lists as active.

Antenna answers ``{"tasks": []}`` for a job that is not active (cancelled, failed, done) and
ignores results posted for it, so the core drops what it still holds of such a job before it
runs (``worker/core/dropping.py``). A job counts as inactive only when the last listing
answered in full and did not show it: a listing that failed, or one Antenna refused (the
token, a project), says nothing of a job, and what is held of it is run as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from worker.antenna.job_listing import JobRotation
from worker.antenna.reservations import Reservations


def inactive_jobs(
    jobs: JobRotation, reservations: Reservations
) -> Callable[[], Awaitable[frozenset[str]]]:
    """The ids (as tasks carry them) of the jobs held reservations are of that the last
    listing, answered in full, did not show as active. The jobs are listed again first when
    a listing is due (once a poll interval, as the source's fetch lists them), so a process
    whose cap is full, and so fetches nothing, still learns of a cancel."""

    async def inactive() -> frozenset[str]:
        if not len(reservations):
            return frozenset()
        if jobs.due():
            await jobs.refresh()
        if not jobs.ever_listed or jobs.failing_for_s() is not None or jobs.last_refusal:
            return frozenset()
        active = set(jobs.active_ids())
        return frozenset(str(r.job) for r in reservations.reserved() if r.job not in active)

    return inactive
