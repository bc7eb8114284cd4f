"""The Antenna source's parts against the fake Antenna (a real HTTP server on 127.0.0.1), and
the fake's own documented behaviours: what a worker relies on."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from config.aliases import alias_overrides
from config.redact import scrub
from config.settings import ConfigError, load_settings
from pipelines.found import Box, Classification, Detection, Ref
from pipelines.models import Algorithm
from tests.antenna_fake import FakeAntenna, reserved_port
from worker.antenna.catalog import Catalog
from worker.antenna.client import AntennaClient
from worker.antenna.identity import client_info
from worker.antenna.job_listing import JobRotation
from worker.antenna.parts import AntennaParts, NoResultsLookup
from worker.antenna.post import Poster
from worker.antenna.registration import antenna_problems, meaning, register
from worker.antenna.render import (
    AntennaPipeline,
    _compact,
    antenna_key,
    fit,
    ok_entry,
)
from worker.antenna.reservations import Reservations, delivered_of
from worker.antenna.settle import AntennaSettler
from worker.antenna.source import AntennaSource
from worker.antenna.waiting import antenna_waiting_read
from worker.core.admission import Admission
from worker.core.claims import Claims
from worker.core.outcome import Outcome
from worker.core.results import Result, ResultMaker
from worker.core.tasks import Task
from worker.core.verdicts import NO_BACKOFF, decide
from worker.health.liveness import Liveness
from worker.health.metrics import Metrics

TOKEN = "unit-token-5b7d"
SLUG = "moths"
LABELS = ("a", "b", "c")
DETECTOR = Algorithm("det", "Detector", "detection", "cd" * 32, ("object",))
CLASSIFIER = Algorithm("clf", "Classifier", "classification", "ab" * 32, LABELS)
SERVED = AntennaPipeline(SLUG, "", (DETECTOR, CLASSIFIER))
DETECTOR_KEY = antenna_key(DETECTOR)


@pytest.fixture
def fake() -> Iterator[FakeAntenna]:
    antenna = FakeAntenna(token=TOKEN, ttr_s=0.4)
    antenna.register_direct(1, SERVED.config())
    with antenna.running():
        yield antenna


def client_of(fake: FakeAntenna, token: str = TOKEN) -> AntennaClient:
    return AntennaClient(fake.url, SecretStr(token), 5.0)


def source_of(
    fake: FakeAntenna, token: str = TOKEN, size: int = 10, idle_wait_s: float = 0.0
) -> AntennaSource:
    client = client_of(fake, token)
    jobs = JobRotation(client, (SLUG,), 0.05, 100)
    return AntennaSource(
        client,
        jobs,
        Reservations(fake.ttr_s, 60.0, size, batch_size=size),
        reservation_size=size,
        wait_s=0.05,
        max_deliver=2,
        idle_wait_s=idle_wait_s,
    )


def images(n: int, prefix: str = "i") -> list[tuple[str, str]]:
    return [(f"{prefix}{i}", f"http://127.0.0.1:1/{prefix}{i}.jpg") for i in range(n)]


def detection(
    image: str, key: str, scores: list[float], x1: float = 1.0, by: str = DETECTOR_KEY
) -> dict[str, Any]:
    """A box found by the detector ``by``, classified by ``key``."""
    return {
        "source_image_id": image,
        "bbox": {"x1": x1, "y1": 1.0, "x2": 5.0, "y2": 5.0},
        "inference_time": 0.01,
        "algorithm": {"name": "Detector", "key": by},
        "timestamp": "2026-12-01T00:00:00+00:00",
        "crop_image_url": None,
        "classifications": [
            {
                "classification": "a",
                "scores": scores,
                "logits": None,
                "algorithm": {"name": "Classifier", "key": key},
                "terminal": True,
                "timestamp": "2026-12-01T00:00:00+00:00",
            }
        ],
    }


def found_box(
    key: str,
    scores: list[float],
    x1: float = 1.0,
    by: str = DETECTOR_KEY,
    logits: list[float] | None = None,
) -> Detection:
    """What the runner gives for a box found by the detector ``by``, classified by ``key``."""
    at = "2026-12-01T00:00:00+00:00"
    classified = Classification("a", None, scores, logits, 0.01, Ref("Classifier", key), True, at)
    return Detection(Box(x1, 1.0, 5.0, 5.0), 0.01, Ref("Detector", by), at, [classified])


def task_of(delivered: Any) -> Task:
    """The task the source read from Antenna's answer."""
    task = delivered.read.task
    assert task is not None and task.pipeline == SLUG, delivered.read
    return task


class CoreSettle:
    """The orchestrator's way with a finished task: the core's verdict (``verdicts.decide``),
    carried out by the Antenna settler; what it did."""

    def __init__(self, settler: AntennaSettler) -> None:
        self.settler = settler

    async def settle(self, task: Task, delivered: Any, outcome: Outcome) -> str:
        verdict = decide(
            task,
            outcome,
            delivered=delivered.delivered,
            deliveries_left=delivered.deliveries_left,
            results=ResultMaker(),
            backoff=NO_BACKOFF,
        )
        return (await self.settler.settle(delivered, verdict)).kept.value


async def reserve_all(source: AntennaSource, n: int) -> list[Any]:
    got: list[Any] = []
    for _ in range(20):
        got += await source.fetch(n - len(got))
        if len(got) >= n:
            break
    return got


async def test_every_active_job_is_listed_not_antennas_one_random_job(fake: FakeAntenna) -> None:
    # Antenna lists one random job per call unless it is given a limit (the fake does too)
    ids = [fake.add_job(SLUG, images(1, f"j{n}-")) for n in range(4)]
    rotation = JobRotation(client_of(fake), (SLUG,), 10.0, 100)
    assert sorted(j.id for j in await rotation.refresh()) == sorted(ids)


async def test_only_started_and_retry_jobs_are_rotated_in_turn(fake: FakeAntenna) -> None:
    ids = {
        s: fake.add_job(SLUG, images(1, s))
        for s in ("STARTED", "CREATED", "PENDING", "CANCELING", "RETRY", "SUCCESS")
    }
    for status, job in ids.items():
        fake.jobs[job].status = status
    rotation = JobRotation(client_of(fake), (SLUG,), 10.0, 100)
    active = await rotation.refresh()
    assert [j.id for j in active] == [ids["STARTED"], ids["RETRY"]]
    rotation.reserved_from(active[0])
    assert [j.id for j in rotation.next_jobs()] == [ids["RETRY"], ids["STARTED"]]


async def test_jobs_of_every_served_pipeline_are_rotated_and_no_other_pipelines(
    fake: FakeAntenna,
) -> None:
    moths = fake.add_job(SLUG, images(1, "m"))
    orders = fake.add_job("orders", images(1, "o"))
    other = fake.add_job("beetles", images(1, "b"))
    rotation = JobRotation(client_of(fake), (SLUG, "orders"), 10.0, 100)
    active = await rotation.refresh()
    assert [(j.id, j.pipeline) for j in active] == [(moths, SLUG), (orders, "orders")]

    # An Antenna that ignored the filter would list another pipeline's job: it is not taken.
    listed = fake._list
    fake._list = lambda query, user=None: listed({**query, "pipeline__slug__in": ""}, user)  # type: ignore[method-assign]
    rotation = JobRotation(client_of(fake), (SLUG, "orders"), 10.0, 100)
    assert other not in [j.id for j in await rotation.refresh()]


async def test_jobs_listed_without_their_pipeline_slug_are_still_served(
    fake: FakeAntenna,
) -> None:
    """Antenna's ids-only jobs list gave ``id`` alone before it gave ``pipeline_slug``: the
    job's own page names its pipeline; with neither, a worker of one pipeline takes the job
    Antenna listed for its slug, one of several leaves it."""
    moths = fake.add_job(SLUG, images(1, "m"))
    orders = fake.add_job("orders", images(1, "o"))
    listed, answer = fake._list, fake.handle

    def ids_alone(query: dict[str, str], user: Any = None) -> tuple[int, Any]:
        status, body = listed(query, user)
        return status, {**body, "results": [{"id": j["id"]} for j in body["results"]]}

    fake._list = ids_alone  # type: ignore[method-assign]
    rotation = JobRotation(client_of(fake), (SLUG, "orders"), 10.0, 100)
    assert [(j.id, j.pipeline) for j in await rotation.refresh()] == [
        (moths, SLUG),
        (orders, "orders"),
    ]

    def no_slug_anywhere(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        status, body = answer(method, path, *args, **kwargs)
        if isinstance(body, dict) and "status" in body:  # a job's page
            body = {k: v for k, v in body.items() if k != "pipeline_slug"}
        return status, body

    fake.handle = no_slug_anywhere  # type: ignore[method-assign]
    fake.jobs[orders].status = "SUCCESS"
    one = JobRotation(client_of(fake), (SLUG,), 10.0, 100)
    assert [(j.id, j.pipeline) for j in await one.refresh()] == [(moths, SLUG)]
    fake.jobs[orders].status = "STARTED"
    several = JobRotation(client_of(fake), (SLUG, "orders"), 10.0, 100)
    assert await several.refresh() == []  # whose job is it? not reserved from


async def test_a_reservation_runs_out_after_its_ttr_and_a_task_comes_back_once(
    fake: FakeAntenna,
) -> None:
    job = fake.add_job(SLUG, images(3))
    source = source_of(fake)
    first = await reserve_all(source, 3)
    assert [d.delivered for d in first] == [1, 1, 1]
    assert await source.fetch(3) == []  # all reserved: Antenna answers []
    fake.expire_reservations()
    second = await reserve_all(source, 3)
    assert {d.handle.image_id for d in second} == {"i0", "i1", "i2"}
    assert [d.delivered for d in second] == [2, 2, 2]
    fake.expire_reservations()
    assert await source.fetch(3) == []
    assert fake.lost(job) == {"i0", "i1", "i2"}


async def test_one_bad_task_in_a_reservation_gets_an_error_result_and_the_rest_are_served(
    fake: FakeAntenna,
) -> None:
    job = fake.add_job(SLUG, images(6))
    fake.spoil("i1", lambda t: {**t, "image_url": None})
    fake.spoil("i2", lambda t: {**t, "id": None})  # no id; its image and subject still usable
    fake.spoil("i3", lambda t: {**t, "reply_subject": t["reply_subject"] + "\u00b2"}, times=1)
    fake.spoil("i4", lambda t: ["not", "a", "task"], times=1)
    source = source_of(fake)
    rules = rules_of(fake, 10**6)
    claims = Claims(100, Liveness(60.0), rules.settler)
    admission = Admission(rules.settler, NoResultsLookup(), claims, ResultMaker())

    with structlog.testing.capture_logs() as logs:
        got = await source.fetch(6)
        held = [c for c in await asyncio.gather(*map(admission.admit, got)) if c is not None]
    verdicts = await asyncio.gather(*(rules.settle(c.task, c.delivered, outcome()) for c in held))

    assert sorted(d.handle.image_id for d in got) == ["i0", "i1", "i2", "i5"]
    assert sorted(c.task.image_id for c in held) == ["i0", "i5"] and verdicts == ["ok", "ok"]
    assert fake.jobs[job].done == {"i0", "i5"} and fake.jobs[job].failed == {"i1", "i2"}
    skipped = [e for e in logs if e["event"] == "antenna_task_skipped"]
    assert [(e["job_id"], e["image_id"]) for e in skipped] == [(job, "i3"), (job, None)]
    # The two skipped come back once their reservations run out, and are served then.
    fake.expire_reservations()
    again = await reserve_all(source, 2)
    assert sorted(d.handle.image_id for d in again) == ["i3", "i4"]
    await asyncio.gather(*(rules.settle(task_of(d), d, outcome()) for d in again))
    assert fake.pending(job) == set() and fake.jobs[job].status == "SUCCESS"


async def test_reserving_nothing_when_antenna_is_down_refuses_or_the_job_is_unknown(
    fake: FakeAntenna,
) -> None:
    job = fake.add_job(SLUG, images(2))
    fake.tasks_unavailable = True
    assert await source_of(fake).fetch(2) == []  # 503: nothing reserved
    assert all(t.delivered == 0 for t in fake.jobs[job].tasks.values())
    fake.tasks_unavailable = False
    wrong = source_of(fake, token="not-the-token")
    assert await wrong.fetch(2) == []
    refusal = str(wrong.refusal())
    assert "401" in refusal and "not-the-token" not in refusal
    fake.tokens["other"] = {2}
    other = source_of(fake, token="other")
    assert await other.fetch(2) == [] and "403" in str(other.refusal())
    unknown = await client_of(fake).post("jobs/999/tasks/", "tasks", b'{"batch_size": 1}')
    assert unknown.status == 404


async def test_a_reservation_whose_answer_is_lost_is_left_to_redelivery_and_said(
    fake: FakeAntenna,
) -> None:
    """Given Antenna reserves a task and the connection drops before its answer comes back,
    the fetch gets nothing and says the task is left to Antenna's redelivery; it is not asked
    again (one request per fetch), so no second task goes out behind it."""
    job = fake.add_job(SLUG, images(3))
    source = source_of(fake, size=1)
    (first,) = await source.fetch(1)
    first.handle.posted()  # its result posted: room for the next
    fake.misbehave("tasks", "drop", times=1)
    with structlog.testing.capture_logs() as logs:
        assert await source.fetch(1) == []
    (said,) = [e for e in logs if e["event"] == "antenna_reservation_unanswered"]
    assert said["job_id"] == job and said["action"] == "left to Antenna's redelivery"
    assert "WORKER_ANTENNA__TTR_S" in said["hint"]
    assert len([r for r in fake.requests if r[1].endswith("/tasks/")]) == 2  # one per fetch
    delivered = {t.image_id: t.delivered for t in fake.jobs[job].tasks.values()}
    assert delivered == {"i0": 1, "i1": 1, "i2": 0}


async def test_a_reservation_answered_after_the_deadline_is_left_to_redelivery_and_said(
    fake: FakeAntenna, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given Antenna reserves a task and its answer comes too slowly for the call's deadline,
    the fetch gets nothing and says the reservation went unanswered (Antenna may hold tasks
    for it until the TTR), not that Antenna was unreachable; it is not asked again."""
    import worker.antenna.source as source_module

    monkeypatch.setattr(source_module, "_UNAVAILABLE_BACKOFF_S", 0.0)
    job = fake.add_job(SLUG, images(2))
    client = AntennaClient(fake.url, SecretStr(TOKEN), 0.5)
    jobs = JobRotation(client, (SLUG,), 0.05, 100)
    reservations = Reservations(fake.ttr_s, 60.0, 1, batch_size=1)
    source = AntennaSource(
        client, jobs, reservations, reservation_size=1, wait_s=0.05, max_deliver=2
    )
    fake.misbehave("tasks", "slow", times=1, interval_s=0.1)  # served, then dripped
    with structlog.testing.capture_logs() as logs:
        assert await source.fetch(1) == []
    events = [e["event"] for e in logs]
    assert "antenna_reserve_unreachable" not in events
    (said,) = [e for e in logs if e["event"] == "antenna_reservation_unanswered"]
    assert said["job_id"] == job and said["action"] == "left to Antenna's redelivery"
    assert "not sent again" in said["error"]
    assert len([r for r in fake.requests if r[1].endswith("/tasks/")]) == 1  # not replayed
    delivered = {t.image_id: t.delivered for t in fake.jobs[job].tasks.values()}
    assert delivered == {"i0": 1, "i1": 0}


async def test_the_token_echoed_in_a_task_is_masked_in_the_log_and_intact_in_the_data(
    fake: FakeAntenna, capsys: pytest.CaptureFixture[str]
) -> None:
    """Given Antenna's answer echoes the token in a task's image id, the log line that names
    the malformed task shows it masked, while a well-formed task's data keeps it as it came
    (an image id is matched, not shown)."""
    import logging

    from config.logging import configure_logging

    fake.add_job(
        SLUG, [(f"bad-{TOKEN}", "http://127.0.0.1:1/a.jpg"), (f"good-{TOKEN}", "http://x/b.jpg")]
    )
    fake.spoil(f"bad-{TOKEN}", lambda t: {**t, "image_url": None})
    source = source_of(fake)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    configure_logging("INFO", json=True, secrets=(TOKEN,))
    # No logger of the modules used here may keep this chain for later tests' capture_logs.
    structlog.configure(cache_logger_on_first_use=False)
    try:
        got = await reserve_all(source, 2)
    finally:
        structlog.reset_defaults()
        root.handlers[:], root.level = handlers, level
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    (malformed,) = [e for e in lines if e["event"] == "antenna_task_malformed"]
    assert malformed["image_id"] == "bad-<redacted>"
    assert not [e for e in lines if TOKEN in json.dumps(e)]
    (good,) = [d for d in got if d.handle.image_id.startswith("good-")]
    assert task_of(good).image_id == f"good-{TOKEN}" == good.handle.image_id


async def test_accepted_results_antenna_drops_are_not_saved_and_come_back(
    fake: FakeAntenna,
) -> None:
    job = fake.add_job(SLUG, images(6))
    source = source_of(fake)
    d = {x.handle.image_id: x for x in await reserve_all(source, 6)}
    key = antenna_key(CLASSIFIER)

    def results(image: str, **change: Any) -> dict[str, Any]:
        base = {
            "pipeline": SLUG,
            "total_time": 0.1,
            "source_images": [{"id": image, "url": "http://x/y.jpg"}],
            "detections": [detection(image, key, [0.8, 0.1, 0.1])],
        }
        return {**base, **change}

    unknown_classifier = detection("i5", key, [0.8, 0.1, 0.1])
    unknown_classifier["classifications"][0]["algorithm"]["key"] = "unregistered"
    posts = [
        (d["i0"], results("i0", pipeline="other-pipeline")),
        (
            d["i1"],
            results("i1", detections=[detection("i1", key, [0.8, 0.1, 0.1], by="unregistered")]),
        ),
        (d["i2"], results("i2", source_images=[{"id": "i4", "url": "http://x/y.jpg"}])),
        (d["i3"], results("i3", detections=[detection("i3", key, [0.8, 0.2])])),
        (d["i4"], results("i4")),
        (d["i5"], results("i5", detections=[unknown_classifier])),
    ]
    body = {"results": [{"reply_subject": x.handle.reply_subject, "result": r} for x, r in posts]}
    reply = await client_of(fake).post(f"jobs/{job}/result/", "result", json.dumps(body).encode())
    assert reply.status == 200 and reply.body["status"] == "accepted"
    # The image named in source_images counts as done, not the task's: i2 is stuck.
    assert fake.jobs[job].done == {"i4"} and set(fake.jobs[job].saved) == {"i4", "i5"}
    assert fake.jobs[job].saved["i5"][0]["classifications"] == []
    fake.expire_reservations()
    again = await reserve_all(source, 6)
    assert {x.handle.image_id for x in again} == {"i0", "i1", "i3", "i4", "i5"} - {"i4"}
    assert "i2" in fake.pending(job)


async def test_results_of_a_pipeline_without_a_detection_algorithm_are_accepted_then_dropped(
    fake: FakeAntenna,
) -> None:
    fake.register_direct(1, AntennaPipeline("whole-image", "", (CLASSIFIER,)).config())
    job = fake.add_job("whole-image", images(2))
    client = client_of(fake)
    reply = await client.post(f"jobs/{job}/tasks/", "tasks", b'{"batch_size": 2}')
    a, b = reply.body["tasks"]
    whole_image = {**detection(a["image_id"], antenna_key(CLASSIFIER), [0.8, 0.1, 0.1])}
    # What a classifier alone gives: the whole image, named by its (registered) classifier.
    whole_image.update(bbox=None, algorithm={"name": "Classifier", "key": antenna_key(CLASSIFIER)})
    ok = {
        "pipeline": "whole-image",
        "total_time": 0.1,
        "source_images": [{"id": a["image_id"], "url": "u"}],
        "detections": [whole_image],
    }
    error = {"error": "unreadable", "image_id": b["image_id"]}
    body = {
        "results": [
            {"reply_subject": a["reply_subject"], "result": ok},
            {"reply_subject": b["reply_subject"], "result": error},
        ]
    }
    posted = await client.post(f"jobs/{job}/result/", "result", json.dumps(body).encode())
    assert posted.status == 200 and posted.body["status"] == "accepted"
    assert fake.jobs[job].saved == {} and fake.pending(job) == {a["image_id"]}
    assert fake.jobs[job].failed == {b["image_id"]}  # an error result needs no detector


async def test_identical_reposts_add_nothing_and_error_results_need_an_image_id(
    fake: FakeAntenna,
) -> None:
    job = fake.add_job(SLUG, images(3))
    got = {x.handle.image_id: x for x in await reserve_all(source_of(fake), 3)}
    key = antenna_key(CLASSIFIER)
    ok = {
        "reply_subject": got["i0"].handle.reply_subject,
        "result": {
            "pipeline": SLUG,
            "total_time": 0.1,
            "source_images": [{"id": "i0", "url": "u"}],
            "detections": [detection("i0", key, [0.8, 0.1, 0.1])],
        },
    }
    client = client_of(fake)
    for _ in range(2):
        await client.post(f"jobs/{job}/result/", "result", json.dumps({"results": [ok]}).encode())
    assert len(fake.jobs[job].saved["i0"]) == 1
    moved = json.loads(json.dumps(ok))
    moved["result"]["detections"][0]["bbox"]["x1"] = 2.0
    await client.post(f"jobs/{job}/result/", "result", json.dumps({"results": [moved]}).encode())
    assert len(fake.jobs[job].saved["i0"]) == 2  # re-inferred boxes add detections
    errors = {
        "results": [
            {
                "reply_subject": got["i1"].handle.reply_subject,
                "result": {"error": "x", "image_id": "i1"},
            },
            {"reply_subject": got["i2"].handle.reply_subject, "result": {"error": "x"}},
        ]
    }
    await client.post(f"jobs/{job}/result/", "result", json.dumps(errors).encode())
    assert fake.jobs[job].failed == {"i1"} and fake.pending(job) == {"i2"}


# -- posting: size cap, 413, validation ---------------------------------------------------------
def rules_of(fake: FakeAntenna, max_post_bytes: int) -> CoreSettle:
    poster = Poster(client_of(fake), max_post_bytes, 5.0)
    catalog = Catalog([SLUG])
    catalog.add(SERVED)
    return CoreSettle(AntennaSettler(poster, catalog, max_post_bytes))


def outcome(scores: tuple[float, ...] = (0.7, 0.2, 0.1), detections: int = 1) -> Outcome:
    found = [found_box("clf", list(scores), x1=float(i), by="det") for i in range(detections)]
    return Outcome(detections=found, timings_s={"load_s": 0.01, "infer_s": 0.01})


async def test_results_are_split_under_the_cap_and_a_413_halves_the_body(
    fake: FakeAntenna,
) -> None:
    job = fake.add_job(SLUG, images(12))
    got = await reserve_all(source_of(fake, size=12), 12)
    rules = rules_of(fake, 6000)
    fake.max_body_bytes = 4000  # the proxy refuses less than our cap: 413, then halves
    verdicts = await asyncio.gather(
        *(rules.settle(task_of(d), d, outcome(detections=2)) for d in got)
    )
    assert verdicts == ["ok"] * 12
    assert fake.pending(job) == set() and fake.jobs[job].failed == set()
    assert all(len(v) == 2 for v in fake.jobs[job].saved.values())
    assert max(len(b) for b in fake.bodies) <= 6000 and len(fake.bodies) > 2
    assert ("POST", f"/api/v2/jobs/{job}/result/", 413) in fake.requests


async def test_a_result_antenna_would_drop_is_posted_as_an_error_with_its_image(
    fake: FakeAntenna,
) -> None:
    job = fake.add_job(SLUG, images(2))
    a, b = await reserve_all(source_of(fake), 2)
    rules = rules_of(fake, 10**6)
    wrong_length = await rules.settle(task_of(a), a, outcome(scores=(0.5, 0.5)))
    too_big_alone = fake.max_body_bytes = 1500
    assert too_big_alone
    huge = await rules.settle(task_of(b), b, outcome(detections=20))
    assert (wrong_length, huge) == ("error", "error")
    assert fake.jobs[job].failed == {a.handle.image_id, b.handle.image_id}
    errors = [json.loads(body)["results"][0]["result"] for body in fake.bodies[-2:]]
    assert all(e.get("image_id") for e in errors)
    assert (
        "category map has 3 classes" in json.loads(fake.bodies[0])["results"][0]["result"]["error"]
    )


async def test_task_done_of_an_error_result_names_the_errors_type(fake: FakeAntenna) -> None:
    """The ``task_done`` line (``verdicts.log_task_done``: the settler's ``Settled``) of an
    error result posted to Antenna said ``error_type: null``."""
    from config.errors import Failure

    fake.add_job(SLUG, images(2))
    missing, dropped = await reserve_all(source_of(fake), 2)
    settler = rules_of(fake, 10**6).settler
    gone = Outcome(failure=Failure("object_missing", "no such object", retryable=False))
    said = {}
    for delivered, how in ((missing, gone), (dropped, outcome(scores=(0.5, 0.5)))):
        verdict = decide(
            task_of(delivered),
            how,
            delivered=1,
            deliveries_left=1,
            results=ResultMaker(),
            backoff=NO_BACKOFF,
        )
        said[delivered.handle.image_id] = await settler.settle(delivered, verdict)
    assert said[missing.handle.image_id].error_type == "object_missing"
    assert said[missing.handle.image_id].error == "object_missing: no such object"
    assert said[dropped.handle.image_id].error_type == "invalid_model_output"


async def test_a_result_posted_after_its_reservation_ran_out_is_said(fake: FakeAntenna) -> None:
    """The TTR the worker assumes (WORKER_ANTENNA__TTR_S) is Antenna's NATS_TASK_TTR; a result
    posted after it ran out may be the second of a task delivered again: said, and posted."""
    job = fake.add_job(SLUG, images(1))
    (late,) = await reserve_all(source_of(fake), 1)
    await asyncio.sleep(fake.ttr_s + 0.1)  # the reservation ran out
    with structlog.testing.capture_logs() as logs:
        assert await rules_of(fake, 10**6).settle(task_of(late), late, outcome()) == "ok"
    (said,) = [e for e in logs if e["event"] == "result_posted_after_ttr"]
    assert said["late_by_s"] >= 0 and "WORKER_ANTENNA__TTR_S" in said["hint"], said
    assert fake.jobs[job].done == {"i0"}


async def test_a_transient_failure_is_left_to_redelivery_before_the_last_delivery(
    fake: FakeAntenna,
) -> None:
    from config.errors import Failure

    job = fake.add_job(SLUG, images(1))
    source = source_of(fake)
    (d,) = await reserve_all(source, 1)
    rules = rules_of(fake, 10**6)
    failing = Outcome(failure=Failure("loader_timeout", "slow", retryable=True))
    assert await rules.settle(task_of(d), d, failing) == "retried"
    assert fake.bodies == [] and fake.pending(job) == {"i0"}
    fake.expire_reservations()
    (again,) = await reserve_all(source, 1)
    assert again.delivered == 2 and again.deliveries_left == 0
    assert await rules.settle(task_of(again), again, failing) == "error"
    assert fake.jobs[job].failed == {"i0"}
    (body,) = [json.loads(b)["results"][0]["result"] for b in fake.bodies]
    assert body["error"] == "deliveries ran out after 2 attempts; last error: loader_timeout: slow"


def test_an_oversized_result_keeps_every_logit_and_what_antenna_reads_of_its_scores() -> None:
    import random

    classes = 29_176
    rng = random.Random(0)
    logits = [rng.gauss(0.0, 2.0) for _ in range(classes)]
    logits[7] = 20.0  # a confident top class, as a trained classifier gives
    logits[8] = 19.9995  # a runner-up that rounding would tie with it
    raw = [math.exp(v) for v in logits]
    total = sum(raw)
    scores = [round(v / total, 6) for v in raw]
    labels = tuple(f"taxon-{i}" for i in range(classes))
    big = Algorithm("species", "Species", "classification", "cd" * 32, labels)
    served = AntennaPipeline(SLUG, "", (big,))
    task = Task("1", "1", "1", "http://x/1.jpg", reply_subject="$JS.ACK.a.b.1.1.1.1.0")
    rounded = [round(v, 6) for v in logits]

    def result_of(count: int) -> Any:
        found = [
            found_box("species", scores, x1=float(i), logits=list(rounded)) for i in range(count)
        ]
        timings_s = {"total_s": 1.0}
        made = Result(task, found, None, {}, timings_s, {}, 1)
        return ok_entry(task, made, served, SLUG)

    entry = result_of(115)
    before = entry.size()
    fitted, steps = fit(task, entry, 32 * 1024 * 1024)
    after = len(fitted.body)
    print(f"29176 classes x 115 detections: {before} bytes -> {after} bytes ({steps})")
    assert before > 32 * 1024 * 1024 >= after
    assert steps == ["scores_compacted", "logits_rounded"]
    for found in json.loads(fitted.body)["result"]["detections"]:
        (kept,) = found["classifications"]
        # Antenna's class masking reads the logits alone, whole: every one is there
        assert len(kept["logits"]) == classes
        assert max(abs(a - b) for a, b in zip(kept["logits"], rounded, strict=True)) <= 5.001e-4
        # its save reads max(scores) and the first index of it: both as they were
        assert len(kept["scores"]) == classes
        assert max(kept["scores"]) == max(scores) == scores[7]
        assert kept["scores"].index(max(kept["scores"])) == 7
    assert served.classes()[antenna_key(big)] == classes
    # Past every step: logits are never dropped, the result becomes an error result instead.
    small, small_steps = fit(task, result_of(5), 1024 * 1024)
    assert small_steps[-1] == "error_result" and json.loads(small.body)["result"]["image_id"] == "1"


def _near_ties() -> st.SearchStrategy[list[float]]:
    """Score vectors whose values sit on, just under and just over 3-decimal steps and each
    other: where a cut to 3 decimals could tie (or pass) the top score."""

    def around(v: float) -> st.SearchStrategy[float]:
        step = round(v, 3)
        near = [v, math.nextafter(v, 0), math.nextafter(v, 2), step, math.nextafter(step, 0)]
        return st.sampled_from([max(0.0, x) for x in near])

    return st.floats(0, 1).flatmap(
        lambda v: st.lists(around(v) | st.floats(0, 1), min_size=1, max_size=12)
    )


@example([0.9369999999999999, 0.937, 0])  # 0.9369999999999999 * 1000 rounds up to 937
@example([0.5, 0.5, 0.25])
@example([0.0, 0.0])
@settings(max_examples=300, deadline=None)
@given(_near_ties())
def test_compacted_scores_keep_the_top_index_antenna_reads(scores: list[float]) -> None:
    out = _compact(scores)
    top = scores.index(max(scores))
    assert max(out) == max(scores) and out.index(max(out)) == top  # as Antenna's save reads
    for i, (was, cut) in enumerate(zip(scores, out, strict=True)):
        if i == top:
            continue
        assert cut < out[top] or cut == out[top] == 0, (i, scores, out)
        assert cut <= was and was - cut < 0.002 and cut == round(cut, 3), (i, was, cut)


async def test_a_result_over_the_cap_reaches_antenna_with_every_logit() -> None:
    classes = 2000
    big = Algorithm("clf", "Species", "classification", "ef" * 32, tuple(map(str, range(classes))))
    served = AntennaPipeline(SLUG, "", (DETECTOR, big))
    logits = [math.sin(i) * 3 + 0.1234567 for i in range(classes)]
    total = sum(math.exp(v) for v in logits)
    scores = [math.exp(v) / total for v in logits]
    found = found_box("clf", scores, by="det", logits=logits)
    fake = FakeAntenna(token=TOKEN, ttr_s=30.0)
    fake.register_direct(1, served.config())
    with fake.running():
        job = fake.add_job(SLUG, images(1))
        (got,) = await reserve_all(source_of(fake, size=1), 1)
        poster = Poster(client_of(fake), 30_000, 5.0)
        catalog = Catalog([SLUG])
        catalog.add(served)
        rules = CoreSettle(AntennaSettler(poster, catalog, 30_000))
        done = Outcome(detections=[found], timings_s={"load_s": 0.01, "infer_s": 0.01})
        assert await rules.settle(task_of(got), got, done) == "ok"
    (body,) = fake.bodies
    assert len(json.dumps([scores, logits])) > 30_000
    assert len(body) <= 30_000
    assert fake.jobs[job].done == {"i0"}
    (saved,) = fake.jobs[job].saved["i0"][0]["classifications"]
    assert fake.maskable(saved, classes)  # what Antenna's class masking reads: all there
    assert saved["scores"].index(max(saved["scores"])) == scores.index(max(scores))


async def test_client_info_goes_with_each_reservation_and_result_and_holds_no_secret(
    fake: FakeAntenna,
) -> None:
    info = client_info("svc", (SLUG,), 3)
    job = fake.add_job(SLUG, images(2))
    client = client_of(fake)
    source = AntennaSource(
        client,
        JobRotation(client, (SLUG,), 0.05, 100),
        Reservations(fake.ttr_s, 60.0, 2, batch_size=2),
        reservation_size=2,
        wait_s=0.05,
        max_deliver=2,
        client_info=info,
    )
    got = await reserve_all(source, 2)
    poster = Poster(client, 10**6, 5.0, client_info=info)
    catalog = Catalog([SLUG])
    catalog.add(SERVED)
    rules = CoreSettle(AntennaSettler(poster, catalog, 10**6))
    verdicts = await asyncio.gather(*(rules.settle(task_of(d), d, outcome()) for d in got))
    assert verdicts == ["ok", "ok"] and fake.jobs[job].done == {"i0", "i1"}
    endpoints = [endpoint for endpoint, _ in fake.client_infos]
    assert "tasks" in endpoints and "result" in endpoints
    assert all(seen == info for _, seen in fake.client_infos)
    assert info["hostname"] and info["pid"] and info["pipelines"] == [SLUG]
    assert info["software"] == "inference-worker" and info["version"]
    assert TOKEN not in json.dumps(fake.client_infos)
    # Antenna refuses a client_info that is not an object: the fake does too
    refused = await client.post(
        f"jobs/{job}/tasks/", "tasks", b'{"batch_size": 1, "client_info": "me"}'
    )
    assert refused.status == 400


async def test_the_token_goes_with_the_configured_scheme_and_is_masked_in_what_is_shown(
    fake: FakeAntenna,
) -> None:
    job = fake.add_job(SLUG, images(1))
    ask = b'{"batch_size": 1}'
    fake.schemes = {"Api-Key"}  # an Antenna that takes processing-service keys only
    as_token = await client_of(fake).post(f"jobs/{job}/tasks/", "tasks", ask)
    api_key = AntennaClient(fake.url, SecretStr(TOKEN), 5.0, scheme="Api-Key")
    as_key = await api_key.post(f"jobs/{job}/tasks/", "tasks", ask)
    assert as_token.status == 401  # another scheme: anonymous there
    assert as_key.status == 200 and len(as_key.body["tasks"]) == 1
    fake.schemes = {"Token"}  # Antenna's main
    assert (await api_key.post(f"jobs/{job}/tasks/", "tasks", ask)).status == 401
    assert set(fake.headers_seen) == {f"Token {TOKEN}", f"Api-Key {TOKEN}"}
    echoed = json.dumps({"detail": f"bad header Api-Key {TOKEN}"}).encode()
    fake.misbehave("tasks", "json", status=500, body=echoed)
    shown = await api_key.post(f"jobs/{job}/tasks/", "tasks", ask)
    assert shown.status == 500 and TOKEN not in shown.why() and TOKEN not in shown.text
    assert "Api-Key <redacted>" in scrub(f"Authorization: Api-Key {TOKEN}")
    with pytest.raises(ConfigError, match="WORKER_ANTENNA__AUTH_SCHEME"):
        load_settings(for_worker=False, antenna={"auth_scheme": "Bearer"})


async def test_the_fake_down_on_a_reserved_port_keeps_it_then_serves_on_it() -> None:
    bound = reserved_port()
    port = bound.getsockname()[1]
    try:
        with pytest.raises(ConnectionRefusedError):  # down: as an Antenna with nothing up
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with socket.socket() as other, pytest.raises(OSError):  # no other process takes it
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind(("127.0.0.1", port))
        fake = FakeAntenna(token=TOKEN)
        with fake.running(bound=bound):  # up again, on the same port
            assert fake.url == f"http://127.0.0.1:{port}/api/v2"
            assert (await client_of(fake).get("jobs/", "jobs", {"limit": 1})).ok
    finally:
        bound.close()


async def test_project_ids_scope_which_jobs_are_reserved_from(fake: FakeAntenna) -> None:
    fake.projects[2] = {}
    fake.register_direct(2, SERVED.config())
    ours = fake.add_job(SLUG, images(3, "a"), project=1)
    theirs = fake.add_job(SLUG, images(3, "b"), project=2)

    def scoped(projects: tuple[int, ...]) -> AntennaSource:
        client = client_of(fake)
        return AntennaSource(
            client,
            JobRotation(client, (SLUG,), 0.05, 100, projects),
            Reservations(fake.ttr_s, 60.0, 10, batch_size=10),
            reservation_size=10,
            wait_s=0.05,
            max_deliver=2,
        )

    got = await reserve_all(scoped((1,)), 6)  # asks for more than project 1 holds
    assert {d.handle.image_id for d in got} == {"a0", "a1", "a2"}  # (some twice: a TTR of 0.4 s)
    assert all(t.delivered == 0 for t in fake.jobs[theirs].tasks.values())  # untouched
    # A mistyped project is a refused listing, never every project's jobs: Antenna's
    # project_id alone would list them all (an id no project has filters nothing).
    typo = scoped((99,))
    assert await reserve_all(typo, 6) == []
    assert any(r[0] == "GET" and r[2] == 400 for r in fake.requests)
    everyone = await client_of(fake).get("jobs/", "jobs", {"project_id": 99, "limit": 10})
    assert {j["id"] for j in everyone.body["results"]} == {ours, theirs}
    assert all(t.delivered == 0 for t in fake.jobs[theirs].tasks.values())
    # Both projects named: both served, each listed on its own (project 1's tasks have had
    # their two deliveries by now).
    both = await reserve_all(scoped((1, 2)), 3)
    assert {d.handle.image_id for d in both} == {"b0", "b1", "b2"}


def parts_of(
    configured: Any, registry: CollectorRegistry | None = None, names: tuple[str, ...] = (SLUG,)
) -> AntennaParts:
    """The Antenna source's parts for ``configured`` serving ``names``, counting into metrics
    of their own."""
    served = SimpleNamespace(names=list(names), loaded=lambda _p: None)
    metrics = Metrics(registry or CollectorRegistry(), Liveness(30.0), "antenna")
    return AntennaParts(configured, served, {}, metrics)  # type: ignore[arg-type]


async def test_an_empty_fetch_waits_as_long_as_the_antenna_setting_says_not_the_nats_one(
    fake: FakeAntenna,
) -> None:
    # WORKER_ANTENNA__FETCH_WAIT_S is Antenna's own: WORKER_NATS__FETCH_TIMEOUT_S (which
    # once set both) tunes NATS only.
    antenna = {"base_url": fake.url, "token": TOKEN, "project_ids": "1", "poll_interval_s": 0.05}
    default = load_settings(for_worker=False, antenna=antenna)
    nats_only = load_settings(for_worker=False, antenna=antenna, nats={"fetch_timeout_s": 7.0})
    assert default.antenna.fetch_wait_s == nats_only.antenna.fetch_wait_s == 1.0
    registry = CollectorRegistry()
    configured = load_settings(
        for_worker=False,
        antenna={**antenna, "fetch_wait_s": 0.3},
        nats={"fetch_timeout_s": 7.0},
    )
    for settings_, wait_s in ((default, 1.0), (nats_only, 1.0), (configured, 0.3)):
        parts = parts_of(settings_, registry if settings_ is configured else None)
        try:
            assert parts.link.fetch_wait_s == wait_s
            if settings_ is configured:  # no job: the fetch gives nothing after the wait
                started = time.monotonic()
                assert await parts.source.fetch(4) == []
                assert 0.3 <= time.monotonic() - started < 3.0
        finally:
            parts.client.close()
    # The parts counted into the metrics they were made with (the jobs were listed)
    listed = registry.get_sample_value(
        "inference_worker_antenna_requests_total", {"endpoint": "jobs", "status": "200"}
    )
    assert listed is not None and listed >= 1


async def test_a_refused_project_is_named_and_the_other_projects_are_served(
    fake: FakeAntenna,
) -> None:
    # A mistyped, deleted or no longer permitted project id (Antenna answers 400 for it)
    # blocks none of the others: their jobs are served, and the refusal names the project
    # wherever the source's problems are said (/readyz, an unserved --until-idle).
    fake.add_job(SLUG, images(3, "a"), project=1)
    antenna = {"base_url": fake.url, "token": TOKEN, "project_ids": "1,99", "ttr_s": 0.5}
    configured = load_settings(for_worker=False, antenna={**antenna, "poll_interval_s": 0.05})
    parts = parts_of(configured)
    try:
        got = await reserve_all(parts.source, 3)
        assert {d.handle.image_id for d in got} == {"a0", "a1", "a2"}
        for said in (parts.problem(), parts.unserved()):
            assert said is not None and "project 99's jobs: HTTP 400" in said, said
            assert "WORKER_ANTENNA__PROJECT_IDS" in said and "project 1'" not in said
        waiting = antenna_waiting_read(parts.client, (SLUG,), 100, (1, 99))
        assert await waiting() == {SLUG: 3}  # project 1's, held ones included
        fake.projects[99] = {}  # the project exists now: listed, and the refusal is gone
        await parts.jobs.refresh()
        assert parts.jobs.refused_projects == {} and parts.problem() is None
    finally:
        parts.client.close()


def ids_only_listing(fake: FakeAntenna) -> None:
    """The fake's jobs list gives each job's ``id`` alone (an Antenna whose ids-only
    serializer left ``pipeline_slug`` out): a worker of several pipelines reads each job's page."""
    listed = fake._list

    def ids_alone(query: dict[str, str], user: Any = None) -> tuple[int, Any]:
        status, body = listed(query, user)
        return status, {**body, "results": [{"id": j["id"]} for j in body["results"]]}

    fake._list = ids_alone  # type: ignore[method-assign]


BAD_GATEWAY = {"status": 502, "body": b'{"detail": "Bad Gateway"}'}


async def test_a_job_whose_page_failed_once_is_asked_again_and_served(fake: FakeAntenna) -> None:
    """One 502 on a job's own page once made it 'not ours' for good: a burst run then stopped
    idle with the whole job unserved."""
    moths = fake.add_job(SLUG, images(2, "m"))
    ids_only_listing(fake)
    fake.misbehave("job", "json", times=1, **BAD_GATEWAY)
    rotation = JobRotation(client_of(fake), (SLUG, "orders"), 0.05, 100)
    with structlog.testing.capture_logs() as logs:
        assert await rotation.refresh() == []
    (said,) = [e for e in logs if e["event"] == "antenna_job_unread"]
    assert said["job_id"] == moths and "HTTP 502" in said["reason"], said
    assert "antenna_job_not_ours" not in [e["event"] for e in logs]
    await asyncio.sleep(0.06)  # its backoff: one poll interval
    assert [(j.id, j.pipeline) for j in await rotation.refresh()] == [(moths, SLUG)]
    assert rotation.unread() == {}


async def test_a_burst_run_would_end_idle_names_the_job_whose_page_was_never_read(
    fake: FakeAntenna,
) -> None:
    moths = fake.add_job(SLUG, images(2, "m"))
    ids_only_listing(fake)
    fake.misbehave("job", "json", **BAD_GATEWAY)
    antenna = {
        "base_url": fake.url,
        "token": TOKEN,
        "project_ids": "1",
        "poll_interval_s": 0.05,
        "fetch_wait_s": 0.05,
        "unreachable_wait_s": 0.5,
    }
    parts = parts_of(load_settings(for_worker=False, antenna=antenna), names=(SLUG, "orders"))
    try:
        assert await parts.source.fetch(4) == []
        assert not await parts.source.idle()  # asked again before the bound
        deadline = time.monotonic() + 30
        while not await parts.source.idle():
            assert await parts.source.fetch(4) == []
            assert time.monotonic() < deadline, "never idle"
        why = parts.unserved()
        assert why is not None and f"job(s) {moths} " in why and "HTTP 502" in why, why
        assert "WORKER_ANTENNA__UNREACHABLE_WAIT_S" in why
        asked = [r for r in fake.requests if r[1].endswith(f"/jobs/{moths}/")]
        assert len(asked) >= 2  # asked again, with backoff
    finally:
        parts.client.close()


async def test_antenna_answering_errors_to_every_listing_is_not_ready_until_one_answers(
    fake: FakeAntenna,
) -> None:
    # Antenna behind a working connection answering 500 to every job listing (its database
    # gone, say) finds no job: /readyz says so past the disconnect timeout, as it says a
    # timeout or a 503, and clears at the first listing that answers. /livez is not asked:
    # a restart of the worker mends nothing of Antenna's.
    antenna = {"base_url": fake.url, "token": TOKEN, "project_ids": "1"}
    configured = load_settings(
        for_worker=False, antenna=antenna, health={"disconnected_timeout_s": 0.2}
    )
    parts = parts_of(configured)
    fake.misbehave("jobs", "json", status=500, body=b'{"detail": "server error"}')
    try:
        await parts.jobs.refresh()
        assert parts.problem() is None, "one failed listing is not yet a problem"
        await asyncio.sleep(0.3)
        await parts.jobs.refresh()
        said = parts.problem()
        assert said is not None and "Antenna" in said and "500" in said, said
        fake.behave("jobs")
        await parts.jobs.refresh()
        assert parts.problem() is None
    finally:
        parts.client.close()


# -- register, check, settings --------------------------------------------------------------
async def test_register_says_what_each_refusal_means(fake: FakeAntenna) -> None:
    fake.projects[3] = {}
    fake.tokens["manager"] = {1}  # manages project 1 only (and is no superuser)
    ok = await register(client_of(fake, "manager"), [SERVED], [1], "svc")
    assert ok[0][0] and "already registered" in ok[0][1]  # the fixture registered it
    denied = await register(client_of(fake, "manager"), [SERVED], [3], "svc")
    missing = await register(client_of(fake), [SERVED], [42], "svc")
    bad_token = await register(client_of(fake, "nope"), [SERVED], [1], "svc")
    no_map = AntennaPipeline("x", "", (Algorithm("c2", "C2", "classification", "ef" * 32, ()),))
    unconfigured = AntennaPipeline("x", "", no_map.algorithms)
    config = unconfigured.config()
    del config["algorithms"][0]["category_map"]
    fake_reply = await client_of(fake).post(
        "projects/1/pipelines/",
        "register",
        json.dumps({"processing_service_name": "s", "pipelines": [config]}).encode(),
    )
    assert "403" in denied[0][1] and "may not change this project" in denied[0][1]
    assert "404" in missing[0][1] and "401" in bad_token[0][1]
    assert fake_reply.status == 500


async def test_check_names_an_unreachable_server_a_wrong_token_and_an_unknown_slug(
    fake: FakeAntenna,
) -> None:
    down = AntennaClient("http://127.0.0.1:9/api/v2", SecretStr(TOKEN), 2.0)
    assert "unreachable" in (await antenna_problems(down, [SLUG], [1], True))[0]
    bad = await antenna_problems(client_of(fake, "wrong-token-xyz"), [SLUG], [1], True)
    assert "401" in bad[0] and "wrong-token-xyz" not in bad[0]
    unknown = await antenna_problems(client_of(fake), ["not-registered"], [1], True)
    assert "'not-registered' is not registered" in unknown[0]
    assert await antenna_problems(client_of(fake), [SLUG], [1], True) == []
    fake.add_job(SLUG, images(1))
    fake.tokens["manager"] = {5}  # registers in project 5, may not post results in project 1
    (denied,) = await antenna_problems(client_of(fake, "manager"), [SLUG], [], True)
    assert "403" in denied and "may not take tasks or post results" in denied


async def test_check_says_a_token_that_may_not_reserve_is_not_ready_with_no_job_listed(
    fake: FakeAntenna,
) -> None:
    fake.tokens["member"] = {1}  # manages project 1, is no superuser: 403 on tasks and result
    assert await antenna_problems(client_of(fake), [SLUG], [1], True) == []  # a superuser
    (denied,) = await antenna_problems(client_of(fake, "member"), [SLUG], [1], True)
    assert "no superuser" in denied and "may not take tasks or post results" in denied


async def test_a_scheme_antenna_does_not_take_is_named_not_the_token_or_superuser(
    fake: FakeAntenna,
) -> None:
    """``Api-Key`` against Antenna's main (``Token`` alone): it lists for nobody and answers
    posts "credentials were not provided"; every message once blamed the token, and check said
    "no superuser permissions"."""
    api_key = AntennaClient(fake.url, SecretStr(TOKEN), 5.0, scheme="Api-Key")
    for said in (
        await antenna_problems(api_key, [SLUG], [1], True),  # no job listed: the listing
        [meaning(await api_key.post("projects/1/pipelines/", "register", b"{}"))],
    ):
        (line,) = said
        assert "WORKER_ANTENNA__AUTH_SCHEME" in line and "'Api-Key'" in line, line
        assert "superuser" not in line and "refuses the token" not in line, line
        assert TOKEN not in line
    job = fake.add_job(SLUG, images(1))
    (posting,) = await antenna_problems(api_key, [SLUG], [1], True)  # a job: its result post
    assert "WORKER_ANTENNA__AUTH_SCHEME" in posting and "refuses the token" not in posting
    reserved = await api_key.post(f"jobs/{job}/tasks/", "tasks", b'{"batch_size": 1}')
    assert reserved.status == 401 and "WORKER_ANTENNA__AUTH_SCHEME" in reserved.why()
    (wrong_key,) = await antenna_problems(client_of(fake, "nope"), [SLUG], [1], True)
    assert "AUTH_SCHEME" not in wrong_key  # a key Antenna does not know is the key's fault


async def test_check_asks_about_posting_results_only_of_its_own_projects_jobs(
    fake: FakeAntenna,
) -> None:
    fake.projects[2] = {}
    fake.register_direct(2, SERVED.config())
    theirs = fake.add_job(SLUG, images(1, "b"), project=2)  # listed first without a project

    def posted_to() -> set[str]:
        return {path for method, path, _ in fake.requests if method == "POST"}

    fake.tokens["member"] = {1}  # no superuser: told so from the listing, with no job of ours
    (denied,) = await antenna_problems(client_of(fake, "member"), [SLUG], [1], True)
    assert "no superuser" in denied and posted_to() == set()
    ours = fake.add_job(SLUG, images(1, "a"), project=1)
    assert await antenna_problems(client_of(fake), [SLUG], [1], True) == []
    assert posted_to() == {f"/api/v2/jobs/{ours}/result/"}, (ours, theirs)


async def test_a_404_outside_the_api_is_one_line_without_its_html(fake: FakeAntenna) -> None:
    wrong = AntennaClient(fake.url.replace("/api/v2", "/ami/api/v2"), SecretStr(TOKEN), 5.0)
    ((ok, line),) = await register(wrong, [SERVED], [1], "svc")
    (problem,) = await antenna_problems(wrong, [SLUG], [1], True)
    for said in (line, problem):
        assert "HTTP 404" in said and "base URL" in said
        assert "<" not in said and "\n" not in said and "Not Found" not in said
    assert not ok


async def test_jobs_listed_twice_for_a_token_not_a_superusers_are_rotated_once(
    fake: FakeAntenna,
) -> None:
    first, second = fake.add_job(SLUG, images(1, "a")), fake.add_job(SLUG, images(1, "b"))
    fake.tokens["member"] = {1}
    listed = await client_of(fake, "member").get(
        "jobs/", "jobs", {"pipeline__slug__in": SLUG, "ids_only": 1, "limit": 10}
    )
    assert sorted(j["id"] for j in listed.body["results"]) == [first, first, second, second]
    rotation = JobRotation(client_of(fake, "member"), (SLUG,), 10.0, 100)
    assert [j.id for j in await rotation.refresh()] == [first, second]
    assert [j.id for j in rotation.next_jobs()] == [first, second]


async def test_every_page_of_active_jobs_is_listed_and_no_job_page_is_asked(
    fake: FakeAntenna,
) -> None:
    ids = [fake.add_job(SLUG, images(1, f"j{n}-")) for n in range(25)]
    fake.jobs[ids[3]].status = "PENDING"
    fake.jobs[ids[7]].status = "RETRY"
    rotation = JobRotation(client_of(fake), (SLUG,), 10.0, 10)
    active = await rotation.refresh()
    assert [j.id for j in active] == [i for i in ids if i != ids[3]]
    assert not [p for _m, p, _s in fake.requests if p.rstrip("/").split("/")[-1].isdigit()]
    lists = [p for _m, p, _s in fake.requests if p == "/api/v2/jobs/"]
    assert len(lists) == 3 + 1  # STARTED: 24 jobs in pages of 10; RETRY: one page


def test_amis_names_are_aliases_and_ours_win() -> None:
    environ = {
        "AMI_ANTENNA_API_AUTH_TOKEN": "t1",
        "AMI_NUM_WORKERS": "3",
        "WORKER_LOADER__NUM_WORKERS": "2",
    }
    overrides, used = alias_overrides(environ, {"AMI_ANTENNA_API_BASE_URL": "http://h/api/v2"})
    assert overrides == {"antenna": {"token": "t1", "base_url": "http://h/api/v2"}}
    assert "WORKER_LOADER__NUM_WORKERS set, AMI_NUM_WORKERS ignored" in used
    assert "WORKER_ANTENNA__TOKEN from AMI_ANTENNA_API_AUTH_TOKEN" in used


def test_the_token_never_shows_in_the_settings() -> None:
    from config.settings import load_settings

    s = load_settings(for_worker=False, antenna={"token": "very-secret-1"})
    assert "very-secret-1" not in repr(s) and "very-secret-1" not in str(s.model_dump())
    assert s.antenna.token.get_secret_value() == "very-secret-1"


def test_the_delivery_count_is_read_from_the_reply_subject() -> None:
    assert delivered_of("$JS.ACK.job_1.job-1-consumer.2.3.4.1796116976120792999.0", 2) == 2
    assert delivered_of("$JS.ACK.dom.acc.job_1.c.1.3.4.179.0.x", 2) == 1
    assert delivered_of("not-a-subject", 2) == 2  # unknown: treated as the last


def test_nothing_more_is_reserved_while_the_oldest_reservation_is_late() -> None:
    from worker.antenna.reservations import Reservation

    reservations = Reservations(ttr_s=10.0, finish_within_s=5.0, first_size=4, batch_size=4)
    assert reservations.allowed() == 4

    def reserved(age_s: float) -> Reservation:
        at = time.monotonic() - age_s
        delivery = Reservation(1, SLUG, "i", "r", at, at + 10, reservations.settled)
        reservations.add(delivery)
        return delivery

    reserved(age_s=0.0)
    assert reservations.allowed() == 3  # within finish_within_s: the first size, less one
    reserved(age_s=6.0)  # reserved 6 s ago: past finish_within_s
    assert reservations.allowed() == 0 and reservations.oldest_seconds_left() < 5


def test_a_rate_too_slow_for_finish_within_still_reserves_a_batch_with_nothing_held() -> None:
    """Given a rate measured that finishes less than one task within ``finish_within_s``
    (a slow result post), a process holding nothing still reserves the batch's worth, and
    nothing behind what it holds; the rate follows faster work again, and waiting with
    nothing held does not lower it."""
    from worker.antenna.reservations import Reservation

    reservations = Reservations(ttr_s=0.2, finish_within_s=0.05, first_size=4, batch_size=4)

    def reserved() -> Reservation:
        at = time.monotonic()
        delivery = Reservation(1, SLUG, "i", "r", at, at + 0.2, reservations.settled)
        reservations.add(delivery)
        return delivery

    held = [reserved() for _ in range(4)]
    time.sleep(0.25)  # 4 tasks over at least 0.25 s held: at most 0.8 of one within 0.05 s
    for delivery in held:
        reservations.settled(delivery, posted=True)
    slow = reservations.rate_per_s()
    assert slow is not None and slow * reservations.finish_within_s < 1
    assert reservations.allowed() == 4  # nothing held: the batch's worth (it used to be 0)
    time.sleep(0.1)  # nothing held: no busy time, the rate stays as it was
    assert reservations.rate_per_s() == slow and reservations.allowed() == 4
    one = reserved()
    assert reservations.allowed() == 0  # nothing more behind what is held
    reservations.settled(one, posted=True)
    for _ in range(20):  # faster work: batches settled at once
        for delivery in [reserved() for _ in range(4)]:
            reservations.settled(delivery, posted=True)
    reserved()
    assert reservations.allowed() > 0  # the rate recovered: more may queue behind one


def test_a_reservation_size_over_the_batch_reserves_one_batch_with_nothing_held() -> None:
    """Given WORKER_ANTENNA__RESERVATION_SIZE 64, batches of 8 and a measured rate that
    finishes less than one task within ``finish_within_s``, a process holding nothing reserves
    one batch (8), not 64 that would run past their TTR and lose a delivery each; it says once
    that the floor overrides the rate."""
    from worker.antenna.reservations import Reservation

    reservations = Reservations(ttr_s=0.2, finish_within_s=0.05, first_size=64, batch_size=8)
    assert reservations.allowed() == 64  # no rate measured yet: the reservation size

    def reserved() -> Reservation:
        at = time.monotonic()
        delivery = Reservation(1, SLUG, "i", "r", at, at + 0.2, reservations.settled)
        reservations.add(delivery)
        return delivery

    held = [reserved() for _ in range(2)]
    time.sleep(0.1)  # 2 tasks over at least 0.1 s held: at most 1 within 0.05 s
    for delivery in held:
        reservations.settled(delivery, posted=True)
    slow = reservations.rate_per_s()
    assert slow is not None and slow * reservations.finish_within_s < 8
    with structlog.testing.capture_logs() as logs:
        assert reservations.allowed() == 8  # nothing held: one batch, not the 64
        assert reservations.allowed() == 8
    (said,) = [e for e in logs if e["event"] == "antenna_reservation_floor"]
    assert said["log_level"] == "info" and said["floor"] == 8
    assert said["rate_per_s"] == round(slow, 3) and said["finish_within_s"] == 0.05


def test_the_antenna_source_needs_a_base_url_and_full_score_vectors() -> None:
    from config.errors import ConfigError
    from config.settings import load_settings

    with pytest.raises(ConfigError) as refused:
        load_settings(for_worker=False, source="antenna", model={"scores": "top_k"})
    lines = str(refused.value).splitlines()
    assert any("WORKER_ANTENNA__BASE_URL" in line for line in lines)
    assert any("WORKER_MODEL__SCORES=all" in line for line in lines)
    with pytest.raises(ConfigError, match="WORKER_HEALTH__DRAIN_TIMEOUT_S"):
        load_settings(
            for_worker=False, source="antenna", antenna={"base_url": "http://h/api/v2", "ttr_s": 10}
        )


async def test_a_burst_run_is_not_idle_the_moment_it_settles_its_own_last_task() -> None:
    """The wait for tasks left out by others counts only while this process holds none: a
    job still listed a moment after our last post is not 'tasks out elsewhere'."""
    fake = FakeAntenna(token=TOKEN, ttr_s=60.0)
    fake.register_direct(1, SERVED.config())
    with fake.running():
        fake.add_job(SLUG, images(3))
        source = source_of(fake, idle_wait_s=0.5)
        held = await reserve_all(source, 3)
        deadline = time.monotonic() + 0.8
        while time.monotonic() < deadline:  # rounds that give nothing while ours are held
            assert await source.fetch(3) == []
        assert not await source.idle()
        for delivery in held:
            delivery.handle.posted()
        assert not await source.idle(), "idle at once: the wait counted our own held time"
        assert source.still_out() is None


async def test_nothing_is_reserved_from_jobs_of_a_pipeline_that_cannot_be_loaded_here(
    fake: FakeAntenna,
) -> None:
    # "orders"' models cannot be loaded on this host: what it reserved could only be left to
    # redelivery (a delivery of two spent), so its job is not asked at all; "moths" serves.
    orders = fake.add_job("orders", images(3, "o"))
    moths = fake.add_job(SLUG, images(3, "m"))
    client = client_of(fake)
    source = AntennaSource(
        client,
        JobRotation(client, (SLUG, "orders"), 0.05, 100),
        Reservations(fake.ttr_s, 60.0, 10, batch_size=10),
        reservation_size=10,
        wait_s=0.05,
        max_deliver=2,
    )
    got: list[Any] = []
    for _ in range(4):
        got += await source.fetch(10, available=lambda pipeline: pipeline != "orders")
    assert {task_of(d).image_id for d in got} == {"m0", "m1", "m2"}
    asked = {path for method, path, _ in fake.requests if method == "POST"}
    assert f"/api/v2/jobs/{moths}/tasks/" in asked
    assert f"/api/v2/jobs/{orders}/tasks/" not in asked
    assert fake.pending(orders) == {"o0", "o1", "o2"}
