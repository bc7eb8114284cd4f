"""``inference-worker check`` against the fake Antenna (a real HTTP server on 127.0.0.1)."""

from __future__ import annotations

from config.settings import load_settings
from tests.antenna_fake import FakeAntenna
from worker.commands.check import _antenna_problems

TOKEN = "check-token-3e9a"


def settings_for(fake: FakeAntenna, **antenna: object) -> object:
    configured = {"base_url": fake.url, "token": TOKEN, "project_ids": "1", **antenna}
    return load_settings(for_worker=False, source="antenna", antenna=configured)


async def test_check_gives_antenna_the_deadline_run_does_and_calls_a_timeout_slow() -> None:
    """``check`` capped each call at an undocumented 10 s and called an Antenna that answers
    in 11 s, which ``run`` works with (WORKER_ANTENNA__REQUEST_TIMEOUT_S, 30 s), unreachable."""
    fake = FakeAntenna(token=TOKEN)
    with fake.running():
        fake.misbehave("jobs", "late", times=1, interval_s=11.0)
        problems = await _antenna_problems(settings_for(fake))  # type: ignore[arg-type]
        assert not [p for p in problems if "within" in p or "unreachable" in p], problems
        fake.misbehave("jobs", "late", times=1, interval_s=3.0)
        problems = await _antenna_problems(settings_for(fake, request_timeout_s=1.0))  # type: ignore[arg-type]
    (slow,) = [p for p in problems if "within" in p]
    assert slow.startswith("Antenna too slow (GET ") and "unreachable" not in slow, slow
    assert "no complete answer within 1s (WORKER_ANTENNA__REQUEST_TIMEOUT_S)" in slow
