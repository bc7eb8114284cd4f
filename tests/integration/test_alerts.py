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

from config.errors import ServerNotFound
from testing.prometheus import PrometheusServer
from tests.conftest import _unavailable
from tests.helpers import (
    client,
    publish_raw,
    running_worker,
    submit,
    upload_images,
    wait_http,
    wait_results,
    worker_env,
    worker_process,
)
from tests.integration.test_job_consumers import fill_consumers, limited_nats, small_images
from worker.commands.job_client import make_tasks, publish_tasks
from worker.commands.localservers import NatsServer, free_port

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


NOT_CONSUMING = "InferenceWorkerAliveButNotConsuming"
READ_S = 1.0  # WORKER_METRICS__TASKS_WAITING_READ_S here


def _waiting(port: int) -> float | None:
    """inference_worker_tasks_waiting summed over pipelines, as the worker's /metrics says."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("inference_worker_tasks_waiting{")
    ]
    return sum(values) if values else None


def _states(url: str, alertname: str) -> dict[str, str]:
    return {
        alert["labels"]["instance"]: alert["state"]
        for alert in _get(f"{url}/api/v1/alerts")["data"]["alerts"]
        if alert["labels"]["alertname"] == alertname
    }


@pytest.mark.timeout(240)
async def test_alive_but_not_consuming_fires_while_its_consumer_is_paused(
    s3_server, bucket, settings_for, tmp_path
):
    """A real worker, healthy, whose consumer is paused on the server: the tasks published for
    its pipeline wait (its gauge says how many), none is served, and the warning goes pending
    then firing; resumed, the worker serves them, the gauge reads 0 and the warning ends."""
    try:
        server = NatsServer(store_dir=str(tmp_path / "nats")).start()
    except ServerNotFound as error:
        _unavailable("nats-server", error)
    uris = upload_images(s3_server.client(), bucket, 6)
    with ExitStack() as stack:
        stack.callback(server.stop)
        settings = settings_for(server.url)
        port = free_port()
        env = worker_env(
            settings,
            WORKER_METRICS__PORT=str(port),
            WORKER_METRICS__TASKS_WAITING_READ_S=str(READ_S),
            WORKER_HEALTH__WATCHDOG_TIMEOUT_S="0",
        )
        proc = stack.enter_context(worker_process(env, tmp_path / "worker.log"))
        wait_http(f"http://127.0.0.1:{port}/healthz", proc, tmp_path / "worker.log")
        n = settings.nats
        async with client(settings) as js:
            await js.pause_consumer(n.tasks_stream, n.consumer, "2099-01-01T00:00:00Z")
            await submit_shared(js, settings, "job-paused", uris)
            published = time.monotonic()
            while _waiting(port) != len(uris):
                assert time.monotonic() - published < 30, f"the gauge reads {_waiting(port)}"
                await asyncio.sleep(0.05)
            print(f"gauge showed the tasks {time.monotonic() - published:.2f} s after publishing")
        url = stack.enter_context(prometheus(tmp_path, [f"127.0.0.1:{port}"]))
        instance = f"127.0.0.1:{port}"
        seen: list[str] = []
        deadline = time.monotonic() + 60
        while seen[-1:] != ["firing"]:
            assert time.monotonic() < deadline, f"{NOT_CONSUMING}: {seen}"
            state = _states(url, NOT_CONSUMING).get(instance)
            if state and seen[-1:] != [state]:
                seen.append(state)
            await asyncio.sleep(0.25)
        assert seen == ["pending", "firing"]

        async with client(settings) as js:
            await js.resume_consumer(n.tasks_stream, n.consumer)
            await wait_results(js, settings, "job-paused", len(uris), 60)
        deadline = time.monotonic() + 30
        while _states(url, NOT_CONSUMING) or _waiting(port) != 0:
            assert time.monotonic() < deadline, (_states(url, NOT_CONSUMING), _waiting(port))
            await asyncio.sleep(0.25)


async def submit_shared(js, settings, job_id: str, uris: list[str]) -> None:
    """Tasks with the job in the payload, on ``tasks.<pipeline>``: the shared consumer's."""
    from worker.commands.job_client import make_tasks

    for task in make_tasks(job_id, uris):
        await publish_raw(js, settings, task.as_dict())
