"""How often a process lists the job consumers: at ``WORKER_NATS__JOB_DISCOVERY_S`` while it
works, less and less often while it is idle, up to ``WORKER_NATS__JOB_DISCOVERY_IDLE_S``.

A listing is the one discovery request whose size grows with the jobs (every consumer of the
tasks stream, a few hundred bytes each), and a fleet of idle processes pays it once a second
each for nothing: a new job reaches an idle process by its hint (``worker.nats.hints``), which
serves it with no listing. So a listing after which the process is idle (it fetched no task
since the one before, holds no new-jobs message, no job waits for the server's room, and its
hints are whole) doubles the interval to the next, up to the idle bound; a task fetched, a
message in hand, a job consumer the server refuses (met at a listing or on a hint: the job is
retried at every listing), or a hint subscription refused brings it back to ``JOB_DISCOVERY_S``
at once (a
publish lost in a reconnect is found by the next listing: up to ``JOB_DISCOVERY_IDLE_S`` later
on an idle process). What an idle process's rarer listing finds late: a task given back or
redelivered on a job it has no work from (a worker stopped or died), and the deletes of finished
jobs' consumers, when no process of the fleet works.
"""

from __future__ import annotations


class ListingCadence:
    """The interval to the next periodic listing, by what the process did since the last."""

    def __init__(self, base_s: float, idle_most_s: float) -> None:
        self._base_s = base_s
        self._most_s = max(base_s, idle_most_s)
        self.interval_s = base_s
        self._worked = False

    def worked(self) -> None:
        """A task fetched (or the like): back to the base interval at once."""
        self._worked = True
        self.interval_s = self._base_s

    def listed(self, *, quiet: bool) -> None:
        """A periodic listing happened; ``quiet``: nothing in hand and the hints whole. Idle
        since the last listing (and quiet), the next waits twice as long, up to the bound."""
        if self._worked or not quiet:
            self.interval_s = self._base_s
        else:
            self.interval_s = min(self._most_s, self.interval_s * 2)
        self._worked = False
