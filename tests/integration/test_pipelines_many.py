"""Several pipelines in one worker process, through the real worker, nats-server and S3:
each task answered by its own pipeline's model, models unloaded under a memory budget with
results unchanged, and a pipeline whose model fails to load failing none of its tasks."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from pipelines.models import save_classifier
from tests.helpers import client, running_worker, upload_images, wait_results
from worker.commands.job_client import job_results, make_tasks, publish_tasks

pytestmark = pytest.mark.integration

ANIMALS = ["cat", "dog", "bird", "fish", "horse"]
COLOURS = ["red", "green", "blue"]
SHAPES = ["circle", "square", "triangle", "star"]


def _declare(directory: Path, name: str, labels: list[str], seed: int) -> tuple[str, str]:
    """A classifier pipeline in TOML (MobileNetV3-Small, random weights of its own seed);
    its file and the sha256 of its weights."""
    weights = save_classifier("mobilenet_v3_small", labels, str(directory / name), seed=seed)
    toml = directory / f"{name}.toml"
    toml.write_text(
        f'name = "{name}"\n[classifier]\nkey = "{name}-classifier"\n'
        f'architecture = "mobilenet_v3_small"\nweights = "{weights}"\n'
    )
    return str(toml), hashlib.sha256(Path(weights).read_bytes()).hexdigest()


def _labels(result: dict) -> list[str]:
    return [
        c["classification"] for d in result["response"]["detections"] for c in d["classifications"]
    ]


def _scores(results: list[dict]) -> dict[str, list[float]]:
    return {
        r["image_id"]: r["response"]["detections"][0]["classifications"][0]["scores"]
        for r in results
    }


async def test_each_task_is_answered_by_its_own_pipelines_model(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    animals, animals_sha = _declare(tmp_path, "animals", ANIMALS, seed=1)
    colours, colours_sha = _declare(tmp_path, "colours", COLOURS, seed=2)
    settings = settings_for(nats_server.url, model={"pipelines": [animals, colours], "weights": ""})
    uris = upload_images(s3_server.client(), bucket, 6)
    async with running_worker(settings), client(settings) as js:
        for job, pipeline in (("job-animals", "animals"), ("job-colours", "colours")):
            await publish_tasks(js, settings.nats, pipeline, make_tasks(job, uris))
        by_job = {
            job: await wait_results(js, settings, job, len(uris))
            for job in ("job-animals", "job-colours")
        }

    for job, pipeline, labels, sha in (
        ("job-animals", "animals", ANIMALS, animals_sha),
        ("job-colours", "colours", COLOURS, colours_sha),
    ):
        results = by_job[job]
        assert {r["status"] for r in results} == {"ok"}
        assert {r["pipeline"] for r in results} == {pipeline}
        assert {r["model"]["name"] for r in results} == {pipeline}
        assert {r["model"]["weights_sha256"] for r in results} == {sha}
        assert all(_labels(r) and set(_labels(r)) <= set(labels) for r in results)
        assert all(len(_scores([r])[r["image_id"]]) == len(labels) for r in results)


async def test_pipelines_unloaded_for_room_give_the_same_results_when_loaded_again(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    declared = [_declare(tmp_path, name, labels, seed) for name, labels, seed in (
        ("animals", ANIMALS, 1), ("colours", COLOURS, 2), ("shapes", SHAPES, 3))]  # fmt: skip
    one_model_bytes = Path(tmp_path / "animals" / "model.pt").stat().st_size
    settings = settings_for(
        nats_server.url,
        model={
            "pipelines": [toml for toml, _sha in declared],
            "weights": "",
            "memory_budget_bytes": int(one_model_bytes * 1.5),  # one model at a time
        },
    )
    uris = upload_images(s3_server.client(), bucket, 4)
    order = [("animals", "first"), ("colours", "first"), ("shapes", "first"), ("animals", "again")]
    async with running_worker(settings) as app, client(settings) as js:
        results = {}
        for pipeline, run in order:  # one job at a time: each load evicts the last
            job = f"job-{pipeline}-{run}"
            await publish_tasks(js, settings.nats, pipeline, make_tasks(job, uris))
            results[(pipeline, run)] = await wait_results(js, settings, job, len(uris))
        served = app.worker.services.engine.models  # type: ignore[union-attr]
        stats = served.cache.stats
        resident = served.cache.resident()

    assert all(r["status"] == "ok" for batch in results.values() for r in batch)
    assert _scores(results[("animals", "first")]) == _scores(results[("animals", "again")])
    assert stats.loads == {"animals": 2, "colours": 1, "shapes": 1}
    assert sum(stats.evictions.values()) == 3
    assert list(resident) == ["animals"]


async def test_a_model_that_fails_to_load_fails_none_of_its_tasks_and_the_other_serves_on(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    animals, _sha = _declare(tmp_path, "animals", ANIMALS, seed=1)
    broken, _ = _declare(tmp_path, "broken", COLOURS, seed=2)
    (tmp_path / "broken" / "model.pt").write_bytes(b"not a state_dict")  # found, not loadable
    settings = settings_for(nats_server.url, model={"pipelines": [broken, animals], "weights": ""})
    uris = upload_images(s3_server.client(), bucket, 5)
    async with running_worker(settings) as app, client(settings) as js:
        await publish_tasks(js, settings.nats, "broken", make_tasks("job-broken", uris))
        await publish_tasks(js, settings.nats, "animals", make_tasks("job-animals", uris))
        served = await wait_results(js, settings, "job-animals", len(uris))
        assert app.worker is not None
        for _ in range(600):  # its turn comes once the load of animals no longer holds it
            if lost := app.worker.availability.unavailable():
                break
            await asyncio.sleep(0.1)
        failed = await job_results(js, settings.nats, "job-broken")

    assert {r["status"] for r in served} == {"ok"}
    assert failed == []  # given back for another host, never a final error
    assert list(lost) == ["broken"] and lost["broken"].reason == "load_failed"
    assert "'broken' could not be loaded" in lost["broken"].error
