"""Input from strangers and faults of the connection, against a real nats-server and S3."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
from nats.errors import ConnectionClosedError
from nats.js.errors import NotFoundError

from tests.helpers import client, consumer_idle, publish_raw, running_worker, upload_images
from tests.listeners import Listener
from worker.core.exits import ExitReason
from worker.nats.provision import provision
from worker.nats.subjects import result_subject

pytestmark = pytest.mark.integration
SECRET = "SECRETSIG0123"


async def result_for(js, settings, job_id: str, task_id: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    subject = result_subject(job_id, task_id)
    while True:
        try:
            msg = await js.get_last_msg(settings.nats.results_stream, subject)
            return json.loads(msg.data)
        except NotFoundError:
            if time.monotonic() > deadline:
                raise AssertionError(f"no result for job {job_id!r} task {task_id!r}") from None
            await asyncio.sleep(0.1)


async def dead_letters(js, settings, count: int, timeout_s: float = 30.0) -> list:
    deadline = time.monotonic() + timeout_s
    found = []
    while time.monotonic() < deadline:
        try:
            info = await js.stream_info(settings.nats.dead_letter_stream)
        except NotFoundError:
            info = None
        if info is not None and info.state.messages >= count:
            first = info.state.first_seq
            found = [
                await js.get_msg(settings.nats.dead_letter_stream, seq)
                for seq in range(first, info.state.last_seq + 1)
            ]
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"{len(found)} of {count} dead letters after {timeout_s}s")


async def test_poison_messages_each_end_in_one_outcome_and_the_worker_keeps_serving(
    nats_server, s3_server, bucket, settings_for
):
    settings = settings_for(nats_server.url)
    (image,) = upload_images(s3_server.client(), bucket, 1)
    endpoint = s3_server.endpoint_url
    job = "job-poison"

    def task(task_id, url=image, job_id=job):
        return {"id": task_id, "job_id": job_id, "image_id": "i", "image_url": url}

    with Listener(b"IMAGE") as listener:
        async with running_worker(settings) as app, client(settings) as js:
            undeliverable = [
                json.dumps(task("x" * 5000)).encode(),  # a subject over the control-line limit
                b'{"id": "\\ud800", "job_id": "j", "image_id": "i", "image_url": "s3://b/k"}',
                b"[" * 5000 + b"]" * 5000,
                b'{"id": ' + b"9" * 5000 + b', "job_id": "j"}',
            ]
            for data in undeliverable:
                await publish_raw(js, settings, data)
            named = {
                ("job-poison", "ends-in-newline\n"): "ok",
                ("J/x", "y"): "ok",
                ("J", "x/y"): "ok",
                (job, "environ"): "file_refused",
                (job, "zero"): "file_refused",
                (job, "loopback"): "address_refused",
                (job, "presigned-missing"): "object_missing",
            }
            urls = {
                "environ": "file:///proc/self/environ",
                "zero": "file:///dev/zero",
                "loopback": listener.url(f"/image?X-Amz-Signature={SECRET}"),
                "presigned-missing": f"{endpoint}/{bucket}/missing.jpg?X-Amz-Signature={SECRET}",
            }
            for job_id, task_id in named:
                await publish_raw(js, settings, task(task_id, urls.get(task_id, image), job_id))
            results = {key: await result_for(js, settings, *key) for key in named}
            letters = await dead_letters(js, settings, len(undeliverable))
            await publish_raw(js, settings, task("after-the-poison"))
            after = await result_for(js, settings, job, "after-the-poison")
            await consumer_idle(js, settings)
            assert app.parts.nc.is_connected
            assert app.worker is not None and app.worker.exit.reason is ExitReason.STOPPED

    outcomes = {
        key: result["status"] if result["status"] == "ok" else result["error"]["type"]
        for key, result in results.items()
    }
    assert outcomes == named
    assert {r["task_id"] for r in results.values()} >= {"y", "x/y", "ends-in-newline\n"}
    assert len(letters) == len(undeliverable)
    assert all(letter.headers["Worker-Reason"] for letter in letters)
    assert after["status"] == "ok"
    stored = json.dumps(list(results.values()))
    assert SECRET not in stored and "AWS_SECRET_ACCESS_KEY" not in stored
    assert listener.requests == [], "a refused URL never reaches the network"


async def test_a_dead_letter_not_stored_on_the_last_delivery_is_kept_once_the_stream_is_back(
    nats_server, settings_for
):
    settings = settings_for(
        nats_server.url, nats={"max_deliver": 1, "store_retry_s": 0.3, "nak_backoff_max_s": 1.0}
    )
    async with running_worker(settings), client(settings) as js:
        await js.delete_stream(settings.nats.dead_letter_stream)
        await publish_raw(js, settings, b"not json at all")
        deadline = time.monotonic() + 20
        while (await js.stream_info(settings.nats.advisory_stream)).state.messages == 0:
            assert time.monotonic() < deadline, "no max-deliveries advisory"
            await asyncio.sleep(0.1)
        await provision(js, settings.nats, settings.model.pipeline)  # the stream is back
        (letter,) = await dead_letters(js, settings, 1)
    assert letter.data == b"not json at all"
    assert letter.headers["Worker-Original-Sequence"] == "1"


async def test_a_connection_the_server_closes_for_good_ends_the_worker_with_code_5(
    nats_server, settings_for
):
    settings = settings_for(nats_server.url)
    async with running_worker(settings) as app:
        assert app.worker is not None
        # The server drops a client whose protocol line is too long, as it did for a task
        # with a long id; nats-py then closes the client for good when it reads the server's
        # -ERR first. When the socket's reset reaches it first (a race the server's close
        # makes), it reconnects instead and the worker rightly carries on: the line is sent
        # again, each try bounded, until the -ERR is what nats-py reads.
        deadline = time.monotonic() + 30
        while app.worker.exit.reason is ExitReason.STOPPED:
            assert time.monotonic() < deadline, "the worker did not notice its closed client"
            if app.parts.nc.is_connected:
                with contextlib.suppress(ConnectionClosedError):  # closed meanwhile: the point
                    await app.parts.nc.publish("x" * 5000, b"")
            await asyncio.sleep(2.0)
    assert app.worker.exit.reason is ExitReason.SOURCE_GONE and app.worker.exit.code == 5


async def test_a_long_disconnect_is_reported_until_the_server_is_back(
    own_nats_server, settings_for
):
    nats_server = own_nats_server
    from worker.commands.localservers import free_port

    port = free_port()
    settings = settings_for(
        nats_server.url, health={"disconnected_timeout_s": 1.0}, metrics={"port": port}
    )

    def healthz() -> tuple[int, str]:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    async def until(status: int) -> str:
        deadline = time.monotonic() + 20
        while True:
            code, body = await asyncio.to_thread(healthz)
            if code == status:
                return body
            assert time.monotonic() < deadline, f"healthz stayed {code}: {body}"
            await asyncio.sleep(0.2)

    async with running_worker(settings) as app:
        await until(200)
        nats_server.stop()
        body = await until(503)
        nats_server.start()
        await until(200)
        assert app.parts.connection.connected()
    assert body.startswith("nats: disconnected")


def test_the_s3_deadline_finds_the_socket_under_botocores_body(s3_server, bucket):
    """The deadline shuts the S3 socket down; if botocore's layout moves, this says so."""
    import socket

    from datasets.uris import SourceConfig, body_socket, s3_client

    (uri,) = upload_images(s3_server.client(), bucket, 1)
    key = uri.split("/", 3)[3]
    body = s3_client(SourceConfig(s3_endpoint_url=s3_server.endpoint_url)).get_object(
        Bucket=bucket, Key=key
    )["Body"]
    try:
        assert isinstance(body_socket(body), socket.socket)
    finally:
        body.close()
