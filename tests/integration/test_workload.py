"""The real workload end to end, against a real nats-server and a real HTTP S3 endpoint:
Antenna's tasks (no job_id, the job in the subject), a pipeline from a plugin package that
this test installs, boxes checked against images of known content, every response checked
against Antenna's result shape, and a result too large for one message stored whole."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.antenna import PipelineResults
from tests.helpers import cli, client, worker_env
from worker.commands.demo_images import rectangles_bytes
from worker.nats.algorithms import algorithm_config
from worker.nats.subjects import subject_token

pytestmark = pytest.mark.integration

PLUGIN = Path(__file__).parents[1] / "plugin"
# Per image: rectangles in columns of their own (x1, y1, x2, y2, colour), on 1600x1000.
SCENES = [
    [(100, 100, 300, 400, "red"), (900, 600, 1200, 900, "blue")],
    [(40, 500, 400, 960, "green")],
    [(1000, 50, 1550, 350, "red"), (200, 200, 260, 260, "green"), (600, 700, 700, 800, "blue")],
]
CLASSIFIED = {"red": "reddish", "green": "greenish"}


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """The toy plugin package built and installed by pip into a directory of its own."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
            "--no-build-isolation", "--target", str(target), str(PLUGIN),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )  # fmt: skip
    assert list(target.glob("toy_moths-*.dist-info/entry_points.txt"))
    return target


def _env(settings, plugin_path, pipeline, **extra):
    return worker_env(
        settings,
        PYTHONPATH=str(plugin_path),
        WORKER_MODEL__PIPELINE=pipeline,
        WORKER_MODEL__WEIGHTS="",
        WORKER_LOADER__MAX_SIDE="800",
        WORKER_LOADER__BATCH_SIZE="2",
        **extra,
    )


def _colour_weights(plugin_path, path):
    """The plugin's own weights for its colour models, written by the installed package."""
    write = f"import toy_moths; toy_moths.colour_weights({str(path)!r})"
    env = {"PYTHONPATH": str(plugin_path)}
    subprocess.run([sys.executable, "-c", write], env=env, check=True, timeout=120)
    return path


def _results(env, job):
    done = cli("results", "--job", job, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()], done.stderr.strip()


async def _publish_antenna_tasks(settings, pipeline, job, tasks):
    async with client(settings) as js:
        for task in tasks:
            await js.publish(
                f"tasks.{pipeline}.{subject_token(job)}",
                json.dumps(task).encode(),
                stream=settings.nats.tasks_stream,
            )


async def test_antenna_tasks_through_a_plugin_pipeline_give_boxes_in_source_pixels(
    nats_server, s3_server, bucket, settings_for, plugin_path, tmp_path
):
    settings = settings_for(nats_server.url)
    s3 = s3_server.client()
    weights = _colour_weights(plugin_path, tmp_path / "colour.pt")
    s3.upload_file(str(weights), bucket, "models/colour.pt")
    env = _env(
        settings, plugin_path, "toy-moths", TOY_MOTHS_WEIGHTS=f"s3://{bucket}/models/colour.pt"
    )
    tasks = []
    for i, scene in enumerate(SCENES):
        s3.put_object(Bucket=bucket, Key=f"scene/{i}.jpg", Body=rectangles_bytes(1600, 1000, scene))
        tasks.append(
            {"id": 100 + i, "image_id": f"img-{i}", "image_url": f"s3://{bucket}/scene/{i}.jpg",
             "reply_subject": f"antenna.reply.{i}"}
        )  # fmt: skip
    missing = f"s3://{bucket}/scene/gone.jpg?X-Amz-Signature=hunter2"  # a presigned-like URL
    tasks.append({"id": 199, "image_id": "gone", "image_url": missing})
    job = "8123"
    assert cli("provision", env=env).returncode == 0
    await _publish_antenna_tasks(settings, "toy-moths", job, tasks)

    done = cli("run", "--until-idle", env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    results, summary = _results(env, job)

    assert summary == "ok=3 error=1 missing=0"
    # One log line per completed task, with stable fields, and nothing secret in any line.
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    done_lines = {line["task_id"]: line for line in lines if line["event"] == "task_done"}
    assert set(done_lines) == {"100", "101", "102", "199"}
    for task_id in ("100", "101", "102"):
        line = done_lines[task_id]
        assert (line["level"], line["status"], line["job_id"], line["attempt"]) == (
            "info",
            "ok",
            job,
            1,
        )
        assert {"load_s", "infer_s", "total_s", "detections", "timestamp"} <= set(line)
    failed = done_lines["199"]
    assert (failed["level"], failed["status"], failed["error_type"]) == (
        "warning",
        "error",
        "object_missing",
    )
    assert "hunter2" not in done.stderr
    results = [r for r in results if r["task_id"] != "199"]
    sha256 = hashlib.sha256(weights.read_bytes()).hexdigest()
    for result in sorted(results, key=lambda r: r["task_id"]):
        i = int(result["task_id"]) - 100
        assert result["job_id"] == job and result["reply_subject"] == f"antenna.reply.{i}"
        assert {s["key"]: s["weights_sha256"] for s in result["model"]["stages"]} == {
            "bright-boxes": "none", "colour-filter": sha256, "colour": sha256,
        }  # fmt: skip
        response = PipelineResults.model_validate(result["response"])
        found = sorted(response.detections, key=lambda d: d.bbox.x1 if d.bbox else 0)
        expected = sorted(SCENES[i])
        assert len(found) == len(expected)
        for detection, (x1, y1, x2, y2, colour) in zip(found, expected, strict=True):
            assert detection.bbox is not None and detection.source_image_id == f"img-{i}"
            got = (detection.bbox.x1, detection.bbox.y1, detection.bbox.x2, detection.bbox.y2)
            assert got == pytest.approx((x1, y1, x2, y2), abs=4.0)  # 2 px at the decoded scale
            labels = [c.classification for c in detection.classifications]
            assert labels == ([colour, CLASSIFIED[colour]] if colour in CLASSIFIED else [colour])
            assert [c.terminal for c in detection.classifications][-1] is True


async def test_a_result_over_the_message_size_is_stored_whole(
    nats_server, s3_server, bucket, settings_for, plugin_path
):
    settings = settings_for(nats_server.url)
    env = _env(settings, plugin_path, "toy-many")
    s3_server.client().put_object(
        Bucket=bucket, Key="one.jpg", Body=rectangles_bytes(640, 480, [(0, 0, 10, 10, "red")])
    )
    assert cli("provision", env=env).returncode == 0
    await _publish_antenna_tasks(
        settings,
        "toy-many",
        "big",
        [{"id": "t", "image_id": "i", "image_url": f"s3://{bucket}/one.jpg"}],
    )

    done = cli("run", "--until-idle", env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]

    async with client(settings) as js:
        stored = await js.get_last_msg(settings.nats.results_stream, "results.big.t")
        published = await algorithm_config(js, settings.nats.algorithms, "thousand")
    kept = json.loads(stored.data)
    assert kept["response"] is None and kept["response_object"]["bytes"] > 1024 * 1024
    (result,), summary = _results(env, "big")
    assert summary == "ok=1 error=0 missing=0"
    response = PipelineResults.model_validate(result["response"])
    assert len(response.detections) == 500
    assert all(len(d.classifications[0].scores) == 1000 for d in response.detections)
    assert all(d.classifications[0].labels is None for d in response.detections)
    # ... because the class list is published once, under the algorithm's key.
    assert published["category_map"]["labels"][:2] == ["species-0000", "species-0001"]
    assert len(published["category_map"]["labels"]) == 1000


async def test_a_second_run_of_a_task_leaves_its_stored_large_response_readable(
    nats_server, settings_for
):
    from worker.commands.job_client import job_results
    from worker.nats.parts import result_store
    from worker.nats.provision import provision

    settings = settings_for(nats_server.url)

    def result(run: int) -> dict:
        detections = [{"bbox": None, "run": run, "scores": [0.5] * 10_000}]
        return {
            "task_id": "t",
            "job_id": "j",
            "status": "ok",
            "response": {"detections": detections},
        }

    async with client(settings) as js:
        await provision(js, settings.nats, "p")
        store = result_store(js, settings.nats, lambda: 16 * 1024)  # every response goes aside
        assert await store.store(result(1)) is True
        assert await store.store(result(2)) is False  # redelivered: refused, first one kept
        (kept,) = await job_results(js, settings.nats, "j")
        raw = json.loads((await js.get_last_msg(settings.nats.results_stream, "results.j.t")).data)
        objects = await js.object_store(settings.nats.result_objects)
        await objects.delete(raw["response_object"]["name"])
        (lost,) = await job_results(js, settings.nats, "j")

    assert kept["response"]["detections"][0]["run"] == 1
    assert lost["response"] is None and "unreadable" in lost["response_error"]
