"""A device that fails for good, through the orchestrator and each source's own rules, in this
process: the real engine, its model behind the fault hook that raises torch's real sticky
error at a chosen batch. The process's answer: exit 7, one ``device_failed`` line, /healthz
503 ``restart``, every held task given back (NATS: naked; Antenna: left unposted to its
redelivery), nothing stored as failed; a second worker then serves what was given back."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry

from config.settings import load_settings
from tests.unit.core.test_orchestrator_sources import (
    WAIT_S,
    AntennaRig,
    NatsRig,
    antenna_detections,
    run_until,
    settings_for,
    until,
)
from tests.unit.engine.test_sticky_device_errors import Loader, Models
from worker.commands.localservers import free_port
from worker.core.exits import ExitReason
from worker.core.orchestrator import Orchestrator, Services
from worker.engine import Engine
from worker.engine.faults import DeviceFaultModels, sticky_cuda_error
from worker.engine.predictors import OneModel
from worker.health.compose import ProcessHealth
from worker.health.liveness import Liveness
from worker.health.metrics import Metrics
from worker.process.slices import core_settings

BATCHES = 3  # of BATCH (2) tasks each


class Finds:
    """A pipeline that finds one classified box in every image (what Antenna can keep)."""

    copy_ahead_images = 0

    def __init__(self) -> None:
        self.images = 0

    def copy_ahead(self, images: Any) -> list[Any]:
        return list(images)

    def run(self, images: Any, while_running: Any = None) -> list[list[dict[str, Any]]]:
        self.images += len(images)
        return [antenna_detections() for _ in images]


class FailsWhenReleased(Finds):
    """Its first batch waits for ``release``, then the device fails under it."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def run(self, images: Any, while_running: Any = None) -> list[list[dict[str, Any]]]:
        self.entered.set()
        if not self.release.wait(WAIT_S):
            raise TimeoutError("the test never released the batch")
        raise sticky_cuda_error("accelerator")


@pytest.fixture(params=["nats", "antenna"])
def rig(request: pytest.FixtureRequest) -> Iterator[Any]:
    made = NatsRig() if request.param == "nats" else AntennaRig()
    if isinstance(made, AntennaRig):
        made.reserve_for(60.0)  # nothing comes back by itself while the test looks
    yield made
    made.close()


def a_worker(rig: Any, models: Any) -> Orchestrator:
    s = settings_for()
    liveness = Liveness(s.health.stall_timeout_s)
    metrics = Metrics(CollectorRegistry(), liveness, rig.kind)
    services = Services(
        link=rig.link(s, metrics),
        engine=Engine(Loader(), models=models),  # type: ignore[arg-type]
        engine_thread=ThreadPoolExecutor(1),
        liveness=liveness,
        metrics=metrics,
    )
    return Orchestrator(core_settings(s, 3 * 224 * 224), services)


def served_elsewhere(rig: Any) -> None:
    """What the failed process gave back becomes deliverable to the next one: NATS redelivers
    a naked task at once; Antenna once its reservation runs out (made to run out now)."""
    if isinstance(rig, AntennaRig):
        rig.parts.client.close()  # the failed process's connections go with it
        rig.fake.expire_reservations()


def fetched(rig: Any, names: list[str]) -> set[str]:
    """Tasks the process took from its source (the rest it never held)."""
    if isinstance(rig, NatsRig):
        return {json.loads(msg.data)["id"] for msg in rig.source.out}
    job = rig.fake.jobs[rig.job]
    return {name for name in names if job.tasks[name].delivered > 0}


def given_back(rig: Any, names: list[str]) -> set[str]:
    """Tasks the failed process handed back without a result: naked (NATS), or reserved
    once and left to redelivery, unposted (Antenna)."""
    if isinstance(rig, NatsRig):
        return rig.given_back()
    job = rig.fake.jobs[rig.job]
    return {
        name
        for name in names
        if name not in job.done | job.failed
        and job.tasks[name].delivered == 1
        and rig.saved(name) == 0
    }


async def test_a_device_failure_gives_back_every_held_task_exits_7_and_another_worker_serves_them(
    rig: Any, tmp_path: Any
) -> None:
    names = rig.add(BATCHES * 2)
    finds = Finds()
    faulty = DeviceFaultModels(OneModel(finds), str(tmp_path / "fault"), 2, "accelerator")
    failing = a_worker(rig, faulty)

    with structlog.testing.capture_logs() as logs:
        exit = await asyncio.wait_for(failing.run(asyncio.Event()), WAIT_S)

    assert (exit.reason, exit.code) == (ExitReason.DEVICE_FAILED, 7)
    lines = [line for line in logs if line["event"] == "device_failed"]
    assert len(lines) == 1 and lines[0]["log_level"] == "error"
    assert "AcceleratorError: CUDA error: an illegal memory access" in lines[0]["error"]
    assert lines[0]["device"] == "auto" and lines[0]["exit_code"] == 7
    assert not [line for line in logs if line["event"] == "inference_failed"]
    assert "device auto failed" in (failing.services.liveness.restart_reason() or "")
    assert len(failing.claims) == 0 and finds.images == 2, "only the first batch ran"
    first = set(rig.kept())
    assert set(rig.kept().values()) == {"ok"} and len(first) == 2, "the first batch's results"
    back = given_back(rig, names)
    assert len(back) >= 2 and back == fetched(rig, names) - first, "every other held task"

    served_elsewhere(rig)
    exit = await run_until(
        a_worker(rig, OneModel(Finds())), lambda: len(rig.kept()) == len(names), "all served"
    )

    assert exit.code == 0
    assert rig.kept() == dict.fromkeys(names, "ok"), "exactly one result each, none failed"
    assert {rig.deliveries(name) for name in back} == {2}, "one delivery used, no more"
    assert {rig.deliveries(name) for name in set(names) - back} == {1}


async def test_a_device_failure_during_a_drain_still_exits_7_and_gives_back_the_batch_in_hand(
    rig: Any,
) -> None:
    names = rig.add(BATCHES * 2)
    pipeline = FailsWhenReleased()
    worker = a_worker(rig, OneModel(pipeline))
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        running = asyncio.create_task(worker.run(stop))
        await until(pipeline.entered.is_set, "the first batch in the engine")
        stop.set()  # SIGTERM's drain, while the batch is on the device
        await asyncio.sleep(0.1)
        pipeline.release.set()
        exit = await asyncio.wait_for(running, WAIT_S)

    assert (exit.reason, exit.code) == (ExitReason.DEVICE_FAILED, 7)
    assert [line["event"] for line in logs].count("device_failed") == 1
    assert pipeline.images == 0 and len(worker.claims) == 0
    assert rig.kept() == {}, "nothing stored, nothing failed"
    held = fetched(rig, names)
    assert len(held) >= 2 and given_back(rig, names) == held, "the batch in hand too"


async def test_a_model_load_that_the_device_fails_under_ends_the_process_the_same_way(
    rig: Any,
) -> None:
    names = rig.add(2)
    models = Models(Finds())  # not loaded yet: the first batch loads it, and the device fails
    models.load_error = sticky_cuda_error("runtime")
    with structlog.testing.capture_logs() as logs:
        exit = await asyncio.wait_for(a_worker(rig, models).run(asyncio.Event()), WAIT_S)

    assert (exit.reason, exit.code) == (ExitReason.DEVICE_FAILED, 7)
    assert [line["event"] for line in logs].count("device_failed") == 1
    assert rig.kept() == {}, "no model_load_failed result: the pipeline is not to blame"
    assert given_back(rig, names) == fetched(rig, names) == set(names)


def healthz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return answer.status, answer.read().decode().strip()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode().strip()


def test_healthz_answers_503_restart_once_the_device_failed_over_any_other_answer():
    settings = load_settings(for_worker=False, metrics={"port": free_port()})
    health = ProcessHealth(settings)
    liveness = Liveness(stall_timeout_s=30.0)
    health.listen()
    try:
        health.serve(liveness, lambda: "nats: down")
        assert healthz(health.port) == (503, "nats: down")  # readiness's problem, as before
        liveness.must_restart("device cuda:0 failed: AcceleratorError: CUDA error: ...")
        liveness.must_restart("a later reason")  # the first one stays

        status, body = healthz(health.port)
    finally:
        health.close()

    assert status == 503
    assert body == "restart: device cuda:0 failed: AcceleratorError: CUDA error: ..."
