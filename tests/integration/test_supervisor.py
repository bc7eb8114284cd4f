"""The worker under the project's own supervisord config, wedged from outside and from inside.

Each scenario: a job is running, the worker is wedged, something notices, the process is
restarted, and every task still ends with exactly one result without running out of
deliveries (max_deliver=2).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.helpers import (
    client,
    consumer_idle,
    quiescent,
    submit,
    upload_images,
    wait_results,
    worker_env,
)
from tests.integration.supervisord import Supervisord
from worker.commands.job_client import job_results

pytestmark = [pytest.mark.integration, pytest.mark.supervisord, pytest.mark.slow]
IMAGES = 24


def supervised_env(settings, **extra: str) -> dict[str, str]:
    """The shared builder's WORKER_* variables, with the short budgets these tests need."""
    budgets = {
        "WORKER_NATS__ACK_WAIT_S": "20",
        "WORKER_NATS__STORE_RETRY_S": "5",
        "WORKER_NATS__MAX_DELIVER": "2",
        "WORKER_NATS__NAK_BACKOFF_BASE_S": "0.2",
        "WORKER_S3__READ_TIMEOUT_S": "1",
        "WORKER_S3__MAX_ATTEMPTS": "1",
        "WORKER_LOADER__TIMEOUT_S": "3",
        "WORKER_HEALTH__STALL_TIMEOUT_S": "6",
        "WORKER_HEALTH__WARM_PASS": "false",  # tight budgets: no warm pass
        "WORKER_HEALTH__WATCHDOG_TIMEOUT_S": "12",
        "WORKER_HEALTH__DRAIN_TIMEOUT_S": "3",
    }
    return worker_env(settings, inherit=False, **{**budgets, **extra})


async def run_job_and_wedge(sup, settings, s3, bucket, job, wedge) -> dict:
    """Start a job, wedge the worker once it is working, wait until every task has a result."""
    uris = upload_images(s3, bucket, IMAGES, prefix=job)
    first_pid = sup.worker_pid()
    sup.wait_healthy()
    async with client(settings) as js:
        await submit(js, settings, job, uris)
        wedged_at = time.monotonic()
        observed = await wedge(first_pid, js)
        deadline = time.monotonic() + 120
        second_pid = first_pid
        while second_pid == first_pid and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            second_pid = await asyncio.to_thread(sup.worker_pid)
        restarted_s = time.monotonic() - wedged_at
        results = await wait_results(js, settings, job, IMAGES, timeout_s=120)
        await consumer_idle(js, settings, timeout_s=60)
        await quiescent(js, settings, timeout_s=60)  # nothing can arrive late after this
        results = await job_results(js, settings.nats, job)
    print(
        f"\n{job}: restarted after {restarted_s:.1f}s, all {IMAGES} results after "
        f"{time.monotonic() - wedged_at:.1f}s, highest attempt {max(r['attempt'] for r in results)}"
    )
    return {
        "first_pid": first_pid,
        "second_pid": second_pid,
        "results": results,
        "observed": observed,
    }


def assert_nothing_lost(outcome) -> None:
    results = outcome["results"]
    task_ids = [r["task_id"] for r in results]
    assert len(task_ids) == IMAGES and len(set(task_ids)) == IMAGES, "one result per task"
    assert {r["status"] for r in results} == {"ok"}, "no task ran out of deliveries"
    assert max(r["attempt"] for r in results) <= 2
    assert outcome["second_pid"] != outcome["first_pid"], "the process was restarted"


@pytest.fixture
def supervised(tmp_path, nats_server, settings_for):
    started = []

    def start(healthwatch_failures: int = 2, **extra: str) -> Supervisord:
        settings = settings_for(nats_server.url)
        env = supervised_env(settings, **extra)
        sup = Supervisord(tmp_path / "sup", env, healthwatch_failures=healthwatch_failures)
        sup.start()
        started.append(sup)
        return sup

    yield start
    for sup in started:
        assert sup.stop() == [], "supervisord left processes behind"


async def test_a_worker_stopped_from_outside_is_restarted_by_the_eventlistener(
    supervised, nats_server, s3_server, bucket, settings_for
):
    settings = settings_for(nats_server.url, nats={"max_deliver": 2})
    sup = supervised()

    async def wedge(pid: int, js) -> None:
        await wait_results(js, settings, "job-sigstop", 1)  # mid-job: some done, some held
        os.kill(pid, signal.SIGSTOP)

    outcome = await run_job_and_wedge(
        sup, settings, s3_server.client(), bucket, "job-sigstop", wedge
    )
    assert_nothing_lost(outcome)
    assert "restarting inference-worker:inference-worker_00" in sup.logs(tail_chars=None)


async def test_a_stall_is_reported_on_healthz_and_metrics_and_the_worker_is_restarted(
    supervised, nats_server, s3_server, bucket, settings_for, tmp_path
):
    settings = settings_for(nats_server.url, nats={"max_deliver": 2})
    sup = supervised(
        WORKER_FAULTS__WEDGE_ONCE_FILE=str(tmp_path / "wedge"), WORKER_FAULTS__WEDGE_MODE="sleep"
    )

    async def wedge(_pid: int, _js) -> tuple[int, str, str]:
        # The fault hook wedges the engine thread at a batch; the HTTP thread still answers.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status, body = await asyncio.to_thread(sup.get, "/healthz")
            if status == 503:
                _, metrics = await asyncio.to_thread(sup.get, "/metrics")
                return status, body, metrics
            await asyncio.sleep(0.3)
        raise AssertionError("the stall never showed on /healthz")

    outcome = await run_job_and_wedge(sup, settings, s3_server.client(), bucket, "job-stall", wedge)
    status, body, metrics = outcome["observed"]
    assert status == 503 and body.startswith("stalled:") and "tasks held" in body
    assert "inference_worker_stalled 1.0" in metrics
    assert_nothing_lost(outcome)


async def test_a_worker_wedged_holding_the_gil_is_ended_by_its_watchdog_and_restarted(
    supervised, nats_server, s3_server, bucket, settings_for, tmp_path
):
    settings = settings_for(nats_server.url, nats={"max_deliver": 2})
    # The listener is slowed down here (100 strikes of 5 s each before it would restart
    # anything), so that the watchdog is what acts.
    sup = supervised(
        healthwatch_failures=100,
        WORKER_FAULTS__WEDGE_ONCE_FILE=str(tmp_path / "wedge"),
        WORKER_FAULTS__WEDGE_MODE="gil",
        WORKER_HEALTH__WATCHDOG_TIMEOUT_S="8",
    )

    async def wedge(_pid: int, _js) -> None:
        return None

    outcome = await run_job_and_wedge(sup, settings, s3_server.client(), bucket, "job-gil", wedge)
    assert_nothing_lost(outcome)
    log = sup.worker_log()
    assert "Timeout (0:00:08)!" in log, "faulthandler dumped the stacks"
    assert "faults.py" in log  # the wedged engine thread's stack: in the fault wrapper
    logs = sup.logs(tail_chars=None)
    assert "exit status 1" in logs, "supervisord saw the watchdog's exit"
    assert "restarting inference-worker:inference-worker_00" not in logs, "not healthwatch"
