"""Settling a task on Antenna (`worker.antenna.settle`, `post`): the core's verdict carried
out as a result post, split under the cap, what Antenna drops, against the fake Antenna."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import structlog

from tests.antenna_fake import FakeAntenna
from tests.unit.antenna.common import (
    CLASSIFIER,
    SLUG,
    client_of,
    detection,
    images,
    outcome,
    reserve_all,
    rules_of,
    source_of,
    task_of,
)
from worker.antenna.render import (
    AntennaPipeline,
    antenna_key,
)
from worker.core.outcome import Outcome
from worker.core.results import ResultMaker
from worker.core.verdicts import NO_BACKOFF, decide


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
