"""How the run ends: the first reason to stop is the one reported, a failed device wins over
any and is said once, and each way to end sets the stop every loop watches."""

from __future__ import annotations

import structlog

from config.errors import DeviceFailed, LoaderGaveUp
from worker.core.endings import Endings
from worker.core.exits import Exit, ExitReason
from worker.health.liveness import Liveness


def endings() -> tuple[Endings, Liveness]:
    liveness = Liveness(60.0)
    return Endings(liveness, "cuda:0", held=[1, 2, 3]), liveness


def test_the_first_reason_to_stop_is_the_one_reported():
    ending, _ = endings()
    with structlog.testing.capture_logs() as logs:
        ending.limit("MAX_TREE_RSS_BYTES crossed")
        ending.failed("fetch-loop", RuntimeError("a bug"))
        ending.limit("MAX_OPEN_FDS crossed")

    assert ending.stop.is_set()
    assert ending.exit == Exit(ExitReason.RESOURCE_LIMIT, "MAX_TREE_RSS_BYTES crossed")
    assert [line["event"] for line in logs].count("resource_limit_exceeded") == 1


def test_a_failed_device_wins_over_an_earlier_reason_and_is_said_once():
    ending, liveness = endings()
    ending.end(Exit(ExitReason.SOURCE_GONE, "closed"))
    with structlog.testing.capture_logs() as logs:
        ending.failed("process-loop", DeviceFailed("CUDA error: an illegal memory access"))
        ending.failed("process-loop", DeviceFailed("CUDA error: again"))  # its part ended

    assert (ending.exit.reason, ending.exit.code) == (ExitReason.DEVICE_FAILED, 7)
    (line,) = [line for line in logs if line["event"] == "device_failed"]
    assert line["device"] == "cuda:0" and line["held"] == 3 and line["exit_code"] == 7
    assert "device cuda:0 failed" in (liveness.restart_reason() or "")


def test_a_loader_that_gave_up_ends_3_and_any_other_failure_ends_1_naming_its_part():
    gave_up, _ = endings()
    gave_up.failed("process-loop", LoaderGaveUp("five failures in a row"))
    failed, _ = endings()
    failed.failed("fetch-loop", RuntimeError("a bug"))

    assert gave_up.exit.code == 3 and gave_up.stop.is_set()
    assert failed.exit.code == 1 and failed.exit.detail == "fetch-loop failed: RuntimeError: a bug"


def test_burst_modes_idle_end_is_a_stop_and_its_not_served_end_is_6():
    idle, _ = endings()
    idle.idle()
    unserved, _ = endings()
    unserved.not_served("the source refused every fetch")

    assert idle.stop.is_set() and idle.exit.code == 0
    assert unserved.exit == Exit(ExitReason.NOT_SERVED, "the source refused every fetch")
