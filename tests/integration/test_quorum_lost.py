"""A JetStream cluster that lost its quorum, against three real nats-server processes: the node
left answers pings, so the connection is up, yet no fetch, store or consumer info can succeed.
The worker says so on /readyz (a load balancer, alert or autoscaler can tell), stays live (a
restart mends nothing), and is ready again once the nodes return, nothing lost."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from tests.chaos.servers import NatsCluster
from tests.helpers import client, http_answer, running_worker, submit, upload_images, wait_results
from worker.commands.localservers import free_port

pytestmark = pytest.mark.integration
DISCONNECTED_TIMEOUT_S = 5.0
SAID_MARGIN_S = 45.0  # the node left may answer some requests until its leaders step down
BACK_WITHIN_S = 60.0  # the nodes restart, elect leaders, and one request succeeds
TASKS = 16


def _get(url: str) -> tuple[int, str]:
    try:
        return http_answer(url)
    except OSError as error:  # nothing answered: not a status
        return 0, str(error)


async def _readyz_until(port: int, status: int, within_s: float) -> str:
    """Until /readyz answers ``status``; /livez answers 200 at every look meanwhile."""
    deadline = time.monotonic() + within_s
    while True:
        code, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/readyz")
        live, why = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/livez")
        assert live == 200, f"/livez answered {live}: {why.strip()}"
        if code == status:
            return body
        assert time.monotonic() < deadline, f"after {within_s}s /readyz is {code}: {body.strip()}"
        await asyncio.sleep(0.5)


async def _cluster_serving(settings, within_s: float = 30.0) -> None:
    """Until the cluster's JetStream answers (a meta leader elected)."""
    deadline = time.monotonic() + within_s
    async with client(settings) as js:
        while True:
            try:
                await js.account_info()
                return
            except (TimeoutError, nats.errors.Error):
                assert time.monotonic() < deadline, "the cluster's JetStream never answered"
                await asyncio.sleep(0.5)


async def _all_results(settings, tasks: list, within_s: float = 90.0) -> list:
    """The job's results once all are stored, asked again while the streams elect leaders."""
    deadline = time.monotonic() + within_s
    async with client(settings) as js:
        while True:
            try:
                return await wait_results(js, settings, "job-quorum", len(tasks), timeout_s=5)
            except (AssertionError, nats.errors.Error):
                assert time.monotonic() < deadline, "the job's results were never all stored"


async def test_a_jetstream_that_lost_its_quorum_is_not_ready_then_ready_again(
    s3_server, bucket, settings_for
):
    # Given a worker connected to node n0 of a three-node cluster, streams in three replicas
    cluster = NatsCluster().start()
    port = free_port()
    try:
        settings = settings_for(
            cluster.urls(0),
            # A nak sent while the job consumer has no leader is lost with it: that task comes
            # back after its ack wait (the documented recovery), kept short here (the stall
            # timeout and the watchdog below it, as the settings' rules require).
            nats={"replicas": 3, "ack_wait_s": 40},
            health={
                "disconnected_timeout_s": DISCONNECTED_TIMEOUT_S,
                "stall_timeout_s": 30,
                "watchdog_timeout_s": 35,
            },
            metrics={"port": port},
        )
        await _cluster_serving(settings)
        images = upload_images(s3_server.client(), bucket, TASKS, prefix="quorum")
        async with running_worker(settings):
            await _readyz_until(port, 200, 60)
            async with client(settings) as js:
                tasks = await submit(js, settings, "job-quorum", images)
                await wait_results(js, settings, "job-quorum", 1, timeout_s=60)
            # When two of the three nodes die: n0 still answers pings, JetStream nothing
            cluster.kill_node(1)
            cluster.kill_node(2)
            lost_at = time.monotonic()
            # Then /readyz answers 503 naming JetStream, /livez 200 throughout
            body = await _readyz_until(port, 503, DISCONNECTED_TIMEOUT_S + SAID_MARGIN_S)
            print(f"said after {time.monotonic() - lost_at:.1f} s: {body.strip()}")
            assert "JetStream" in body, body
            # And once the nodes return, ready again, every task's result stored once
            cluster.start_node(1)
            cluster.start_node(2)
            await _readyz_until(port, 200, BACK_WITHIN_S)
            results = await _all_results(settings, tasks)
            assert sorted(r["task_id"] for r in results) == sorted(t.id for t in tasks)
    finally:
        cluster.stop()
