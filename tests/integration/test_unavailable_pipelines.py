"""A pipeline whose model file host refuses this host for a while, through the real worker
process: a worker serving two pipelines, one of them with its weights on a real HTTP server on
127.0.0.1 that answers 403 until the test lets it serve, the model cache in a tmp directory.
Against a real nats-server, and against the Antenna fake: every task ends ok, none is failed
meanwhile, the other pipeline serves on, and ``/readyz`` says which pipeline is unavailable
and why while the host refuses. The window is not the issue's 90 s: it lasts until the refusal
has been seen by ``/readyz`` and retried (``WORKER_MODEL__LOAD_RETRY_S`` scaled to 0.5 s), so
the test costs seconds."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.antenna_fake import FakeAntenna
from tests.helpers import (
    client,
    upload_images,
    wait_results,
    worker_env,
    worker_process,
)
from tests.integration.test_antenna import TOKEN, add_images, env_for
from tests.served_files import Served
from worker.commands.demo_models import COLOURS, ColourClassifier
from worker.commands.job_client import job_results, make_tasks, publish_tasks
from worker.commands.localservers import free_port, stop_process
from worker.nats.provision import provision

pytestmark = pytest.mark.integration
PIPELINES = "tests.antenna_pipelines:animals,tests.antenna_pipelines:colours_from_url"
WAIT_S = 120.0
RETRY = {"WORKER_MODEL__LOAD_RETRY_S": "0.5", "WORKER_MODEL__LOAD_RETRY_MAX_S": "1"}


@pytest.fixture
def file_host(tmp_path: Path) -> Iterator[Served]:
    """The colour classifier's weights, on a host that refuses until told to serve."""
    root = tmp_path / "files"
    root.mkdir()
    torch.save(ColourClassifier(len(COLOURS)).state_dict(), root / "colours.pt")
    served = Served(root, refusing=True)
    yield served
    served.stop()


def probe(port: int, path: str = "/readyz") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return 0, ""


def until(condition: Callable[[], bool], what: str, log: Path, proc: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if condition():
            return
        assert proc.poll() is None, f"worker exited before {what}:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)
    raise AssertionError(f"not {what} within {WAIT_S}s:\n{log.read_text()[-4000:]}")


def events(log: Path) -> list[str]:
    lines = log.read_text(errors="replace").splitlines()
    return [json.loads(line).get("event", "") for line in lines if line.startswith("{")]


def two_pipelines(tmp_path: Path, port: int, file_host: Served) -> dict[str, str]:
    """A worker's settings for PIPELINES, colours' weights from ``file_host``, its own empty
    model cache, metrics on ``port`` and quick load retries."""
    return {
        "WORKER_MODEL__PIPELINE": "",
        "WORKER_MODEL__PIPELINES": PIPELINES,
        "WORKER_MODEL__CACHE_DIR": str(tmp_path / "cache"),
        "WORKER_METRICS__PORT": str(port),
        "IW_TEST_COLOURS_WEIGHTS": file_host.url("colours.pt"),
        **RETRY,
    }


def unavailable_said(port: int) -> bool:
    """/readyz names the refused pipeline and why while the other serves (200)."""
    status, body = probe(port)
    return status == 200 and "colours (download_refused" in body


@pytest.mark.timeout(3 * WAIT_S)
async def test_a_refused_model_file_fails_no_task_over_nats(
    nats_server, s3_server, bucket, settings_for, tmp_path, file_host
):
    settings = settings_for(nats_server.url)
    port = free_port()
    env = worker_env(settings, WORKER_MODEL__WEIGHTS="", **two_pipelines(tmp_path, port, file_host))
    uris = upload_images(s3_server.client(), bucket, 8)
    log = tmp_path / "worker.log"
    async with client(settings) as js:
        await provision(js, settings.nats, ["animals", "colours"])
        with worker_process(env, log) as proc:
            for job, pipeline in (("job-colours", "colours"), ("job-animals", "animals")):
                await publish_tasks(js, settings.nats, pipeline, make_tasks(job, uris))
            animals = await wait_results(js, settings, "job-animals", len(uris), WAIT_S)
            until(lambda: unavailable_said(port), "/readyz naming colours", log, proc)
            until(lambda: file_host.refused >= 3, "the load retried", log, proc)
            assert await job_results(js, settings.nats, "job-colours") == []  # none failed
            file_host.refusing = False  # the file host serves again
            colours = await wait_results(js, settings, "job-colours", len(uris), WAIT_S)
            until(lambda: probe(port) == (200, "ok\n"), "/readyz plain ok", log, proc)

    assert {r["status"] for r in animals} == {"ok"}
    assert {r["status"] for r in colours} == {"ok"}, [r["error"] for r in colours]
    assert len({r["task_id"] for r in colours}) == len(uris)
    said = events(log)
    assert said.count("pipeline_unavailable") == 1 and "pipeline_available" in said
    assert "worker_part_failed" not in said


@pytest.fixture
def antenna() -> Iterator[FakeAntenna]:
    # A short TTR: Antenna has no nak, and what the worker gives back comes again after it.
    fake = FakeAntenna(token=TOKEN, ttr_s=6.0)
    with fake.running():
        yield fake


@pytest.mark.timeout(3 * WAIT_S)
def test_a_refused_model_file_fails_no_task_over_antenna(
    antenna: FakeAntenna, tmp_path: Path, file_host: Served
) -> None:
    from tests.helpers import cli, start_run

    port = free_port()
    env = env_for(
        antenna,
        **two_pipelines(tmp_path, port, file_host),
        WORKER_ANTENNA__TTR_S="6",
        WORKER_HEALTH__DRAIN_TIMEOUT_S="4",
    )
    file_host.refusing = False  # registered from another host, whose cache it fills
    done = cli("register", env={**env, "WORKER_MODEL__CACHE_DIR": str(tmp_path / "reg")})
    assert done.returncode == 0, done.stderr + done.stdout
    file_host.refusing, file_host.refused = True, 0  # a new host's empty cache, refused
    jobs = {
        slug: antenna.add_job(slug, add_images(antenna, slug[0].upper(), 6))
        for slug in ("colours", "animals")
    }
    log = tmp_path / "worker.log"
    proc = start_run(env, log)
    try:
        until(lambda: antenna.pending(jobs["animals"]) == set(), "animals served", log, proc)
        until(lambda: unavailable_said(port), "/readyz naming colours", log, proc)
        until(lambda: file_host.refused >= 3, "the load retried", log, proc)
        assert antenna.jobs[jobs["colours"]].failed == set()  # nothing posted as an error
        file_host.refusing = False
        until(lambda: antenna.pending(jobs["colours"]) == set(), "colours served", log, proc)
    finally:
        stop_process(proc)

    for job in jobs.values():
        assert antenna.jobs[job].failed == set(), log.read_text()[-4000:]
        saved = antenna.jobs[job].saved
        assert {image: len(found) for image, found in saved.items()} == {
            image: 1 for image in antenna.jobs[job].tasks
        }
    said = events(log)
    assert said.count("pipeline_unavailable") == 1 and "pipeline_available" in said
    assert "task_left_to_redelivery" in said  # the batch that met the refusal, given back
