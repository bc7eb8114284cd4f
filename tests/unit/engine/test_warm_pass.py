"""The warm pass at start: the settings that a forward pass or a batch, as timed on this host,
does not fit are refused, each named with the value that fits; a pass that never ends too."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import structlog.testing

from config.errors import ConfigError
from config.settings import load_settings
from pipelines.runner import DeviceLimits
from worker.engine import warm_pass
from worker.engine.warm_pass import StageTime


def _settings(**groups):
    base = {"health": {"stall_timeout_s": 120, "watchdog_timeout_s": 180}, "metrics": {"port": 0}}
    return load_settings(for_worker=False, **{**base, **groups})


def _detector(per_image_s: float, chunk: int = 4) -> StageTime:
    return StageTime("moths", "detector", per_image_s, chunk, True)


def test_times_that_fit_every_budget_are_accepted():
    times = [_detector(3.0), StageTime("moths", "classifier", 0.05, 64, False)]
    assert warm_pass.problems(times, _settings()) == []  # AMI on a 2-core CPU host, idle


def test_a_detector_pass_too_long_for_the_stall_timeout_names_the_settings_and_what_fits():
    settings = _settings(loader={"batch_size": 4})  # the batch fits the ack wait
    (line,) = warm_pass.problems([_detector(10.0)], settings)  # 40 s a pass, 160 s at 4x
    assert "WORKER_MODEL__DETECTOR_BATCH_SIZE=4" in line
    assert "WORKER_HEALTH__STALL_TIMEOUT_S (120s)" in line
    assert "WORKER_HEALTH__WATCHDOG_TIMEOUT_S (180s)" in line
    assert "set WORKER_MODEL__DETECTOR_BATCH_SIZE to 3 or less" in line


def test_a_crop_pass_too_long_names_the_crop_batch_size():
    times = [StageTime("moths", "classifier", 1.0, 64, False)]
    (line,) = warm_pass.problems(times, _settings())
    assert "WORKER_MODEL__CROP_BATCH_SIZE=64" in line and "to 30 or less" in line


def test_one_image_too_slow_for_any_pass_asks_for_a_faster_device():
    settings = _settings(loader={"batch_size": 1})
    (line,) = warm_pass.problems([_detector(40.0, chunk=1)], settings)
    assert "use a faster device" in line


def test_a_batch_longer_than_the_redelivery_names_the_batch_size_and_the_ack_wait():
    settings = _settings(loader={"batch_size": 64})  # 7 s x 64 = 448 s, over 300 s
    (line,) = warm_pass.problems([_detector(7.0, chunk=1)], settings)
    assert "WORKER_LOADER__BATCH_SIZE=64" in line and "WORKER_NATS__ACK_WAIT_S (300s)" in line
    assert "set WORKER_LOADER__BATCH_SIZE to 10 or less" in line


def test_with_antenna_a_batch_must_fit_its_reservation():
    settings = _settings(
        source="antenna",
        antenna={"base_url": "http://antenna.test/api/v2", "ttr_s": 200},
        loader={"batch_size": 16},
    )
    (line,) = warm_pass.problems([_detector(4.0, chunk=1)], settings)
    assert "WORKER_ANTENNA__TTR_S (200s)" in line


class _Classifier:
    """A classifier stage whose pass takes ``seconds`` per call; ``hang`` never returns."""

    def __init__(self, seconds: float, hang: threading.Event | None = None) -> None:
        self.stage = SimpleNamespace(preprocess=SimpleNamespace(size=8))
        self.seconds = seconds
        self.hang = hang
        self.calls = 0

    def logits(self, crops):
        self.calls += 1
        if self.hang is not None:
            self.hang.wait()
        time.sleep(self.seconds)
        return crops


def _runner(classifier: _Classifier, crop_batch: int = 64) -> SimpleNamespace:
    limits = DeviceLimits(crop_batch=crop_batch)
    return SimpleNamespace(limits=limits, detector=None, filter=None, classifier=classifier)


def _stall_timeout(seconds: float):
    """Settings with a stall timeout too short for the rules between settings (which are not
    what is tested here), set after they were checked."""
    settings = _settings()
    settings.health.stall_timeout_s = seconds
    return settings


def test_the_pass_is_timed_warm_and_a_slow_one_refuses_the_start():
    classifier = _Classifier(0.5)
    settings = _stall_timeout(2)
    with pytest.raises(ConfigError, match="WORKER_MODEL__CROP_BATCH_SIZE=8") as refused:
        asyncio.run(warm_pass.check(settings, {"whole": _runner(classifier, crop_batch=8)}))
    assert classifier.calls == 3, "a warm-up, then the fastest of two passes timed"
    assert "or less" in str(refused.value) and "that does not fit" in str(refused.value)


def test_a_pass_that_fits_but_not_four_times_over_is_said_not_refused():
    settings = _stall_timeout(2)
    with structlog.testing.capture_logs() as logs:
        asyncio.run(warm_pass.check(settings, {"whole": _runner(_Classifier(0.2), crop_batch=8)}))
    tight = [e for e in logs if e["event"] == "warm_pass_tight"]
    assert len(tight) == 1 and "WORKER_MODEL__CROP_BATCH_SIZE=8" in tight[0]["problem"]
    assert "4 times that does not fit" in tight[0]["problem"]


def test_a_fast_pass_is_accepted_and_its_times_returned():
    times = asyncio.run(warm_pass.check(_settings(), {"whole": _runner(_Classifier(0.0))}))
    assert [(t.pipeline, t.stage, t.first) for t in times] == [("whole", "classifier", True)]


def test_a_warm_pass_that_never_ends_refuses_the_start_within_the_stall_timeout():
    never = threading.Event()
    settings = _stall_timeout(0.5)
    try:
        with pytest.raises(ConfigError, match="did not end within WORKER_HEALTH__STALL_TIMEOUT_S"):
            asyncio.run(warm_pass.check(settings, {"whole": _runner(_Classifier(0.0, never))}))
    finally:
        never.set()  # its daemon thread ends
