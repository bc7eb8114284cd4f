"""The job consumers' state, with one owner: which job consumers of ours exist this round,
how many others count against the bound, the remakes owed, what the consumers deleted here
had delivered, and the counts for the metrics and /healthz.

The lifecycle's parts (``worker.nats.consumer_maker``, ``worker.nats.drift_repair``,
``worker.nats.consumer_deleter``, composed by ``worker.nats.lifecycle``) ask it and tell it
what they did; none holds a piece of it or writes another's. It talks to no server.

A round is one discovery's work on the map: after a listing (``listed``: the map is the
listing, nothing else counts), or without one (``unlisted``: the consumers made on hints
since, and the others counted from the last listing). ``round_done`` then sets how many
exist, for the metrics and for the next scout read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from nats.js import api

from worker.nats.consumer_stats import ConsumerStats

DONE_KEPT = 10_000  # deleted consumers remembered, so a late new-jobs message makes none again


class JobConsumerState:
    """The job consumers' map and what is known about it, written by its methods only."""

    def __init__(self, bound: int) -> None:
        self._stats = ConsumerStats(bound=bound)
        self._consumers: dict[str, api.ConsumerInfo] = {}  # by name: this round's
        self._others = 0  # job consumers that exist besides those in the map
        self._known: set[str] = set()  # job consumers as last listed, and made since
        self._owed: dict[str, int] = {}  # subject -> start sequence of a remake not done yet
        self._done: dict[str, int] = {}  # subject -> what its consumer deleted here delivered
        self._listing = False  # this round follows a listing
        self._made_at = 0  # made when this round began

    # The rounds.

    def listed(self, ours: Mapping[str, api.ConsumerInfo]) -> None:
        """A round after a listing: ``ours``, the job consumers listed, are all that exist."""
        self._begin(ours, others=0, listing=True)
        self._known = set(ours)
        self._stats.existing = len(ours)

    def unlisted(self, known: Mapping[str, api.ConsumerInfo], others: int) -> None:
        """A round with no listing: ``known`` (made or found since it), ``others`` besides."""
        self._begin(known, others=others, listing=False)

    def round_done(self) -> None:
        """How many exist now: the map, after a listing; else those made added."""
        if self._listing:
            self._stats.existing = len(self._consumers)
        else:
            self._stats.existing += self._stats.made - self._made_at

    def _begin(self, consumers: Mapping[str, api.ConsumerInfo], others: int, listing: bool) -> None:
        self._consumers = dict(consumers)
        self._others = others
        self._listing = listing
        self._made_at = self._stats.made

    # Questions.

    @property
    def consumers(self) -> Mapping[str, api.ConsumerInfo]:
        """This round's job consumers of ours, by name (read-only)."""
        return MappingProxyType(self._consumers)

    def room(self) -> bool:
        """Whether one more job consumer stays within the bound."""
        return self._others + len(self._consumers) < self._stats.bound

    @property
    def bound(self) -> int:
        return self._stats.bound

    @property
    def existing(self) -> int:
        """Job consumers of ours, as last listed (and made since, without a listing)."""
        return self._stats.existing

    @property
    def refusal(self) -> str | None:
        """The server's last refusal, while jobs still wait for room."""
        return self._stats.refusal

    @property
    def stats(self) -> ConsumerStats:
        """A copy of the counts, for the metrics and /healthz."""
        return replace(self._stats)

    def owed(self) -> list[tuple[str, int]]:
        """The remakes owed: (subject, start sequence), oldest first."""
        return list(self._owed.items())

    def owes(self, subject: str) -> bool:
        return subject in self._owed

    def deleted_here(self, subject: str) -> bool:
        """Whether ``subject``'s consumer was deleted by this process (and remembered)."""
        return subject in self._done

    def delivered_by_deleted(self, subject: str) -> int:
        """What ``subject``'s consumer deleted here had delivered (0: none deleted)."""
        return self._done.get(subject, 0)

    # What the parts did.

    def bounded(self, bound: int) -> None:
        """The bound, read from the server at start."""
        self._stats.bound = bound

    def made(self, info: api.ConsumerInfo) -> bool:
        """A consumer the server answered for: True when it is new (counted as made), False
        when it was listed already or made before (``add_consumer`` found it)."""
        self._consumers[info.name] = info
        self._stats.refusal = None
        if info.name in self._known:
            return False
        self._known.add(info.name)
        self._stats.made += 1
        return True

    def found(self, info: api.ConsumerInfo) -> None:
        """A consumer made meanwhile by another process (with another start): it serves."""
        self._consumers[info.name] = info

    def updated(self, infos: Mapping[str, api.ConsumerInfo]) -> None:
        """Consumers given this process's delivery settings: the server's answers."""
        self._consumers.update(infos)

    def count_updated(self) -> None:
        self._stats.updated += 1

    def refused(self, reason: str) -> bool:
        """The server refused a consumer: counted; True for the first of a run of refusals."""
        self._stats.refused += 1
        first = self._stats.refusal is None
        self._stats.refusal = reason
        return first

    def refusal_over(self) -> None:
        """No job waits for room any more."""
        self._stats.refusal = None

    def deleted(self, name: str, subject: str, delivered: int) -> None:
        """``name`` (of ``subject``) was deleted, having delivered up to ``delivered``: made
        again, it counts as made."""
        self._consumers.pop(name, None)
        self._known.discard(name)
        self._stats.deleted += 1
        self._done[subject] = delivered
        if len(self._done) > DONE_KEPT:
            del self._done[next(iter(self._done))]

    def owe(self, subject: str, start: int) -> None:
        """A remake from ``start``, with no room for it now."""
        self._owed[subject] = start

    def paid(self, subject: str) -> None:
        """The remake owed for ``subject`` was made."""
        del self._owed[subject]
