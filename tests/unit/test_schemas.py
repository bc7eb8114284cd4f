from __future__ import annotations

import json
import re

import pytest

from worker.results import result_subject
from worker.schemas import InvalidTask, Undeliverable, parse_task, subject_token

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
