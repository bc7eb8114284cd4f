from __future__ import annotations

import json
import re

import pytest

from config.errors import InvalidTask, Undeliverable
from tests.fakes import result_document
from worker.core.tasks import Task, parse_task
from worker.nats.subjects import (
    result_subject,
    subject_job,
    subject_pipeline,
    subject_token,
    token_value,
)


def on_subject(data: bytes, subject: str) -> Task:
    """The task as the NATS source reads it from ``subject`` (its pipeline and job)."""
    return parse_task(data, pipeline=subject_pipeline(subject), job_id=subject_job(subject))


TASK = {"id": "t1", "job_id": "j1", "image_id": "i1", "image_url": "s3://b/k.jpg"}


def test_a_task_shaped_like_antennas_parses():
    task = parse_task(json.dumps({**TASK, "config": {"top_k": 2}}).encode())
    assert (task.id, task.job_id, task.image_id, task.image_url) == (
        "t1",
        "j1",
        "i1",
        "s3://b/k.jpg",
    )
    assert task.config == {"top_k": 2}


def test_an_antenna_task_takes_its_job_from_the_subject_and_keeps_its_reply_subject():
    antenna = {"id": 17, "image_id": "42", "image_url": "https://x/a.jpg", "reply_subject": "r.1"}
    task = on_subject(json.dumps(antenna).encode(), "tasks.moths.1234")
    assert (task.id, task.job_id, task.reply_subject) == ("17", "1234", "r.1")


@pytest.mark.parametrize("job", ["job 7/ü", "b64-x", "a" * 128, "x" * 95 + "/", "ü" * 128])
def test_a_job_encoded_into_a_subject_token_is_read_back(job):
    assert token_value(subject_token(job)) == job
    task = on_subject(
        json.dumps({"id": "t", "image_id": "i", "image_url": "s3://b/k"}).encode(),
        f"tasks.p.{subject_token(job)}",
    )
    assert task.job_id == job


def test_a_task_without_a_job_in_payload_or_subject_is_undeliverable():
    with pytest.raises(Undeliverable, match="job_id"):
        on_subject(
            json.dumps({"id": "t", "image_id": "i", "image_url": "s3://b/k"}).encode(), "tasks.p"
        )


def test_a_job_id_that_contradicts_the_subject_gets_an_error_result_under_the_subjects_job():
    with pytest.raises(InvalidTask, match="differs") as refused:
        on_subject(json.dumps(TASK).encode(), "tasks.p.other-job")
    assert refused.value.job_id == "other-job"
    assert on_subject(json.dumps(TASK).encode(), "tasks.p.j1").job_id == "j1"  # agreeing is fine


@pytest.mark.parametrize("reply", ["has space", "", 7, "x" * 1025, "line\nbreak"])
def test_a_reply_subject_that_is_not_one_subject_gives_an_invalid_task(reply):
    with pytest.raises(InvalidTask, match="reply_subject"):
        parse_task(json.dumps({**TASK, "reply_subject": reply}).encode())


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[1,2]",
        b"\xff\xfe",
        json.dumps({"id": "t"}).encode(),
        json.dumps({"job_id": "j", "image_url": "s3://b/k"}).encode(),
    ],
)
def test_messages_that_cannot_name_job_and_task_are_undeliverable(data):
    with pytest.raises(Undeliverable):
        parse_task(data)


@pytest.mark.parametrize(
    "change", [{"image_url": None}, {"image_url": "ftp://x/y"}, {"image_id": None}, {"config": [1]}]
)
def test_tasks_that_name_themselves_but_are_invalid_keep_their_ids(change):
    with pytest.raises(InvalidTask) as invalid:
        parse_task(json.dumps({**TASK, **change}).encode())
    assert (invalid.value.task_id, invalid.value.job_id) == ("t1", "j1")


def test_numeric_ids_are_accepted_as_strings():
    task = parse_task(json.dumps({**TASK, "id": 17, "job_id": 4}).encode())
    assert (task.id, task.job_id) == ("17", "4")


@pytest.mark.parametrize(
    "value", ["plain-id_1", "has.dot", "has space", "b64-looks-encoded", "ü*>", "a" * 300]
)
def test_subject_tokens_are_valid_and_distinct(value):
    token = subject_token(value)
    assert re.fullmatch(r"[A-Za-z0-9_-]+", token)
    others = {
        subject_token(v)
        for v in ["plain-id_1", "has.dot", "has space", "b64-looks-encoded", "ü*>"]
        if v != value
    }
    assert token not in others


def test_each_task_has_its_own_result_subject():
    assert result_subject("job.1", "t 1") != result_subject("job.1", "t 2")
    assert result_subject("j", "t").split(".") == ["results", "j", "t"]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (json.dumps({**TASK, "id": "x" * 5000}).encode(), "over the cap"),
        (b'{"id": "\\ud800", "job_id": "j", "image_id": "i", "image_url": "s3://b/k"}', "Unicode"),
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        (b'{"id": ' + b"9" * 5000 + b', "job_id": "j"}', "not JSON"),
        (json.dumps({**TASK, "id": 10**300}).encode(), "longer than 256 bytes"),
        (json.dumps({**TASK, "job_id": True}).encode(), "job_id"),
        (json.dumps({**TASK, "id": 1.5}).encode(), "'id'"),
        (json.dumps({**TASK, "id": ["t"]}).encode(), "'id'"),
        (b"\x80\x81\x82{", "not JSON"),
    ],
)
def test_ids_too_long_not_unicode_or_not_ids_are_dead_lettered_with_a_reason(data, why):
    with pytest.raises(Undeliverable, match=why):
        parse_task(data)


def test_an_integer_id_and_its_decimal_string_are_the_same_task():
    as_int = parse_task(json.dumps({**TASK, "id": 17}).encode())
    as_str = parse_task(json.dumps({**TASK, "id": "17"}).encode())
    padded = parse_task(json.dumps({**TASK, "id": " 17"}).encode())
    assert result_subject(as_int.job_id, as_int.id) == result_subject(as_str.job_id, as_str.id)
    assert result_subject(padded.job_id, padded.id) != result_subject(as_str.job_id, as_str.id)


def test_result_subjects_are_injective_where_joining_by_hand_is_not():
    assert result_subject("J/x", "y") != result_subject("J", "x/y")
    assert result_subject("J.x", "y") != result_subject("J", "x.y")
    assert result_subject("a", "b-c") != result_subject("a-b", "c")


@pytest.mark.parametrize("value", ["x\n", "x\r\n", "tab\there", "é", "b64-abc", "a" * 129])
def test_ids_that_are_not_plain_tokens_are_encoded_into_valid_subject_tokens(value):
    token = subject_token(value)
    assert re.fullmatch(r"[A-Za-z0-9_-]+", token) and token.startswith("b64-")


def test_the_longest_ids_still_make_a_subject_the_server_accepts():
    longest = "\U0001f600" * 64  # 256 bytes of UTF-8, the cap
    task = parse_task(json.dumps({**TASK, "id": longest, "job_id": longest}).encode())
    assert len(result_subject(task.job_id, task.id)) < 1024


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"image_url": "s3://b/" + "k" * 9000}, "over 8192"),
        ({"image_id": "i" * 2000}, "image_id"),
        ({"image_id": {"a": 1}}, "image_id"),
    ],
)
def test_fields_over_their_caps_give_an_invalid_task_naming_the_field(change, why):
    with pytest.raises(InvalidTask, match=why) as invalid:
        parse_task(json.dumps({**TASK, **change}).encode())
    assert invalid.value.task_id == "t1"


def test_an_invalid_url_is_named_without_its_query_string():
    url = "ftp://host/key.jpg?X-Amz-Signature=SECRETSIG&X-Amz-Credential=AKIA"
    with pytest.raises(InvalidTask) as invalid:
        parse_task(json.dumps({**TASK, "image_url": url}).encode())
    assert "ftp://host/key.jpg" in str(invalid.value)
    assert "SECRETSIG" not in str(invalid.value) and "AKIA" not in str(invalid.value)


@pytest.mark.parametrize(
    ("subject", "pipeline"),
    [("tasks.moths.j", "moths"), ("tasks.orders", "orders"), ("elsewhere", "")],
)
def test_a_task_knows_the_pipeline_its_subject_names(subject, pipeline):
    data = json.dumps({"id": "t", "job_id": "j", "image_id": "i", "image_url": "s3://b/k"})
    assert on_subject(data.encode(), subject).pipeline == pipeline


def test_total_time_is_the_tasks_time_not_a_sum_of_overlapping_timings():
    task = Task("t", "j", "i", "s3://b/k")
    result = result_document(task, [], {"load_s": 0.2, "infer_s": 0.3, "total_s": 0.6})
    assert result["response"]["total_time"] == 0.6


@pytest.mark.parametrize("config", [0, [], "", False, "{}"])
def test_a_config_that_is_not_an_object_gives_an_invalid_task_even_when_falsy(config):
    with pytest.raises(InvalidTask, match="'config' must be a JSON object"):
        parse_task(json.dumps({**TASK, "config": config}).encode())


def test_a_null_config_is_no_config():
    assert parse_task(json.dumps({**TASK, "config": None}).encode()).config == {}


def test_an_integer_id_is_capped_by_its_decimal_bytes_as_a_string_is():
    longest_positive, longest_negative = 10**256 - 1, -(10**255 - 1)  # 256 bytes each
    assert parse_task(json.dumps({**TASK, "id": longest_positive}).encode()).id == "9" * 256
    assert parse_task(json.dumps({**TASK, "id": longest_negative}).encode()).id == "-" + "9" * 255
    for too_long in (10**256, -(10**255)):  # 257 bytes
        with pytest.raises(Undeliverable, match="longer than 256 bytes"):
            parse_task(json.dumps({**TASK, "id": too_long}).encode())
