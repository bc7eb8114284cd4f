"""What became of a task's work in the engine: its detections, or the failure that stopped it.

Imports nothing of ours but the errors and the typed detections (``pipelines.found``). Not a
wire schema: the core makes a ``results.Result`` of it, which each source renders in its own
format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from config.errors import Failure
from pipelines.found import Detection


@dataclass(frozen=True)
class Outcome:
    """What became of a task's work: its detections, or the failure that stopped it."""

    detections: list[Detection] | None = None
    failure: Failure | None = None
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def retryable(self) -> bool:
        return self.failure is not None and self.failure.retryable
