"""The orchestrator with in-memory fakes of its ports: how tasks end, and how it stops."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from config.errors import Failure, LoaderGaveUp
from config.settings import load_settings
from tests.fakes import (
    FakeEngine,
    FakeJetStream,
    FakeMsg,
    FakeSource,
    FakeStore,
    model_of,
    nats_settler,
    task_msg,
)
from worker.core import batches as batches_module
from worker.core import claims as claims_module
from worker.core import drain as drain_module
from worker.core.availability import Availability
from worker.core.exits import ExitReason
from worker.core.link import SourceLink
from worker.core.orchestrator import Orchestrator, Services
from worker.health.liveness import Liveness
from worker.health.metrics import Metrics
from worker.process.slices import core_settings

BATCH = 4


def a_worker(
    source,
    engine,
    *,
    guard=None,
    closed=None,
    max_deliver=2,
    store=None,
    availability=None,
    watchdog=None,
    extends_leases=True,
):
    settings = load_settings(
        for_worker=False,
        nats={"fetch_timeout_s": 0.05, "store_retry_s": 0.0, "nak_backoff_base_s": 0.01},
        loader={"batch_size": BATCH, "prefetch_batches": 2},
        health={"watchdog_timeout_s": 0, "drain_timeout_s": 5},
        model={"pipeline": "mobilenet-v3-small-classifier"},
    )
    store, js = store or FakeStore(), FakeJetStream()
    liveness = Liveness(settings.health.stall_timeout_s, watchdog=watchdog)
    metrics = Metrics(CollectorRegistry(), liveness, pipelines=("p",))
    settler = nats_settler(store, js)
    source.max_deliver = max_deliver
    link = SourceLink(
        kind="nats",
        source=source,
        results=store,
        settler=settler,
        backoff=settler.backoff,
        model_of=model_of,
        fetch_wait_s=settings.nats.fetch_timeout_s,
        keepalive_tick_s=5.0,
        gone=closed,
        extends_leases=extends_leases,
    )
    services = Services(
        link=link,
        engine=engine,
        engine_thread=ThreadPoolExecutor(1),
        liveness=liveness,
        metrics=metrics,
        guard=guard,
        availability=availability or Availability(),
    )
    worker = Orchestrator(core_settings(settings, 3 * 224 * 224), services, until_idle=True)
    return worker, store, js, metrics


async def run(worker) -> object:
    return await asyncio.wait_for(worker.run(asyncio.Event()), 30)


async def test_every_task_is_stored_then_acked_in_batches_and_burst_mode_ends_with_0():
    msgs = [task_msg(f"t{i}") for i in range(10)]
    engine = FakeEngine()
    worker, store, _js, metrics = a_worker(FakeSource(list(msgs)), engine)

    exit = await run(worker)

    assert exit.reason is ExitReason.STOPPED and exit.code == 0
    assert sorted(r["task_id"] for r in store.stored) == sorted(f"t{i}" for i in range(10))
    assert all(m.actions == ["ack"] for m in msgs)
    assert all(len(batch) <= BATCH for batch in engine.batches)
    counted = {"outcome": "ok", "pipeline": "p"}  # the pipeline of tasks.p
    assert metrics.registry.get_sample_value("inference_worker_tasks_total", counted) == 10
    stored = {"stage": "store", "pipeline": "p"}
    assert metrics.registry.get_sample_value(
        "inference_worker_batch_duration_seconds_count", stored
    )
    assert len(worker.claims) == 0


async def test_a_transient_failure_is_retried_and_a_permanent_one_gets_an_error_result():
    flaky = task_msg("flaky", url="s3://b/flaky.jpg")
    missing = task_msg("missing", url="s3://b/missing.jpg")
    engine = FakeEngine(
        failures={
            "s3://b/flaky.jpg": Failure("s3_unavailable", "503", retryable=True),
            "s3://b/missing.jpg": Failure("object_missing", "no such key"),
        }
    )
    worker, store, _js, _m = a_worker(FakeSource([flaky, missing]), engine)

    await run(worker)

    assert flaky.actions == ["nak"] and missing.actions == ["ack"]
    (result,) = store.stored
    assert (result["task_id"], result["error"]["type"]) == ("missing", "object_missing")


async def test_a_message_that_names_no_task_is_dead_lettered_and_the_rest_run():
    junk = task_msg("x")
    junk.data = b"\xff not json"
    worker, store, js, _m = a_worker(FakeSource([junk, task_msg("fine")]), FakeEngine())

    await run(worker)

    assert junk.actions == ["term"] and len(js.published) == 1
    assert [r["task_id"] for r in store.stored] == ["fine"]


async def test_a_loader_that_gives_up_ends_the_process_with_3_and_gives_every_task_back():
    msgs = [task_msg(f"t{i}") for i in range(3)]
    engine = FakeEngine(gives_up=LoaderGaveUp("failed 3 times in a row"))
    worker, store, _js, _m = a_worker(FakeSource(list(msgs)), engine)

    exit = await run(worker)

    assert exit.reason is ExitReason.LOADER_FAILING and exit.code == 3
    assert store.stored == [] and all(m.actions == ["nak"] for m in msgs)


async def test_a_crossed_resource_limit_drains_and_ends_with_4():
    msgs = [task_msg(f"t{i}") for i in range(2)]
    worker, store, _js, _m = a_worker(
        FakeSource(list(msgs)), FakeEngine(), guard=lambda: "MAX_TREE_RSS_BYTES crossed"
    )

    exit = await run(worker)

    assert exit.reason is ExitReason.RESOURCE_LIMIT and "MAX_TREE_RSS_BYTES" in exit.detail
    assert len(store.stored) + sum(m.actions == ["nak"] for m in msgs) == 2


async def test_a_transport_closed_for_good_ends_the_process_with_5():
    closed = asyncio.Event()
    source = FakeSource([])
    worker, _store, _js, _m = a_worker(source, FakeEngine(), closed=closed)
    worker._until_idle = False  # without burst mode, only the closed transport stops it
    asyncio.get_running_loop().call_later(0.2, closed.set)

    exit = await run(worker)

    assert exit.reason is ExitReason.SOURCE_GONE and exit.code == 5


class RaisingSource(FakeSource):
    """A source with a bug: every fetch raises, so it is never idle."""

    async def fetch(
        self, batch: int, runnable: object = None, available: object = None
    ) -> list[object]:
        self.fetches += 1
        raise RuntimeError("a bug in the source")

    async def idle(self) -> bool:
        return False


async def test_a_burst_run_whose_source_keeps_raising_ends_not_served_with_6(monkeypatch):
    monkeypatch.setattr("worker.core.fetching._FIRST_FETCH_BACKOFF_S", 0.01)
    source = RaisingSource([])
    worker, store, _js, _m = a_worker(source, FakeEngine())

    exit = await run(worker)

    assert exit.reason is ExitReason.NOT_SERVED and exit.code == 6
    assert "5 fetches in a row" in exit.detail and "a bug in the source" in exit.detail
    assert source.fetches == 5 and store.stored == []


async def test_two_pipelines_never_share_a_batch_and_one_that_cannot_load_gives_its_tasks_back():
    msgs = [task_msg(f"c{i}", job_id="jc", subject="tasks.classify") for i in range(6)]
    broken = [task_msg(f"b{i}", job_id="jb", subject="tasks.broken") for i in range(3)]
    msgs += broken + [task_msg(f"d{i}", job_id="jd", subject="tasks.detect") for i in range(5)]
    engine = FakeEngine(
        load_failures={"broken": Failure("model_load_failed", "403", reason="download_refused")}
    )
    worker, store, _js, _m = a_worker(FakeSource(list(msgs)), engine)

    exit = await run(worker)

    assert exit.code == 0
    by_task = {r["task_id"]: r for r in store.stored}
    assert sorted(by_task) == sorted(f"c{i}" for i in range(6)) + sorted(f"d{i}" for i in range(5))
    assert all(r["status"] == "ok" for r in by_task.values())  # none failed for "broken"
    for msg in broken:  # given back, after the retry backoff, for another host or later
        assert msg.actions == ["nak"] and msg.nak_delays[0]
    assert not worker.availability.available("broken")
    assert worker.availability.unavailable()["broken"].reason == "download_refused"
    assert sorted(engine.loaded) == ["classify", "detect"]  # each loaded once
    ran = {engine.pipelines[key] for batch in engine.batches for key in batch}
    assert ran == {"classify", "detect"}  # FakeEngine refuses a batch that mixes pipelines


async def test_a_task_on_its_last_delivery_waits_held_until_its_pipeline_loads_again():
    last = task_msg("last", job_id="jb", subject="tasks.broken", delivered=2)
    earlier = task_msg("earlier", job_id="jb", subject="tasks.broken", delivered=1)
    engine = FakeEngine(load_failures={"broken": Failure("model_load_failed", "403")})
    availability = Availability(0.05, 0.1)  # the load retried after 0.05 s, then 0.1 s
    worker, store, _js, _m = a_worker(
        FakeSource([last, earlier]), engine, max_deliver=2, availability=availability
    )
    worker._until_idle = False
    running = asyncio.create_task(run(worker))
    for _ in range(400):  # the first load fails: "earlier" is given back, "last" kept
        if earlier.actions and not availability.available("broken"):
            break
        await asyncio.sleep(0.01)
    assert earlier.actions == ["nak"] and last.actions == [] and store.stored == []
    engine.load_failures.clear()  # the file host serves again: a background load succeeds
    for _ in range(400):
        if store.stored:
            break
        await asyncio.sleep(0.01)
    worker.endings.stop.set()
    await running
    assert [(r["task_id"], r["status"]) for r in store.stored] == [("last", "ok")]
    assert last.actions == ["ack"] and availability.available("broken")


async def test_a_task_of_an_unavailable_pipeline_is_given_back_at_admission_not_loaded_for():
    availability = Availability(first_s=60.0)
    availability.lost("broken", Failure("model_load_failed", "403", reason="download_refused"))
    broken, fine = task_msg("b", subject="tasks.broken"), task_msg("f", subject="tasks.fine")
    engine = FakeEngine()
    worker, store, _js, _m = a_worker(FakeSource([broken, fine]), engine, availability=availability)

    exit = await run(worker)

    assert exit.code == 0 and [r["task_id"] for r in store.stored] == ["f"]
    # Given back until its pipeline's next load (about 60 s), not the backoff's first 0.01 s:
    # sooner, it would come back to every host and spend its deliveries for nothing.
    assert broken.actions == ["nak"] and broken.nak_delays[0] > 30
    assert engine.loaded == ["fine"]  # no load tried for a task: the retry is the background's


async def test_a_source_that_cannot_extend_leases_gets_a_last_delivery_back_at_admission():
    # Antenna's way: holding a reservation does not extend it, so a task on its last delivery
    # of an unavailable pipeline is given back (left to redelivery), not held.
    availability = Availability(first_s=60.0)
    availability.lost("broken", Failure("model_load_failed", "403", reason="download_refused"))
    last = task_msg("last", subject="tasks.broken", delivered=2)
    engine = FakeEngine()
    worker, store, _js, _m = a_worker(
        FakeSource([last]), engine, availability=availability, extends_leases=False
    )

    exit = await run(worker)

    assert exit.code == 0 and store.stored == [] and last.actions == ["nak"]
    assert len(worker.claims) == 0 and engine.loaded == []


async def test_a_burst_run_whose_pipeline_keeps_failing_to_load_ends_6_naming_it():
    # A task on its last delivery is held while its pipeline cannot be loaded; a burst run
    # once waited on the file host for ever. After three failed loads it ends NOT_SERVED,
    # naming the pipeline and why, and the drain gives the held task back.
    last = task_msg("last", job_id="jb", subject="tasks.broken", delivered=2)
    refused = Failure("model_load_failed", "HTTP 403", reason="download_refused")
    engine = FakeEngine(load_failures={"broken": refused})
    availability = Availability(0.01, 0.02)
    worker, store, _js, _m = a_worker(
        FakeSource([last]), engine, max_deliver=2, availability=availability
    )

    exit = await asyncio.wait_for(run(worker), 30)

    assert exit.code == 6 and "broken (download_refused: HTTP 403)" in exit.detail, exit
    assert store.stored == [] and last.actions == ["nak"]  # given back, never failed here


async def test_a_source_that_cannot_be_told_of_a_retried_load_does_not_end_the_worker():
    # The background load succeeds, but telling the source (NATS: publishing the algorithms)
    # fails: said, and the pipeline is available; the worker goes on.
    availability = Availability(first_s=0.01)
    availability.lost("p", Failure("model_load_failed", "403", reason="download_refused"))
    worker, _store, _js, _m = a_worker(FakeSource([]), FakeEngine(), availability=availability)
    told: list[str] = []

    async def loaded(pipeline: str) -> None:
        told.append(pipeline)
        raise TimeoutError("publish_algorithms timed out")

    worker.preparing.loaded = loaded
    worker._until_idle = False
    running = asyncio.create_task(run(worker))
    for _ in range(400):
        if told or running.done():
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    worker.endings.stop.set()
    exit = await running
    assert told == ["p"] and availability.available("p")
    assert exit.code == 0


async def test_one_served_pipeline_whose_reload_fails_after_an_idle_unload_fails_no_task():
    first = [task_msg(f"a{i}") for i in range(2)]
    later = [task_msg(f"b{i}") for i in range(3)]
    engine = FakeEngine()
    source = FakeSource(list(first))
    worker, store, _js, _m = a_worker(source, engine, availability=Availability(60.0))
    worker._until_idle = False
    running = asyncio.create_task(run(worker))
    for _ in range(400):
        if len(store.stored) == 2:
            break
        await asyncio.sleep(0.01)
    engine.loaded.clear()  # unloaded when idle; its file host now refuses this host
    engine.load_failures["p"] = Failure("model_load_failed", "403", reason="download_refused")
    source.msgs += later
    for _ in range(400):
        if all(m.actions for m in later):
            break
        await asyncio.sleep(0.01)
    worker.endings.stop.set()
    await running

    assert [r["status"] for r in store.stored] == ["ok", "ok"]  # the first two only
    assert all(m.actions == ["nak"] for m in later)  # given back, none failed
    assert not worker.availability.available("p")


class GatedEngine(FakeEngine):
    """The first batch waits for ``release``: tasks stay held and no batch completes."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def run_batch(self, keys, pipeline=""):
        if not self.entered.is_set():
            self.entered.set()
            if not self.release.wait(10):
                raise TimeoutError("the test never released the first batch")
        return super().run_batch(keys, pipeline)


async def test_held_tasks_get_in_progress_only_once_a_batch_has_completed():
    msgs = [task_msg(f"t{i}") for i in range(2 * BATCH)]
    engine = GatedEngine()
    worker, _store, _js, _m = a_worker(FakeSource(list(msgs)), engine)
    running = asyncio.create_task(run(worker))
    await asyncio.to_thread(engine.entered.wait, 10)
    for _ in range(500):  # bounded: until the second batch is fetched and held too
        if len(worker.claims) == 2 * BATCH:
            break
        await asyncio.sleep(0.01)
    assert len(worker.claims) == 2 * BATCH, "both batches held while the first one runs"

    kept_alive_while_wedged = [m.kept_alive for m in msgs]
    engine.release.set()
    await running

    assert kept_alive_while_wedged == [0] * (2 * BATCH), "no batch done: no ack wait extended"
    first, second = engine.batches
    assert len(first) == len(second) == BATCH
    assert all(m.kept_alive == 0 for m in msgs[:BATCH]), "settled before the keep-alive"
    assert all(m.kept_alive >= 1 for m in msgs[BATCH:]), "still held when the first batch ended"


class GatedStore(FakeStore):
    """A result store whose stores wait for the test (a result post a WAN away)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.settling = 0  # stores waiting for the release

    async def store(self, result):
        self.entered.set()
        self.settling += 1
        await asyncio.wait_for(self.release.wait(), 10)
        return await super().store(result)


async def test_the_next_batches_are_fetched_while_two_are_settled_and_no_more():
    """A batch that has run holds no image: while it is settled (slowly), the room for loading
    is the whole cap again, so the loader is not idle behind a result post; two settles run at
    once, and a third batch run waits for one: the cap plus those two batches is the most held."""
    msgs = [task_msg(f"t{i}") for i in range(5 * BATCH)]
    store = GatedStore()
    worker, _store, _js, _m = a_worker(FakeSource(list(msgs)), FakeEngine(), store=store)
    running = asyncio.create_task(run(worker))
    await asyncio.wait_for(store.entered.wait(), 10)
    cap = worker.claims.max_held
    most_held = 0
    for _ in range(3000):  # bounded (30 s): until the fetch loop has filled the room it has
        most_held = max(most_held, len(worker.claims))
        if most_held >= cap + 2 * BATCH:
            break
        await asyncio.sleep(0.01)
    for _ in range(30):  # and then takes no more while the settle waits
        most_held = max(most_held, len(worker.claims))
        await asyncio.sleep(0.01)

    stores_waiting = store.settling
    store.release.set()
    await running

    assert cap == 2 * BATCH
    assert stores_waiting == 2 * BATCH, "two batches' stores in flight at once"
    assert most_held == cap + 2 * BATCH, "two settling, one run waiting for them, one to load"
    assert sorted(r["task_id"] for r in store.stored) == sorted(f"t{i}" for i in range(5 * BATCH))


class HungStore(FakeStore):
    """A results stream that never answers: every settle is still storing at the drain's end."""

    async def store(self, result: dict[str, Any]) -> bool:
        await asyncio.Event().wait()
        return True


@dataclass
class HungNakMsg(FakeMsg):
    """A nak that never returns: nats-py's forced flush on a connection to a frozen server."""

    async def nak(self, delay: float | None = None) -> None:
        await asyncio.Event().wait()


async def test_a_drain_whose_give_backs_hang_still_ends_and_names_the_tasks_left(monkeypatch):
    """The drain's time runs out while every result is being stored, and every nak hangs: the
    drain still ends (it does not wait for the watchdog or SIGKILL), and the tasks it could
    not give back are named, left for their ack wait."""
    monkeypatch.setattr(claims_module, "GIVE_BACK_WAIT_S", 0.2)
    monkeypatch.setattr(drain_module, "GIVE_BACK_WAIT_S", 0.2)
    monkeypatch.setattr(drain_module, "_PROCESSOR_END_S", 0.5)
    monkeypatch.setattr(batches_module, "CANCELLED_SETTLES_WAIT_S", 0.4)
    msgs = [HungNakMsg(**vars(task_msg(f"t{i}"))) for i in range(BATCH)]
    worker, _store, _js, _metrics = a_worker(
        FakeSource(list(msgs)), FakeEngine(), store=HungStore()
    )
    worker.drain.timeout_s = 0.2
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        running = asyncio.create_task(worker.run(stop))
        for _ in range(500):  # every task's result being stored
            if len(worker.claims) == BATCH and not worker.batches.engine_busy():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        stop.set()
        done, _ = await asyncio.wait({running}, timeout=10)
    assert done, "the drain ended though its give-backs hung"
    stuck = [line for line in logs if line["event"] == "drain_give_back_stuck"]
    assert sorted(i for line in stuck for i in line["task_ids"]) == [f"t{i}" for i in range(BATCH)]
    assert all(m.actions == [] for m in msgs), "none acked"


class NotedWatchdog:
    """A watchdog that notes each fresh window among the log lines captured."""

    def __init__(self, logs: list[dict[str, Any]]) -> None:
        self.logs = logs

    def arm(self) -> None:
        self.logs.append({"event": "watchdog_armed"})

    def disarm(self) -> None:
        self.logs.append({"event": "watchdog_disarmed"})


async def test_past_the_drain_timeout_each_bounded_wait_starts_a_fresh_watchdog_window(
    monkeypatch,
):
    """The drain's time runs out and its give-backs hang: every bounded wait past the timeout
    (the cancelled run's end, each give-back) starts with a fresh watchdog window, so a
    watchdog longer than the drain timeout and than each wait never fires mid-drain."""
    monkeypatch.setattr(claims_module, "GIVE_BACK_WAIT_S", 0.2)
    monkeypatch.setattr(drain_module, "GIVE_BACK_WAIT_S", 0.2)
    monkeypatch.setattr(drain_module, "_PROCESSOR_END_S", 0.5)
    monkeypatch.setattr(batches_module, "CANCELLED_SETTLES_WAIT_S", 0.4)
    msgs = [HungNakMsg(**vars(task_msg(f"t{i}"))) for i in range(BATCH)]
    with structlog.testing.capture_logs() as logs:
        worker, _store, _js, _metrics = a_worker(
            FakeSource(list(msgs)), FakeEngine(), store=HungStore(), watchdog=NotedWatchdog(logs)
        )
        worker.drain.timeout_s = 0.2
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        for _ in range(500):  # every task's result being stored
            if len(worker.claims) == BATCH and not worker.batches.engine_busy():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        stop.set()
        done, _ = await asyncio.wait({running}, timeout=10)
    assert done
    events = [line["event"] for line in logs]
    waits = ("drain_settles_stuck", "drain_processor_stuck", "drain_give_back_stuck")
    past = events[events.index("drain_timeout") :]
    assert any(event in waits for event in past)
    since = "drain_timeout"
    for event in past[1:]:
        if event in waits:
            assert since == "watchdog_armed", f"{event} ended a wait begun with no fresh window"
        if event in (*waits, "watchdog_armed"):
            since = event
