"""The loader children's reads, for the metrics: retries by reason since the start, and each
current child's statistics as it last reported them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from datasets.loader import Loaded
from datasets.reads import ReadStats


class Reads:
    """Noted on the engine thread, as loads arrive; read on any thread."""

    def __init__(self) -> None:
        self.retries: Counter[str] = Counter()  # by reason, since the start (a metric)
        self._by_child: dict[int, ReadStats] = {}  # per loader child, as it last reported

    def note(self, item: Loaded) -> None:
        self.retries.update(item.retries)
        if item.reads is not None:
            self._by_child[item.reads.pid] = item.reads

    def of(self, child_pids: Iterable[int]) -> list[ReadStats]:
        """The statistics of the children ``child_pids`` (a restarted loader's are new)."""
        children = set(child_pids)
        return [stats for pid, stats in list(self._by_child.items()) if pid in children]
