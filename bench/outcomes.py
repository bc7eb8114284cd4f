"""What a benchmark's stage made, counted before any rate is reported.

A stage that times failures reports a rate as readily as one that times images (the loader
stage did, across several changes, unnoticed): so every stage counts its outcomes, and
``Outcomes.check`` refuses (``BenchmarkFailed``) when any image failed that should not have,
or when fewer came back than were asked for. ``refusing`` turns that into a printed error and
exit status 1 for a benchmark's ``main``.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
EXIT_FAILED = 1


class BenchmarkFailed(Exception):
    """A stage's outcomes were not what it was asked for: no rate may be reported."""


@dataclass
class Outcomes:
    stage: str
    ok: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    first_failure: str = ""

    def good(self, count: int = 1) -> None:
        self.ok += count

    def bad(self, kind: str, detail: str) -> None:
        self.failed[kind] += 1
        if not self.first_failure:
            self.first_failure = detail[:300]

    def check(self, expected: int) -> None:
        """``BenchmarkFailed`` unless exactly ``expected`` outcomes, all good, were counted."""
        failures = sum(self.failed.values())
        if failures:
            kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(self.failed.items()))
            raise BenchmarkFailed(
                f"{self.stage}: {failures} of {self.ok + failures} images failed ({kinds}); "
                f"first: {self.first_failure}; no rate reported"
            )
        if self.ok != expected:
            raise BenchmarkFailed(
                f"{self.stage}: {self.ok} images made, {expected} asked for; no rate reported"
            )

    def summary(self) -> dict[str, Any]:
        return {"ok": self.ok, "failed": dict(self.failed)}


def refusing(main: Callable[[], T]) -> Callable[[], T]:
    """``main`` that prints a ``BenchmarkFailed`` as one error line and exits 1."""

    def wrapped() -> T:
        try:
            return main()
        except BenchmarkFailed as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_FAILED) from None

    return wrapped
