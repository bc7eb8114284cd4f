"""A model load that never ends, through the real worker process against a real nats-server:
a worker serving two pipelines, one of them (colours) loaded on its first task from a real
HTTP file host on 127.0.0.1 that trickles its answer's head, a byte every 2 s (each read
gets a byte, so no stall timeout ends it; the download's own deadline is minutes). Past the
load deadline (``WORKER_MODEL__LOAD_DEADLINE_S``, 3 s here) the pipeline is unavailable
(``load_timeout`` in the metric), none of its tasks is held any more (given back, none
failed), the other pipeline's job is served; the load still running at twice its deadline,
``/livez`` asks for a restart (healthwatch would restart the process); once the host answers,
colours' tasks are served too. On the old code the load was awaited for ever, its tasks held,
their ack waits extended, and no other pipeline's batch ran."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import client, upload_images, wait_results, worker_env, worker_process
from tests.integration.test_unavailable_pipelines import events, probe, two_pipelines
from tests.served_files import Served
from worker.commands.demo_models import COLOURS, ColourClassifier
from worker.commands.job_client import job_results, make_tasks, publish_tasks
from worker.commands.localservers import free_port
from worker.nats.provision import provision

pytestmark = pytest.mark.integration
WAIT_S = 60.0  # the documented bound here: the 3 s deadline, a batch, the probes' reads
DEADLINE_S = "3"


@pytest.fixture
def file_host(tmp_path: Path) -> Iterator[Served]:
    """The colour classifier's weights, on a host that trickles its head until told not to."""
    root = tmp_path / "files"
    root.mkdir()
    torch.save(ColourClassifier(len(COLOURS)).state_dict(), root / "colours.pt")
    served = Served(root, trickling=True, trickle_s=2.0)
    yield served
    served.stop()


def metric(port: int, name: str) -> str:
    status, body = probe(port, "/metrics")
    assert status == 200, body
    return "\n".join(line for line in body.splitlines() if line.startswith(name))


async def until_async(condition: Any, what: str, log: Path, proc: Any) -> None:
    import asyncio

    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if await condition():
            return
        assert proc.poll() is None, f"worker exited before {what}:\n{log.read_text()[-4000:]}"
        await asyncio.sleep(0.2)
    raise AssertionError(f"not {what} within {WAIT_S}s:\n{log.read_text()[-4000:]}")


@pytest.mark.timeout(6 * WAIT_S)
async def test_a_model_load_whose_host_trickles_gives_its_tasks_back_within_the_deadline(
    nats_server, s3_server, bucket, settings_for, tmp_path, file_host
):
    settings = settings_for(nats_server.url)
    port = free_port()
    env = worker_env(
        settings,
        WORKER_MODEL__WEIGHTS="",
        WORKER_MODEL__LOAD_DEADLINE_S=DEADLINE_S,
        **two_pipelines(tmp_path, port, file_host),
    )
    uris = upload_images(s3_server.client(), bucket, 8)
    log = tmp_path / "worker.log"

    async def unavailable_for_its_timeout() -> bool:
        lost = metric(port, "inference_worker_pipeline_unavailable{")
        return 'pipeline="colours",reason="load_timeout"} 1.0' in lost

    async def none_held() -> bool:
        return (
            metric(port, "inference_worker_inflight_tasks ")
            == "inference_worker_inflight_tasks 0.0"
        )

    async def restart_asked() -> bool:
        status, body = probe(port, "/livez")
        return status == 503 and "restart:" in body and "wedged" in body

    async with client(settings) as js:
        await provision(js, settings.nats, ["animals", "colours"])
        with worker_process(env, log) as proc:
            for job, pipeline in (("job-colours", "colours"), ("job-animals", "animals")):
                await publish_tasks(js, settings.nats, pipeline, make_tasks(job, uris))
            animals = await wait_results(js, settings, "job-animals", len(uris), WAIT_S)
            await until_async(unavailable_for_its_timeout, "colours unavailable", log, proc)
            await until_async(none_held, "colours' tasks given back", log, proc)
            await until_async(restart_asked, "/livez asking for a restart", log, proc)
            assert file_host.trickled >= 1 and file_host.trickling
            assert await job_results(js, settings.nats, "job-colours") == []  # none failed
            file_host.trickling = False  # the host answers again
            colours = await wait_results(js, settings, "job-colours", len(uris), 2 * WAIT_S)

    assert {r["status"] for r in animals} == {"ok"}
    assert {r["status"] for r in colours} == {"ok"}, [r["error"] for r in colours]
    said = events(log)
    assert said.count("model_load_timed_out") == 1 and said.count("model_load_wedged") == 1
    assert "pipeline_available" in said
    assert "worker_part_failed" not in said
