"""Delivery rules when the store or the dead-letter stream says no (in-memory fakes)."""

from __future__ import annotations

import pytest

from config.settings import NatsSettings
from tests.fakes import FakeJetStream, FakeMsg, FakeStore
from worker.outcome import Outcome
from worker.schemas import Task
from worker.settle import Settler


def settler(store: FakeStore, js: FakeJetStream, max_deliver: int = 2) -> Settler:
    nats_settings = NatsSettings(store_retry_s=0.0, nak_backoff_base_s=0.01)
    return Settler(js, store, nats_settings, "p", {"name": "m"}, max_deliver)  # type: ignore[arg-type]


TASK = Task("t", "j", "i", "s3://b/k")
BIG = Outcome(detections=[{"bbox": None, "note": "x" * 5000}])


async def test_a_result_too_large_to_store_becomes_a_small_error_result_once():
    store, msg = FakeStore(refuse_over_bytes=2000), FakeMsg()
    outcome = await settler(store, FakeJetStream()).settle(TASK, msg, 1, BIG)
    assert outcome == "error" and msg.actions == ["ack"]
    assert [r["error"]["type"] for r in store.stored] == ["result_too_large"]


async def test_a_task_no_result_fits_for_is_dead_lettered_not_retried_forever():
    store, js, msg = FakeStore(refuse_over_bytes=10), FakeJetStream(), FakeMsg()
    outcome = await settler(store, js).settle(TASK, msg, 1, BIG)
    assert outcome == "dead_lettered" and msg.actions == ["term"]
    ((subject, _data, headers),) = js.published
    assert subject == "dead.tasks" and headers["Nats-Msg-Id"] == "dead-INFERENCE_TASKS-7"


async def test_a_dead_letter_the_stream_did_not_confirm_is_given_back_never_terminated():
    msg = FakeMsg(delivered=2)  # the last delivery: the advisory handler takes it from here
    outcome = await settler(FakeStore(), FakeJetStream(fail=True)).dead_letter(msg, "not JSON")
    assert outcome == "retried" and msg.actions == ["nak"]


async def test_a_failed_term_after_a_stored_dead_letter_is_logged_not_raised():
    js, msg = FakeJetStream(), FakeMsg(fail_term=True)
    assert await settler(FakeStore(), js).dead_letter(msg, "not JSON") == "dead_lettered"
    assert len(js.published) == 1


@pytest.mark.parametrize("reason", ["line\r\nInjected: header", "x" * 5000])
async def test_dead_letter_headers_are_one_capped_line(reason):
    js = FakeJetStream()
    await settler(FakeStore(), js).dead_letter(FakeMsg(), reason)
    value = js.published[0][2]["Worker-Reason"]
    assert "\n" not in value and "\r" not in value and len(value) <= 1000


async def test_a_dead_letter_of_a_message_near_max_payload_is_cut_to_fit_with_its_size_said():
    js, huge = FakeJetStream(), FakeMsg(data=b"x" * (1024 * 1024 - 10))
    assert await settler(FakeStore(), js).dead_letter(huge, "not JSON") == "dead_lettered"
    ((_subject, data, headers),) = js.published
    assert len(data) <= 1024 * 1024 - 4096
    assert headers["Worker-Truncated-From-Bytes"] == str(len(huge.data))


TASK_BYTES = b'{"id": "t", "job_id": "j", "image_id": "i", "image_url": "s3://b/k.jpg"}'


async def test_a_task_whose_deliveries_ran_out_with_its_worker_gets_one_error_result():
    store = FakeStore()
    done = await settler(store, FakeJetStream()).exhausted(TASK_BYTES, "tasks.p", 7, 5)
    assert done
    ((result,),) = [store.stored]
    assert result["task_id"] == "t" and result["attempt"] == 5
    assert result["error"]["type"] == "deliveries_exhausted"
    assert "all 5 deliveries ended without a result" in result["error"]["message"]


async def test_an_exhausted_message_without_ids_is_dead_lettered_and_an_outage_asks_again():
    store, js = FakeStore(), FakeJetStream()
    assert await settler(store, js).exhausted(b"not json", "tasks.p", 7, 5)
    assert [subject for subject, _, _ in js.published] == ["dead.tasks"] and store.stored == []
    down = FakeStore(unavailable=True)
    assert not await settler(down, FakeJetStream()).exhausted(TASK_BYTES, "tasks.p", 7, 5)
    assert not await settler(store, FakeJetStream(fail=True)).exhausted(b"x", "tasks.p", 7, 5)
