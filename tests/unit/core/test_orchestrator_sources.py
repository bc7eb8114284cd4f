"""The orchestrator's scenarios through both sources' rules, in this process: a task ok, an
error, a redelivery, a duplicate, a drain. Once with NATS-shaped fakes (JetStream messages as
``worker.nats.delivery`` reads them, ``NatsSettler`` over fake results and dead-letter
streams, a source that redelivers what is naked, as the server does), once with the Antenna
source's own parts (``AntennaParts``) against the fake Antenna (a real HTTP server on
127.0.0.1, in this process). No process is started."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry

from config.errors import Failure
from config.settings import Settings, load_settings
from tests.antenna_fake import FakeAntenna
from tests.fakes import (
    FakeEngine,
    FakeJetStream,
    FakeMsg,
    FakeSource,
    FakeStore,
    model_of,
    nats_settler,
)
from tests.fakes import task_msg as nats_task
from worker.antenna.parts import AntennaParts
from worker.core.link import SourceLink
from worker.core.orchestrator import Orchestrator, Services
from worker.health.liveness import Liveness
from worker.health.metrics import Metrics
from worker.process.slices import core_settings

BATCH = 2
TOKEN = "orchestrator-token-9f2c"
SLUG = "moths"
URL = "http://127.0.0.1:1/{}.jpg"  # never read: the fake engine loads nothing
WAIT_S = 20.0  # bound of every wait below (a quiet run takes well under a second)


def settings_for(**antenna: Any) -> Settings:
    return load_settings(
        for_worker=False,
        nats={"fetch_timeout_s": 0.05, "store_retry_s": 0.0, "nak_backoff_base_s": 0.01},
        loader={"batch_size": BATCH, "prefetch_batches": 2},
        health={"watchdog_timeout_s": 0, "drain_timeout_s": 5},
        antenna={
            "ttr_s": 0.5,
            "poll_interval_s": 0.05,
            "fetch_wait_s": 0.05,
            "token": TOKEN,
            "reservation_size": 2 * BATCH,  # the stop test holds two batches
            **antenna,
        },
    )


class RedeliveringSource(FakeSource):
    """As the server does: a naked message comes back, one delivery later, while it may."""

    def __init__(self) -> None:
        super().__init__()
        self.out: list[FakeMsg] = []

    async def fetch(self, batch: int, runnable: Any = None, available: Any = None) -> Any:
        for msg in [m for m in self.out if m.actions[-1:] == ["nak"]]:
            self.out.remove(msg)
            if msg.delivered < self.max_deliver:
                self.msgs.append(
                    FakeMsg(msg.delivered + 1, msg.seq, msg.data, msg.subject, msg.actions[:0])
                )
        taken = await super().fetch(batch, runnable)
        self.out += [d.handle.msg for d in taken]  # type: ignore[misc]
        return taken


class NatsRig:
    """The NATS source's rules over in-memory streams."""

    kind = "nats"

    def __init__(self) -> None:
        self.store, self.js = FakeStore(), FakeJetStream()
        self.source = RedeliveringSource()
        self.msgs: dict[str, list[FakeMsg]] = {}

    def add(self, n: int) -> list[str]:
        names = [f"t{len(self.msgs) + i}" for i in range(n)]
        for name in names:
            msg = nats_task(name, url=URL.format(name), subject=f"tasks.{SLUG}")
            self.source.msgs.append(msg)
        return names

    def link(self, s: Settings, metrics: Metrics) -> SourceLink:
        settler = nats_settler(self.store, self.js, default_pipeline=SLUG)
        return SourceLink(
            "nats",
            self.source,
            self.store,
            settler,
            0.05,
            5.0,
            backoff=settler.backoff,
            model_of=model_of,
        )

    def kept(self) -> dict[str, str]:
        """Task -> the status of the result kept for it."""
        return {r["task_id"]: r["status"] for r in self.store.stored}

    def deliveries(self, name: str) -> int:
        return max(r["attempt"] for r in self.store.stored if r["task_id"] == name)

    def already_kept(self, name: str) -> None:
        self.store.stored.append({"task_id": name, "job_id": "j", "status": "ok", "attempt": 1})

    def given_back(self) -> set[str]:
        return {json.loads(m.data)["id"] for m in self.source.out if m.actions == ["nak"]}

    def close(self) -> None:
        pass


class AntennaRig:
    """The Antenna source's parts against the fake Antenna."""

    kind = "antenna"

    def __init__(self) -> None:
        from tests.unit.antenna.test_source import SERVED

        self.fake = FakeAntenna(token=TOKEN, ttr_s=0.5)
        self.fake.register_direct(1, SERVED.config())
        self._running = self.fake.running()
        self._running.__enter__()
        self.job = 0
        self.served = SERVED
        self.ttr_s = 0.5

    def reserve_for(self, ttr_s: float) -> None:
        """Reservations of ``ttr_s``, on both sides."""
        self.ttr_s = self.fake.ttr_s = ttr_s

    def add(self, n: int) -> list[str]:
        """A job of ``n`` images (once per test)."""
        names = [f"i{i}" for i in range(n)]
        self.job = self.fake.add_job(SLUG, [(name, URL.format(name)) for name in names])
        return names

    def link(self, s: Settings, metrics: Metrics) -> SourceLink:
        served = SimpleNamespace(names=[SLUG], loaded=lambda _p: None)
        settings = settings_for(base_url=self.fake.url, ttr_s=self.ttr_s)
        self.parts = AntennaParts(settings, served, {}, metrics)  # type: ignore[arg-type]
        self.parts.catalog.add(self.served)
        return self.parts.link

    def kept(self) -> dict[str, str]:
        job = self.fake.jobs[self.job]
        return {i: "error" if i in job.failed else "ok" for i in job.done | job.failed}

    def deliveries(self, name: str) -> int:
        return self.fake.jobs[self.job].tasks[name].delivered

    def saved(self, name: str) -> int:
        return len(self.fake.jobs[self.job].saved.get(name, []))

    def given_back(self) -> set[str]:
        return set()  # Antenna has no nak: a stop finishes what it holds (finish_held_on_stop)

    def close(self) -> None:
        if hasattr(self, "parts"):
            self.parts.client.close()
        self._running.__exit__(None, None, None)


@pytest.fixture(params=["nats", "antenna"])
def rig(request: pytest.FixtureRequest) -> Iterator[Any]:
    made = NatsRig() if request.param == "nats" else AntennaRig()
    yield made
    made.close()


def antenna_detections() -> list[dict[str, Any]]:
    """What the engine finds in each image: one box, classified (the served pipeline's keys)."""
    from tests.unit.antenna.test_source import outcome

    return list(outcome().detections or [])


def a_worker(rig: Any, engine: FakeEngine) -> Orchestrator:
    s = settings_for()
    liveness = Liveness(s.health.stall_timeout_s)
    metrics = Metrics(CollectorRegistry(), liveness, rig.kind)
    engine.found = antenna_detections()
    services = Services(
        link=rig.link(s, metrics),
        engine=engine,
        engine_thread=ThreadPoolExecutor(1),
        liveness=liveness,
        metrics=metrics,
    )
    return Orchestrator(core_settings(s, 3 * 224 * 224), services)


async def until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"not within {WAIT_S:g}s: {what}"
        await asyncio.sleep(0.02)


async def run_until(worker: Orchestrator, done: Callable[[], bool], what: str) -> Any:
    """Run ``worker`` until ``done``, then stop it (SIGTERM's way) and return its exit."""
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        await until(lambda: done() or running.done(), what)
    finally:
        stop.set()
    return await asyncio.wait_for(running, WAIT_S)


async def test_every_task_ends_with_its_result_kept_once(rig: Any) -> None:
    names = rig.add(5)
    exit = await run_until(a_worker(rig, FakeEngine()), lambda: len(rig.kept()) == 5, "5 results")
    assert exit.code == 0
    assert rig.kept() == dict.fromkeys(names, "ok")


async def test_each_task_done_line_names_its_task_and_source_at_its_status_level(
    rig: Any,
) -> None:
    """The one ``task_done`` line per kept result, the same for both sources (docs/metrics.md,
    "Logs"): INFO when ok, WARNING when not, its task's ids and its source."""
    bad, good = rig.add(2)
    engine = FakeEngine(failures={URL.format(bad): Failure("object_missing", "no such key")})
    with structlog.testing.capture_logs() as logs:
        await run_until(a_worker(rig, engine), lambda: len(rig.kept()) == 2, "2 results")
    done = {e["task_id"]: e for e in logs if e["event"] == "task_done"}
    assert set(done) == {bad, good}
    assert (done[good]["log_level"], done[good]["status"]) == ("info", "ok")
    assert (done[bad]["log_level"], done[bad]["status"]) == ("warning", "error")
    assert {e["source"] for e in done.values()} == {rig.kind}
    assert all(e["job_id"] and e["image_id"] and e["attempt"] == 1 for e in done.values())


async def test_a_permanent_failure_ends_with_an_error_result_and_the_rest_are_ok(rig: Any) -> None:
    bad, *good = rig.add(3)
    engine = FakeEngine(failures={URL.format(bad): Failure("object_missing", "no such key")})
    await run_until(a_worker(rig, engine), lambda: len(rig.kept()) == 3, "3 results")
    assert rig.kept() == {bad: "error", **dict.fromkeys(good, "ok")}


async def test_a_transient_failure_is_delivered_again_and_then_ok(rig: Any) -> None:
    flaky, fine = rig.add(2)
    engine = FakeEngine(fail_once={URL.format(flaky): Failure("s3_unavailable", "503", True)})
    worker = a_worker(rig, engine)
    await run_until(worker, lambda: rig.kept().get(flaky) == "ok", "the flaky task's redelivery")
    assert rig.kept() == {flaky: "ok", fine: "ok"}
    assert rig.deliveries(flaky) == 2 and rig.deliveries(fine) == 1


class GatedEngine(FakeEngine):
    """The first batch waits for ``release`` (bounded): its tasks stay held meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def run_batch(self, keys: Any, pipeline: str = "") -> Any:
        if not self.entered.is_set():
            self.entered.set()
            if not self.release.wait(WAIT_S):
                raise TimeoutError("the test never released the first batch")
        return super().run_batch(keys, pipeline)


async def test_a_task_delivered_again_after_its_result_was_kept_keeps_one_result(
    rig: Any,
) -> None:
    if isinstance(rig, NatsRig):
        # Its ack was lost: the result is in the store, and the server delivers it again.
        (name,) = rig.add(1)
        rig.already_kept(name)
        engine = FakeEngine()
        await run_until(a_worker(rig, engine), lambda: rig.source.out != [], "the delivery")
        await until(lambda: rig.source.out[0].actions == ["ack"], "the ack")
        assert engine.batches == [] and len(rig.store.stored) == 1
        return
    # Antenna: the answer to the result's post is cut, so the poster sends the identical body
    # again; Antenna keeps the image's result once.
    rig.reserve_for(10.0)  # the post is tried again within the reservation
    (name,) = rig.add(1)
    rig.fake.misbehave("result", "cut", times=1)
    await run_until(a_worker(rig, FakeEngine()), lambda: len(rig.fake.bodies) == 2, "a second post")
    assert len(rig.fake.bodies) == 2 and rig.fake.bodies[0] == rig.fake.bodies[1]
    assert rig.kept() == {name: "ok"} and rig.saved(name) == 1


async def test_a_stop_finishes_the_batch_in_hand_and_loses_nothing_held(rig: Any) -> None:
    names = rig.add(2 * BATCH)
    engine = GatedEngine()
    worker = a_worker(rig, engine)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    await until(lambda: len(worker.claims) == 2 * BATCH, "every task held")
    stop.set()  # while the first batch is in the engine
    engine.release.set()
    exit = await asyncio.wait_for(running, WAIT_S)
    assert exit.code == 0 and len(worker.claims) == 0
    kept, given_back = set(rig.kept()), rig.given_back()
    assert kept | given_back == set(names) and not kept & given_back
    assert len(kept) >= BATCH  # the batch in hand at the stop was finished


async def test_a_job_cancelled_mid_batch_has_its_held_tasks_dropped_before_they_run() -> None:
    """Antenna: a job cancelled while its first batch is on the engine. That batch ends (its
    results posted: Antenna ignores them); the tasks still held of the job are dropped before
    they run, nothing posted for them, each said in a line and counted."""
    rig = AntennaRig()
    try:
        names = rig.add(2 * BATCH)
        engine = GatedEngine()
        worker = a_worker(rig, engine)
        stop = asyncio.Event()
        with structlog.testing.capture_logs() as logs:
            running = asyncio.create_task(worker.run(stop))
            await until(
                lambda: len(worker.claims) == 2 * BATCH and engine.entered.is_set(),
                "every task held, the first batch on the engine",
            )
            rig.fake.jobs[rig.job].status = "CANCELING"  # as Antenna's cancel does
            await until(lambda: len(worker.claims) == BATCH, "the waiting tasks dropped")
            engine.release.set()
            await until(lambda: len(worker.claims) == 0, "the batch in hand settled")
            stop.set()
            exit = await asyncio.wait_for(running, WAIT_S)
        counted = worker.services.metrics.registry.get_sample_value(
            "inference_worker_tasks_dropped_total", {"reason": "job_inactive"}
        )
    finally:
        rig.close()
    assert exit.code == 0
    assert len(engine.batches) == 1, "only the batch in hand ran"
    dropped = {e["image_id"] for e in logs if e["event"] == "task_dropped_job_inactive"}
    ran = {e["image_id"] for e in logs if e["event"] == "task_done"}
    assert len(dropped) == BATCH and len(ran) == BATCH
    assert dropped | ran == set(names) and not dropped & ran
    # Only the batch in hand's results were posted (Antenna ignores them): none for the rest.
    posted = sum(len(json.loads(body)["results"]) for body in rig.fake.bodies)
    assert posted == BATCH
    assert counted == BATCH
