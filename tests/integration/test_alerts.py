"""The stall alert, proven with a real Prometheus: it scrapes three real workers on 127.0.0.1
with the project's alert rules, and the page goes pending then firing for the wedged worker
only; never for an idle worker nor for one recovering in-process from a loader fault. A
worker whose job consumer a real nats-server refuses raises that cause's alert alone.

The rules are deploy/prometheus/alerts.yml as they are, but for their ``for:`` durations,
shortened to seconds so CI does not wait minutes; scrape and evaluation every second."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from testing.prometheus import PrometheusServer
from tests.conftest import _unavailable
from tests.helpers import (
    client,
    running_worker,
    submit,
    upload_images,
    wait_http,
    wait_results,
    worker_env,
    worker_process,
)
from tests.integration.test_job_consumers import fill_consumers, limited_nats, small_images
from worker.commands.client import make_tasks, publish_tasks
from worker.commands.localservers import NatsServer, ServerNotFound, free_port

pytestmark = pytest.mark.integration

ALERT = "InferenceWorkerStalled"
# The rule's `for: 1m` after the 12 s stall timeout and Prometheus's evaluation: firing about
# 75 s after the job is submitted; the loop ends as soon as it fires.
WATCH_S = 150.0


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@contextmanager
def prometheus(tmp_path: Path, targets: list[str]):
    """A real Prometheus scraping ``targets``; the rules' ``for:`` shortened to 4 s."""
    server = PrometheusServer(tmp_path / "prometheus", targets, rule_for="4s")
    try:
        server.start()
    except ServerNotFound as error:
        _unavailable("prometheus", error)
    try:
        yield server.url
    finally:
        server.stop()


def _query(url: str, expr: str) -> list[dict]:
    found = _get(f"{url}/api/v1/query?query={urllib.parse.quote(expr)}")
    return found["data"]["result"]


@pytest.mark.timeout(300)  # 93 s quiet (2026-12-03): the suite's 180 s is under twice that
async def test_the_stall_page_fires_for_a_wedged_worker_only(
    s3_server, bucket, settings_for, tmp_path
):
    quick = {
        "WORKER_LOADER__TIMEOUT_S": "4",
        "WORKER_S3__CONNECT_TIMEOUT_S": "0.5",
        "WORKER_S3__READ_TIMEOUT_S": "1",
        "WORKER_S3__MAX_ATTEMPTS": "2",
        "WORKER_HEALTH__STALL_TIMEOUT_S": "12",  # three times the loader timeout: a margin
        "WORKER_HEALTH__WATCHDOG_TIMEOUT_S": "0",
    }
    faults = {
        "wedged": {
            "WORKER_FAULTS__WEDGE_ONCE_FILE": str(tmp_path / "wedge"),
            "WORKER_FAULTS__WEDGE_MODE": "sleep",
        },
        "idle": {},
        "recovering": {"WORKER_FAULTS__DROP_ONCE_FILE": str(tmp_path / "drop")},
    }
    settings, ports, envs = {}, {}, {}
    uris = upload_images(s3_server.client(), bucket, 6)

    with ExitStack() as stack:
        for name in faults:  # a server each: the three workers' streams share their subjects
            server = NatsServer(store_dir=str(tmp_path / f"nats-{name}")).start()
            stack.callback(server.stop)
            settings[name] = settings_for(server.url)
            ports[name] = free_port()
            envs[name] = worker_env(
                settings[name], WORKER_METRICS__PORT=str(ports[name]), **quick, **faults[name]
            )
        instance = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
        procs = {
            name: stack.enter_context(worker_process(envs[name], tmp_path / f"{name}.log"))
            for name in faults
        }
        for name, proc in procs.items():
            wait_http(f"http://{instance[name]}/healthz", proc, tmp_path / f"{name}.log")
        url = stack.enter_context(prometheus(tmp_path, list(instance.values())))
        deadline = time.monotonic() + 30
        while len([r for r in _query(url, "up == 1")]) < 3:
            assert time.monotonic() < deadline, "Prometheus did not scrape all three workers"
            await asyncio.sleep(0.5)

        for name in ("wedged", "recovering"):
            async with client(settings[name]) as js:
                await submit(js, settings[name], f"job-{name}", uris)

        states: dict[str, list[str]] = defaultdict(list)
        recovered = False
        deadline = time.monotonic() + WATCH_S
        while time.monotonic() < deadline:
            for alert in _get(f"{url}/api/v1/alerts")["data"]["alerts"]:
                if alert["labels"]["alertname"] == ALERT:
                    seen = states[alert["labels"]["instance"]]
                    if not seen or seen[-1] != alert["state"]:
                        seen.append(alert["state"])
            if not recovered:
                async with client(settings["recovering"]) as js:
                    try:
                        await wait_results(js, settings["recovering"], "job-recovering", 6, 0.1)
                        recovered = True
                    except AssertionError:
                        pass
            if recovered and states[instance["wedged"]][-1:] == ["firing"]:
                break
            await asyncio.sleep(0.5)
        restarts = _query(url, "inference_worker_loader_restarts_total")

    assert recovered, "the recovering worker did not finish its job"
    by_instance = {r["metric"]["instance"]: float(r["value"][1]) for r in restarts}
    assert by_instance[instance["recovering"]] >= 1, "the loader fault happened and was recovered"
    assert states[instance["wedged"]] == ["pending", "firing"]
    assert instance["idle"] not in states and instance["recovering"] not in states, dict(states)


REFUSED = "InferenceWorkerJobConsumersRefused"


@pytest.mark.timeout(240)
async def test_a_refused_job_consumer_warns_as_such_and_never_as_a_stall_or_not_ready(
    s3_server, bucket, settings_for, tmp_path
):
    port = free_port()
    uris = small_images(s3_server.client(), bucket, 2)
    states: dict[str, list[str]] = defaultdict(list)
    with limited_nats(tmp_path) as url:
        settings = settings_for(
            url,
            nats={"job_discovery_s": 0.2, "job_consumer_linger_s": 300},
            metrics={"port": port},
        )
        n, pipeline = settings.nats, settings.model.pipeline
        async with running_worker(settings), client(settings) as js:
            with prometheus(tmp_path, [f"127.0.0.1:{port}"]) as prom:
                # Given a worker Prometheus has scraped, then another client's consumers
                # filling the server's limit
                deadline = time.monotonic() + 30
                expr = "inference_worker_job_consumers_refused_total == 0"
                while not await asyncio.to_thread(_query, prom, expr):
                    assert time.monotonic() < deadline, "Prometheus did not scrape the worker"
                    await asyncio.sleep(0.5)
                other, _ = await fill_consumers(url, n.tasks_stream)
                try:
                    # When a job comes, its consumer refused
                    await publish_tasks(js, n, pipeline, make_tasks("job-refused", uris))
                    deadline = time.monotonic() + 90
                    while states[REFUSED][-1:] != ["firing"]:
                        assert time.monotonic() < deadline, dict(states)
                        found = await asyncio.to_thread(_get, f"{prom}/api/v1/alerts")
                        for alert in found["data"]["alerts"]:
                            seen = states[alert["labels"]["alertname"]]
                            if not seen or seen[-1] != alert["state"]:
                                seen.append(alert["state"])
                        await asyncio.sleep(0.5)
                    ready = await asyncio.to_thread(_query, prom, "inference_worker_ready")
                    refused = await asyncio.to_thread(
                        _query, prom, "inference_worker_job_consumers_refused_total"
                    )
                finally:
                    await other.close()
    # Then its own alert fires, not the stall's nor the catch-all's, and the worker says it
    # is not ready
    assert states[REFUSED] == ["pending", "firing"], dict(states)
    assert set(states) == {REFUSED}, dict(states)
    assert [float(r["value"][1]) for r in ready] == [0.0]
    assert float(refused[0]["value"][1]) > 1  # retried, and counted, at every discovery
