"""The NATS source's delivery rules when the store or the dead-letter stream says no
(in-memory fakes)."""

from __future__ import annotations

import pytest

from config.errors import Failure, ResultsUnavailable
from pipelines.found import Detection, Ref
from tests.fakes import FakeJetStream, FakeMsg, FakeStore, delivery, model_of, nats_settler
from worker.core.outcome import Outcome
from worker.core.results import ResultMaker
from worker.core.tasks import Task
from worker.core.verdicts import Backoff, Decision, Verdict
from worker.nats.settle import NatsSettler


def settler(store: FakeStore, js: FakeJetStream, store_retry_s: float = 0.0) -> NatsSettler:
    return nats_settler(store, js, store_retry_s=store_retry_s)


async def keep(settler: NatsSettler, msg: FakeMsg, outcome: Outcome) -> str:
    """The core's verdict "keep this result" for ``msg``'s task; what the settler did."""
    result = ResultMaker(model_of).make(TASK, msg.delivered, outcome)
    return (await settler.settle(delivery(msg), Verdict.keep(result))).kept.value


async def dead_letter(settler: NatsSettler, msg: FakeMsg, reason: str) -> str:
    """The core's verdict on a message that names no task; what the settler did."""
    verdict = Verdict(Decision.UNNAMED, reason=reason)
    return (await settler.settle(delivery(msg), verdict)).kept.value


TASK = Task("t", "j", "i", "s3://b/k", pipeline="p")
BIG = Outcome(detections=[Detection(None, 0.0, Ref("x" * 5000, "big"), "2026-12-01T00:00:00")])


async def test_a_result_too_large_to_store_becomes_a_small_error_result_once():
    store, msg = FakeStore(refuse_over_bytes=2000), FakeMsg()
    outcome = await keep(settler(store, FakeJetStream()), msg, BIG)
    assert outcome == "error" and msg.actions == ["ack"]
    assert [r["error"]["type"] for r in store.stored] == ["result_too_large"]


async def test_a_task_no_result_fits_for_is_dead_lettered_not_retried_forever():
    store, js, msg = FakeStore(refuse_over_bytes=10), FakeJetStream(), FakeMsg()
    outcome = await keep(settler(store, js), msg, BIG)
    assert outcome == "dead_lettered" and msg.actions == ["term"]
    ((subject, _data, headers),) = js.published
    assert subject == "dead.tasks" and headers["Nats-Msg-Id"] == "dead-INFERENCE_TASKS-7"


async def test_a_dead_letter_the_stream_did_not_confirm_is_given_back_never_terminated():
    msg = FakeMsg(delivered=2)  # the last delivery: the advisory handler takes it from here
    outcome = await dead_letter(settler(FakeStore(), FakeJetStream(fail=True)), msg, "not JSON")
    assert outcome == "retried" and msg.actions == ["nak"]


async def test_a_failed_term_after_a_stored_dead_letter_is_logged_not_raised():
    js, msg = FakeJetStream(), FakeMsg(fail_term=True)
    assert await dead_letter(settler(FakeStore(), js), msg, "not JSON") == "dead_lettered"
    assert len(js.published) == 1


@pytest.mark.parametrize("reason", ["line\r\nInjected: header", "x" * 5000])
async def test_dead_letter_headers_are_one_capped_line(reason):
    js = FakeJetStream()
    await dead_letter(settler(FakeStore(), js), FakeMsg(), reason)
    value = js.published[0][2]["Worker-Reason"]
    assert "\n" not in value and "\r" not in value and len(value) <= 1000


async def test_a_dead_letter_of_a_message_near_max_payload_is_cut_to_fit_with_its_size_said():
    js, huge = FakeJetStream(), FakeMsg(data=b"x" * (1024 * 1024 - 10))
    assert await dead_letter(settler(FakeStore(), js), huge, "not JSON") == "dead_lettered"
    ((_subject, data, headers),) = js.published
    assert len(data) <= 1024 * 1024 - 4096
    assert headers["Worker-Truncated-From-Bytes"] == str(len(huge.data))


def test_nak_backoff_doubles_up_to_the_cap():
    assert [Backoff(2, 60).delay_s(n) for n in (1, 2, 3, 4, 5, 6)] == [2, 4, 8, 16, 32, 60]


class FlakyStore(FakeStore):
    """A store that does not confirm its first ``failures`` writes."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def store(self, result):
        if self.failures:
            self.failures -= 1
            raise ResultsUnavailable("results stream unavailable: timeout")
        return await super().store(result)


async def test_a_result_the_store_did_not_confirm_is_retried_in_process_before_any_nak():
    store, msg = FlakyStore(failures=3), FakeMsg()
    outcome = await keep(
        settler(store, FakeJetStream(), store_retry_s=2.0), msg, Outcome(detections=[])
    )
    assert outcome == "ok"
    assert msg.actions == ["ack"] and len(store.stored) == 1


async def test_a_store_down_past_store_retry_s_gives_the_task_back_with_a_nak():
    down, msg = FlakyStore(failures=1000), FakeMsg()
    outcome = await keep(
        settler(down, FakeJetStream(), store_retry_s=0.5), msg, Outcome(detections=[])
    )
    assert outcome == "retried"
    assert msg.actions == ["nak"] and down.stored == []


class RefusingStore(FakeStore):
    """A store that already holds every task's result, after ``unconfirmed`` writes it did
    not confirm (their PubAck lost: the first of them was stored)."""

    def __init__(self, unconfirmed: int = 0) -> None:
        super().__init__()
        self.unconfirmed = unconfirmed

    async def store(self, result):
        if self.unconfirmed:
            self.unconfirmed -= 1
            raise ResultsUnavailable("results stream unavailable: timeout")
        return False


async def test_a_second_completion_of_a_task_is_counted_and_acked_and_its_result_not_written():
    doubled: list[None] = []
    rules = settler(RefusingStore(), FakeJetStream())
    rules.completed_twice = lambda: doubled.append(None)
    msg = FakeMsg()
    assert await keep(rules, msg, Outcome(detections=[])) == "ok"
    assert msg.actions == ["ack"] and doubled == [None]


async def test_our_own_write_found_stored_on_a_retry_is_not_a_second_completion():
    doubled: list[None] = []
    rules = settler(RefusingStore(unconfirmed=1), FakeJetStream(), store_retry_s=2.0)
    rules.completed_twice = lambda: doubled.append(None)
    msg = FakeMsg()
    assert await keep(rules, msg, Outcome(detections=[])) == "ok"
    assert msg.actions == ["ack"] and doubled == []


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


async def test_a_result_too_large_on_the_last_delivery_says_why_it_is_smaller_not_ran_out():
    """The small error result that replaces one the stream refuses says its own failure:
    the task's transient failure ran out, but the stored result is not that one."""
    store, msg = FakeStore(refuse_over_bytes=1000), FakeMsg(delivered=2)  # its message: capped
    slow = Failure("loader_timeout", "x" * 3000, retryable=True)
    result = ResultMaker(model_of).make(TASK, 2, Outcome(failure=slow), ran_out=True)
    settled = await settler(store, FakeJetStream()).settle(delivery(msg), Verdict.keep(result))
    assert settled.kept.value == "error" and msg.actions == ["ack"]
    (stored,) = store.stored
    assert stored["error"]["type"] == "result_too_large"
    assert stored["error"]["message"].startswith("the result could not be stored")
