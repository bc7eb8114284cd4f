"""The assembly's view of its source before the source is open: the metrics exist from the
engine's start, and until the parts are open they say the source is not connected."""

from __future__ import annotations

from types import SimpleNamespace

from config.settings import load_settings
from worker.core.ports import SourceHealth
from worker.process.app import Assembly


def test_a_source_still_opening_reads_as_not_connected_and_down_since_the_start() -> None:
    app = Assembly(load_settings(for_worker=False))
    # Given parts made and their open() still waiting (an unreachable NATS server), whose
    # connection state counts as up before its first connect
    app.parts = SimpleNamespace(health=lambda: SourceHealth(True, 0.0))  # type: ignore[assignment]
    opening = app._source_health()
    assert opening.connected is False and opening.down_s >= 0.0
    # Once open, the parts' own health is read
    app._open = True
    assert app._source_health() == SourceHealth(True, 0.0)
