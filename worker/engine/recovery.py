"""Rebuilding the persistent loader when it breaks (a timeout, a child's death, an unhealthy
child), and giving up once it has failed too many batches in a row."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from config.errors import LoaderFailure, LoaderGaveUp
from datasets.loader import StreamingLoader

log = structlog.get_logger(__name__)


class Recovery:
    """On the engine thread. A failure seen while a batch runs (looking ahead) is ``deferred``
    and recovered by the next batch, as if it broke then."""

    def __init__(
        self,
        loader: StreamingLoader,
        max_consecutive_failures: int,
        heartbeat: Callable[[], None],
    ) -> None:
        self.loader = loader
        self.max_consecutive_failures = max_consecutive_failures
        self.consecutive_failures = 0
        self._heartbeat = heartbeat
        self.deferred: str | None = None  # seen while preparing the next batch

    def defer(self, reason: str) -> None:
        self.deferred = reason

    def replace_unhealthy(self) -> None:
        """A stopped or dead child that holds no request would never trip the timeout, yet
        it is lost capacity (or a trap for the next request): replace it now."""
        unhealthy = self.loader.unhealthy_children()
        if unhealthy:
            self.recover(set(), f"loader children unhealthy: {', '.join(unhealthy)}")

    def count(self, failure: str | None) -> None:
        """A batch's collection ended with ``failure`` (None: it did not fail); LoaderGaveUp
        when that makes too many in a row."""
        if failure is None:
            self.consecutive_failures = 0
            return
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.max_consecutive_failures:
            raise LoaderGaveUp(
                f"the loader failed {self.consecutive_failures} times in a row; last: {failure}"
            )

    def recover(self, wanted: set[int], reason: str) -> None:
        """Rebuild the loader; reload what later batches still need, the rest (``wanted``, the
        batch collecting now) is given back."""
        started = time.perf_counter()
        self.deferred = None  # whatever broke it, this loader is the new one
        self._heartbeat()  # recovering is not being wedged: the watchdog gets a fresh window
        try:
            lost = self.loader.restart()
        except LoaderFailure as error:
            raise LoaderGaveUp(f"no working loader after: {reason}; {error}") from None
        self._heartbeat()
        again = [request for request in lost if request.key not in wanted]
        if again:
            self.loader.submit(again)
        log.warning(
            "loader_restarted",
            reason=reason,
            restart_s=round(time.perf_counter() - started, 3),
            given_back=len(lost) - len(again),
            reloading=len(again),
            child_pids=self.loader.child_pids(),
        )
