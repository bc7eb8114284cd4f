"""Fuzz: generated task messages against a real worker process, nats-server and S3 endpoint.

Every message must end in exactly one outcome (a stored result, or a dead letter naming its
sequence), the worker's pid never changes, its NATS connection stays up, the consumer drains,
nothing secret reaches a result or a log line, no refused URL reaches the network, and a
normal task published after the poison gets its result.

Bounded in CI (``FUZZ_EXAMPLES``, default 12 generated batches); run longer by hand with e.g.
``FUZZ_EXAMPLES=300 .venv/bin/python -m pytest tests/integration/test_fuzz.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.js.errors import NotFoundError

from tests.helpers import client, upload_images, wait_http, worker_env, worker_process
from tests.listeners import Listener
from worker.commands.localservers import free_port
from worker.nats.subjects import result_subject

pytestmark = pytest.mark.integration
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "12"))
SECRET = "FUZZSECRET42"
AWS_SECRET = "fuzz-aws-secret-9f8e7d"
ACCOUNTED_WAIT_S = 90.0


def json_values() -> st.SearchStrategy:
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40)
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
        max_leaves=12,
    )


def ids() -> st.SearchStrategy:
    return (
        st.text(max_size=20)
        | st.text(alphabet=st.characters(codec=None), min_size=1, max_size=300)
        | st.integers()
        | st.sampled_from(["x\n", "J/x", "x/y", ".", "*", ">", "b64-AAAA", "a" * 400, ""])
        | json_values()
    )


def urls(image: str, listener_port: int, endpoint: str) -> st.SearchStrategy:
    bucket_url = image.rsplit("/", 1)[0]
    fixed = st.sampled_from(
        [
            image,
            f"{bucket_url}/missing.jpg",
            "s3://",
            "s3://no-such-bucket/k.jpg",
            "file:///proc/self/environ",
            "file:///dev/zero",
            "file:///etc/passwd",
            "file://otherhost/x.jpg",
            f"http://127.0.0.1:{listener_port}/x.jpg?X-Amz-Signature={SECRET}",
            f"http://localhost:{listener_port}/x.jpg",
            f"http://[::1]:{listener_port}/x.jpg",
            f"http://2130706433:{listener_port}/x.jpg",
            f"https://127.0.0.1:{listener_port}/x.jpg",
            f"{endpoint}/missing-bucket/k.jpg?X-Amz-Credential={SECRET}",
            "gopher://127.0.0.1/x",
            "http://",
            "http://127.0.0.1:99999/x",
            "s3://b/" + "k" * 9000,
        ]
    )
    return fixed | st.text(max_size=60) | json_values()


def messages(image: str, listener_port: int, endpoint: str) -> st.SearchStrategy:
    task_shaped = st.fixed_dictionaries(
        {},
        optional={
            "id": ids(),
            "job_id": ids(),
            "image_id": ids(),
            "image_url": urls(image, listener_port, endpoint),
            "config": json_values(),
        },
    ).map(lambda task: json.dumps(task).encode())
    return st.one_of(
        task_shaped,
        task_shaped,
        st.binary(max_size=200),
        json_values().map(lambda value: json.dumps(value).encode()),
        st.integers(1, 20_000).map(lambda depth: b"[" * depth + b"]" * depth),
        st.integers(4300, 6000).map(lambda digits: b'{"id": ' + b"7" * digits + b"}"),
    )


def _id_of(value: object) -> str | None:
    """An id as docs/nats.md's "Ids" rule reads it: a string, or an integer taken as its
    decimal string; non-empty, valid Unicode, at most 256 bytes of UTF-8. None: unusable."""
    if type(value) is int:  # not bool: JSON true is no id
        value = str(value)
    if not isinstance(value, str) or not value:
        return None
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate
        return None
    return value if size <= 256 else None


def should_become(data: bytes) -> tuple[str, str] | None:
    """The oracle, from docs/nats.md ("Every message on the tasks subject ends in exactly one
    outcome"), not from the worker's parser: None when the message must be dead-lettered,
    else the (job, task) its one result is stored under. The fuzz publishes on
    ``tasks.<pipeline>``, whose subject names no job: the job is the task's ``job_id``."""
    try:
        payload = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, nested too deeply, 4,300+ digit ints
        return None
    if not isinstance(payload, dict):
        return None
    task_id, job_id = _id_of(payload.get("id")), _id_of(payload.get("job_id"))
    if task_id is None or job_id is None:
        return None
    return job_id, task_id


async def accounted(js, cfg, published: list[tuple[int, bytes]]) -> list[str]:
    """What is not yet accounted for: ``[]`` once every message has its one outcome."""
    letters: set[int] = set()
    try:
        info = await js.stream_info(cfg.nats.dead_letter_stream)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            if seq:
                msg = await js.get_msg(cfg.nats.dead_letter_stream, seq)
                letters.add(int(msg.headers["Worker-Original-Sequence"]))
    except NotFoundError:
        pass
    missing = []
    for seq, data in published:
        named = should_become(data)
        if named is None:
            if seq not in letters:
                missing.append(f"seq {seq}: no dead letter")
            continue
        if seq in letters:
            missing.append(f"seq {seq}: dead-lettered, but it names its job and task")
            continue
        job_id, task_id = named
        try:
            await js.get_last_msg(cfg.nats.results_stream, result_subject(job_id, task_id))
        except NotFoundError:
            missing.append(f"seq {seq}: no result for {job_id!r}/{task_id!r}")
    return missing


def test_every_generated_message_ends_in_one_outcome_and_the_worker_lives_on(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    cfg = settings_for(nats_server.url)
    (image,) = upload_images(s3_server.client(), bucket, 1)
    port = free_port()
    env = worker_env(
        cfg,
        WORKER_METRICS__PORT=str(port),
        WORKER_NATS__MAX_DELIVER="2",
        WORKER_NATS__NAK_BACKOFF_BASE_S="0.1",
        WORKER_NATS__NAK_BACKOFF_MAX_S="0.3",
        WORKER_LOADER__TIMEOUT_S="10",
        WORKER_LOG_LEVEL="DEBUG",
        AWS_SECRET_ACCESS_KEY=AWS_SECRET,  # moto takes any; file:///proc/self/environ has it
    )
    log_path = tmp_path / "worker.log"
    published: list[tuple[int, bytes]] = []

    with Listener(b"IMAGE") as listener, worker_process(env, log_path) as proc:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc, log_path)
        pid = proc.pid

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(st.lists(messages(image, listener.port, s3_server.endpoint_url), max_size=8))
        def serve(batch: list[bytes]) -> None:
            asyncio.run(publish_and_account(cfg, batch, published))
            assert proc.poll() is None and proc.pid == pid, log_path.read_text()[-3000:]
            status, _ = wait_http(f"http://127.0.0.1:{port}/healthz", proc, log_path, 10)
            assert status == 200

        serve()
        asyncio.run(a_normal_task_still_gets_its_result(cfg, image))
        assert proc.poll() is None and proc.pid == pid

    log = log_path.read_text()
    assert listener.requests == [], "a refused URL reached the network"
    assert SECRET not in log and AWS_SECRET not in log
    assert "Traceback" not in log, log[-3000:]
    assert published, "the fuzz published nothing"


async def publish_and_account(cfg, batch: list[bytes], published: list) -> None:
    async with client(cfg) as js:
        mine = []
        for data in batch:
            ack = await js.publish(
                f"tasks.{cfg.model.pipeline}", data, stream=cfg.nats.tasks_stream
            )
            mine.append((ack.seq, data))
        published.extend(mine)
        deadline = time.monotonic() + ACCOUNTED_WAIT_S
        missing = await accounted(js, cfg, mine)
        while missing and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            missing = await accounted(js, cfg, mine)
        assert missing == []
        info = await js.consumer_info(cfg.nats.tasks_stream, cfg.nats.consumer)
        while info.num_ack_pending and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            info = await js.consumer_info(cfg.nats.tasks_stream, cfg.nats.consumer)
        assert info.num_ack_pending == 0 and info.num_pending == 0


async def a_normal_task_still_gets_its_result(cfg, image: str) -> None:
    async with client(cfg) as js:
        task = {"id": "normal", "job_id": "after-fuzz", "image_id": "n", "image_url": image}
        await js.publish(
            f"tasks.{cfg.model.pipeline}", json.dumps(task).encode(), stream=cfg.nats.tasks_stream
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                msg = await js.get_last_msg(
                    cfg.nats.results_stream, result_subject("after-fuzz", "normal")
                )
                break
            except NotFoundError:
                assert time.monotonic() < deadline, "the normal task got no result"
                await asyncio.sleep(0.2)
        assert json.loads(msg.data)["status"] == "ok"
