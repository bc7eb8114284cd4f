"""A batch's images, from the stash and the loader; and, while a batch runs, what the loader
already has ready moved into the stash, never waiting for a child."""

from __future__ import annotations

from collections.abc import Sequence

from config.errors import LoaderFailure
from datasets.loader import Loaded, StreamingLoader
from worker.engine.read_stats import Reads
from worker.engine.recovery import Recovery
from worker.engine.stash import Stash


class Collector:
    """On the engine thread, the one reader of the loader's results."""

    def __init__(
        self, loader: StreamingLoader, stash: Stash, recovery: Recovery, reads: Reads
    ) -> None:
        self.loader = loader
        self._stash = stash
        self._recovery = recovery
        self._reads = reads

    def collect(self, keys: Sequence[int]) -> tuple[dict[int, Loaded], str | None]:
        """What arrived of ``keys``, and the loader's failure if it broke (recovered)."""
        wanted = set(keys)
        loaded = self._stash.take(keys)
        failure = self._recovery.deferred
        if failure is not None:
            # It broke while the last batch ran: as if it broke now (what this batch still
            # needs is given back, so an image that kills children uses up its deliveries).
            self._recovery.recover(wanted, failure)
            return loaded, failure
        while len(loaded) < len(wanted):
            try:
                item = self.loader.next_loaded()
            except LoaderFailure as error:
                self._recovery.recover(wanted, str(error))
                return loaded, str(error)
            self._reads.note(item)
            if item.key in wanted:
                loaded[item.key] = item
            else:
                self._stash.keep(item)
        return loaded, None

    def take_ready(self, upcoming: list[int]) -> None:
        """Move finished loads the loader holds into the stash, while some of ``upcoming``
        are missing; at most what it had outstanding."""
        if self._recovery.deferred is not None:
            return
        for _ in range(self.loader.outstanding()):
            if self._stash.holds(upcoming) or not self.loader.ready():
                return
            try:
                item = self.loader.next_loaded()
            except LoaderFailure as error:
                self._recovery.defer(str(error))  # recovered by the next batch's collect
                return
            self._reads.note(item)
            self._stash.keep(item)
