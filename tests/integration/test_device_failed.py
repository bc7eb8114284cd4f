"""A device that fails for good, as supervisord and the fleet see it: real worker processes
against a real nats-server and S3 endpoint. Process A's device fails at its second batch (the
fault hook raises torch's real sticky CUDA error inside the forward pass); A exits 7 with one
``device_failed`` line, having given back what it held; process B then serves those tasks.
Every task ends with exactly one result, ok, and no task was delivered more than twice."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    client,
    quiescent,
    submit,
    upload_images,
    wait_results,
    worker_env,
    worker_process,
)
from worker.commands.job_client import job_results
from worker.nats.provision import provision

pytestmark = pytest.mark.integration
EXIT_WAIT_S = 120.0
SERVE_WAIT_S = 180.0
IMAGES = 12  # three batches of WORKER_LOADER__BATCH_SIZE (4)


def events(log_path: Path) -> list[dict[str, Any]]:
    """The worker's JSON log lines (it logs JSON when not on a terminal)."""
    found = []
    for line in log_path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and "event" in entry:
            found.append(entry)
    return found


@pytest.mark.timeout(EXIT_WAIT_S + SERVE_WAIT_S + 60)  # its own bounds, then the servers'
@pytest.mark.parametrize(
    "error_type, error",
    [
        ("accelerator", "AcceleratorError: CUDA error: an illegal memory access was encountered"),
        ("runtime", "RuntimeError: CUDA error: an illegal memory access was encountered"),
    ],
)
async def test_a_worker_whose_device_fails_exits_7_and_another_serves_what_it_gave_back(
    nats_server, s3_server, bucket, settings_for, tmp_path, error_type, error
):
    settings = settings_for(nats_server.url)
    fault = tmp_path / "device-fails-once"
    # No /metrics listener (port 0): nothing here scrapes it, and a free port picked for B
    # after A exits can be taken meanwhile by another test's connection (seen under load).
    env_a = worker_env(
        settings,
        WORKER_METRICS__PORT="0",
        WORKER_FAULTS__DEVICE_ERROR_ONCE_FILE=str(fault),
        WORKER_FAULTS__DEVICE_ERROR_AT_BATCH="2",
        WORKER_FAULTS__DEVICE_ERROR_TYPE=error_type,
    )
    uris = upload_images(s3_server.client(), bucket, IMAGES)
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    async with client(settings) as js:
        await provision(js, settings.nats, settings.model.pipeline)
        tasks = await submit(js, settings, "job-device", uris)
        with worker_process(env_a, log_a) as a:
            code = await asyncio.to_thread(a.wait, EXIT_WAIT_S)
        by_a = {r["task_id"] for r in await job_results(js, settings.nats, "job-device")}
        with worker_process(worker_env(settings, WORKER_METRICS__PORT="0"), log_b):
            try:
                await wait_results(js, settings, "job-device", len(tasks), SERVE_WAIT_S)
            except BaseException:
                print(log_b.read_text()[-3000:])  # why B served nothing, with the failure
                raise
            await quiescent(js, settings)  # nothing pending or unacked: no result on its way
        results = await job_results(js, settings.nats, "job-device")

    assert fault.exists(), "the fault hook fired"
    assert code == 7, log_a.read_text()[-3000:]
    failed = [e for e in events(log_a) if e["event"] == "device_failed"]
    assert len(failed) == 1, log_a.read_text()[-3000:]
    assert failed[0]["error"] == error and failed[0]["device"] == "cpu"
    assert failed[0]["level"] == "error" and failed[0]["exit_code"] == 7
    assert not [e for e in events(log_a) if e["event"] == "inference_failed"]
    assert any(e["event"] == "tasks_given_back" for e in events(log_a))

    assert sorted(r["task_id"] for r in results) == sorted(t.id for t in tasks), "one each"
    assert {r["status"] for r in results} == {"ok"}, "nothing stored as failed"
    attempts = {r["task_id"]: r["attempt"] for r in results}
    assert 0 < len(by_a) < len(tasks), "A stored its first batch, then gave back the rest"
    assert {attempts[t] for t in by_a} == {1}
    assert max(attempts.values()) == 2, "what A held came back once: its delivery used, no more"
