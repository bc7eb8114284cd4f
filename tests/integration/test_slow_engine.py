"""A slow engine is not a wedged one: progress is counted where the work happens (each
forward pass of a batch's chunks), so a batch that takes three times the watchdog's window
but advances is served, and a forward pass that freezes is still ended by the watchdog.

Real `inference-worker run` processes against a real nats-server and S3 endpoint; the slow
and frozen passes are the WORKER_FAULTS__SLOW_FORWARD_S and WORKER_FAULTS__FREEZE_FORWARD_AT
hooks (each image's classifier pass sleeps, without the GIL, as a slow CPU host computes)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    client,
    http_answer,
    submit,
    upload_images,
    wait_results,
    worker_env,
    worker_process,
)
from worker.nats.provision import provision

pytestmark = pytest.mark.integration

IMAGES = 12  # one batch (BATCH_SIZE 12), fetched at once: they are queued before the start
SLOW_S = 2.0  # per image: the batch takes 24 s, three times the watchdog's 8 s
WATCHDOG_S = 8


def _env(settings: Any, **extra: str) -> dict[str, str]:
    return worker_env(
        settings,
        WORKER_LOADER__BATCH_SIZE=str(IMAGES),
        WORKER_MODEL__CROP_BATCH_SIZE="1",  # one image per classifier forward pass
        WORKER_HEALTH__STALL_TIMEOUT_S="6",
        WORKER_HEALTH__WATCHDOG_TIMEOUT_S=str(WATCHDOG_S),
        WORKER_HEALTH__DRAIN_TIMEOUT_S="5",
        WORKER_NATS__ACK_WAIT_S="120",
        WORKER_LOADER__TIMEOUT_S="5",
        WORKER_S3__READ_TIMEOUT_S="1",
        WORKER_S3__MAX_ATTEMPTS="2",
        **extra,
    )


def _batches_done(log_path: Path) -> list[dict[str, Any]]:
    text = log_path.read_text()
    lines = [json.loads(x) for x in text.splitlines() if x.startswith("{") and x.endswith("}")]
    return [line for line in lines if line.get("event") == "batch_done"]


async def test_a_batch_three_times_the_watchdog_that_advances_is_served_not_killed(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    settings = settings_for(nats_server.url)
    env = _env(settings, WORKER_FAULTS__SLOW_FORWARD_S=str(SLOW_S))
    livez = f"http://127.0.0.1:{int(env['WORKER_METRICS__PORT']) + 1000}/livez"
    uris = upload_images(s3_server.client(), bucket, IMAGES)
    log_path = tmp_path / "worker.log"
    async with client(settings) as js:
        await provision(js, settings.nats, settings.model.pipeline)
        await submit(js, settings, "job-slow", uris)
        with worker_process(env, log_path) as proc:
            answers: list[tuple[int, str]] = []
            deadline = time.monotonic() + 180  # start, then the 24 s batch, on a busy runner
            while not _batches_done(log_path):
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                try:
                    answers.append(await asyncio.to_thread(http_answer, livez, 2.0))
                except OSError:
                    pass  # not listening yet
                await asyncio.sleep(0.5)
            results = await wait_results(js, settings, "job-slow", IMAGES)
            assert proc.poll() is None, log_path.read_text()[-3000:]
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
    log = log_path.read_text()

    assert "Timeout (0:00:08)!" not in log, log[-3000:]  # the watchdog's thread dump
    assert code == 0, log[-3000:]
    assert [b["size"] for b in _batches_done(log_path)] == [IMAGES], "one batch of them all"
    assert _batches_done(log_path)[0]["infer_s"] >= 3 * WATCHDOG_S, "three windows long"
    assert {r["status"] for r in results} == {"ok"}
    stalled = [why for status, why in answers if status != 200 and "starting" not in why]
    assert stalled == [], "/livez never said stalled while the batch advanced"


async def test_a_forward_pass_that_freezes_is_still_ended_by_the_watchdog(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    settings = settings_for(nats_server.url)
    # Three images advance, the fourth's pass never returns.
    env = _env(settings, WORKER_FAULTS__SLOW_FORWARD_S="0.5", WORKER_FAULTS__FREEZE_FORWARD_AT="4")
    uris = upload_images(s3_server.client(), bucket, IMAGES)
    log_path = tmp_path / "worker.log"
    async with client(settings) as js:
        await provision(js, settings.nats, settings.model.pipeline)
        await submit(js, settings, "job-frozen", uris)
        with worker_process(env, log_path) as proc:
            deadline = time.monotonic() + 180
            while "fault_hook_frozen_forward_pass" not in log_path.read_text():
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                await asyncio.sleep(0.2)
            # Ended within the watchdog's window of the last progress, with room for a busy
            # runner: the bound is generous, the window is 8 s.
            code = await asyncio.to_thread(proc.wait, 60)
    log = log_path.read_text()

    assert code == 1, log[-3000:]
    assert f"Timeout (0:00:0{WATCHDOG_S})!" in log, log[-3000:]  # every thread's stack
    assert _batches_done(log_path) == [], "the frozen batch never completed"
