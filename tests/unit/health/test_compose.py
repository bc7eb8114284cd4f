"""What the process's probes answer (worker/health/compose.py): ``/livez`` only what a restart
mends (starting, a failed device, a stall), ``/readyz`` that and the task source's problem,
``/healthz`` as ``/readyz``; alike on the /metrics listener and on healthwatch's loopback one."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from config.settings import load_settings
from worker.commands.localservers import free_port
from worker.health.compose import ProcessHealth
from worker.health.liveness import Liveness

PROBES = ("/livez", "/readyz", "/healthz")
REFUSED = (
    "NATS refused a job consumer on stream TASKS: maximum consumers limit reached "
    "(code 10026); new jobs wait for room"
)


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode().strip()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode().strip()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def health() -> Iterator[ProcessHealth]:
    settings = load_settings(
        for_worker=False, metrics={"port": free_port(), "healthz_port": free_port()}
    )
    health = ProcessHealth(settings)
    health.listen()
    yield health
    health.close()


def answers(health: ProcessHealth) -> dict[str, tuple[int, str]]:
    """Each probe's answer, the same on both listeners (asserted)."""
    found = {path: get(health.port, path) for path in PROBES}
    assert {path: get(health.healthz_port, path) for path in PROBES} == found
    return found


def ready_gauge(health: ProcessHealth) -> float:
    _, text = get(health.port, "/metrics")
    found = re.search(r"^inference_worker_ready (\S+)$", text, re.M)
    assert found, text
    return float(found.group(1))


def test_the_source_refusing_makes_the_worker_unready_and_never_unlive(health):
    problem: list[str | None] = [None]
    # Until it serves, every probe says starting
    starting = (503, "starting: not serving tasks yet")
    assert answers(health) == dict.fromkeys(PROBES, starting)
    health.serve(Liveness(stall_timeout_s=30.0), lambda: problem[0])
    assert answers(health) == dict.fromkeys(PROBES, (200, "ok"))
    assert ready_gauge(health) == 1.0
    # When the server refuses a job consumer: not ready (its reason), still live
    problem[0] = REFUSED
    assert answers(health) == {
        "/livez": (200, "ok"),
        "/readyz": (503, REFUSED),
        "/healthz": (503, REFUSED),
    }
    assert ready_gauge(health) == 0.0
    # And once there is room, ready again
    problem[0] = None
    assert answers(health) == dict.fromkeys(PROBES, (200, "ok"))
    assert ready_gauge(health) == 1.0


def test_a_stall_then_a_failed_device_make_the_worker_neither_live_nor_ready(health):
    clock = Clock()
    liveness = Liveness(stall_timeout_s=30.0, clock=clock)
    health.serve(liveness, lambda: REFUSED)
    liveness.set_held(3)
    clock.now += 31  # held work, no batch for longer than the stall timeout
    stalled = (503, "stalled: 3 tasks held and no work advanced for 31s (stall timeout 30s)")
    assert answers(health) == dict.fromkeys(PROBES, stalled)
    liveness.must_restart("device cuda:0 failed: AcceleratorError: CUDA error: ...")
    restart = (503, "restart: device cuda:0 failed: AcceleratorError: CUDA error: ...")
    assert answers(health) == dict.fromkeys(PROBES, restart)
    assert ready_gauge(health) == 0.0


def test_readiness_names_the_pipelines_that_cannot_be_loaded_and_fails_when_none_can(health):
    lost: dict[str, str] = {}
    health.serve(Liveness(stall_timeout_s=30.0), lambda: None, lambda: dict(lost), ("a", "b"))
    lost["b"] = "download_refused: GET https://files/b.pt: 403"
    # "a" still serves: ready, and /readyz says which pipeline cannot be had here and why
    note = (
        "ok: pipelines unavailable on this host: b (download_refused: GET https://files/b.pt: 403)"
    )
    assert answers(health) == {
        "/livez": (200, "ok"),
        "/readyz": (200, note),
        "/healthz": (200, note),
    }
    _, text = get(health.port, "/metrics")
    assert (
        'inference_worker_pipeline_unavailable{pipeline="b",reason="download_refused"} 1.0' in text
    )
    assert (
        'inference_worker_pipeline_unavailable{pipeline="a",reason="download_refused"} 0.0' in text
    )
    # Neither can be had: the worker can take no work
    lost["a"] = "over_budget: takes 9 bytes loaded"
    status, said = answers(health)["/readyz"]
    assert status == 503 and "a (over_budget: takes 9 bytes loaded)" in said and "b (" in said
    assert answers(health)["/livez"] == (200, "ok")  # no restart mends a file host
    assert ready_gauge(health) == 0.0
