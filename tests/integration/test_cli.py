"""The command line as an operator uses it: a real `inference-worker run` process."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from tests.helpers import (
    cli,
    client,
    consumer_idle,
    submit,
    until_gone,
    upload_images,
    wait_http,
    wait_results,
    worker_env,
    worker_process,
)
from worker.commands.localservers import free_port

pytestmark = pytest.mark.integration


def device_info(metrics: str) -> list[tuple[dict[str, str], float]]:
    """The samples of ``inference_worker_device_info`` in a /metrics text, parsed."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "inference_worker_device_info"
    ]


def loader_children(pid: int) -> list[int]:
    """The loader's children: the fork server's children, grandchildren of the worker."""
    return [g.pid for child in psutil.Process(pid).children() for g in child.children()]


async def test_run_serves_a_job_reports_metrics_and_exits_0_on_sigterm_leaving_no_children(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    settings = settings_for(nats_server.url)
    port = free_port()
    log_path = tmp_path / "worker.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "run"],
            env=worker_env(settings, WORKER_METRICS__PORT=str(port)),
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        status, _ = wait_http(f"http://127.0.0.1:{port}/healthz", proc, log_path)
        assert status == 200
        uris = upload_images(s3_server.client(), bucket, 6)
        async with client(settings) as js:
            await submit(js, settings, "job-cli", uris)
            results = await wait_results(js, settings, "job-cli", 6)
            await consumer_idle(js, settings)
        _, metrics = wait_http(f"http://127.0.0.1:{port}/metrics", proc, log_path)
        descendants = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = log_path.read_text()

    assert {r["status"] for r in results} == {"ok"}
    served = settings.model.pipeline  # each task's outcome and each batch's stages under it
    assert f'inference_worker_tasks_total{{outcome="ok",pipeline="{served}"}} 6.0' in metrics
    loads = f'inference_worker_batch_duration_seconds_count{{pipeline="{served}",stage="load"}}'
    assert any(
        line.startswith(loads) and float(line.split()[1]) >= 1 for line in metrics.splitlines()
    )
    assert "inference_worker_stalled 0.0" in metrics
    assert "inference_worker_inflight_tasks 0.0" in metrics
    assert device_info(metrics) == [
        (
            {
                "device": "cpu",
                "UUID": "",
                "GPU_I_ID": "",
                "mig_uuid": "",
                "name": "cpu",
                "torch_version": torch.__version__,
                "cuda_version": torch.version.cuda or "",
                "driver_version": "",
            },
            1.0,
        )
    ]
    assert code == 0, stderr[-3000:]
    assert len(descendants) >= 2  # loader children (and the forkserver)
    assert until_gone(descendants) == []


def test_run_refuses_impossible_settings_with_one_line_naming_the_fields(settings_for, nats_server):
    settings = settings_for(nats_server.url)
    env = worker_env(settings, WORKER_LOADER__TIMEOUT_S="40", WORKER_HEALTH__STALL_TIMEOUT_S="30")
    done = cli("run", env=env)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.startswith("config error:")]
    assert len(lines) == 1
    assert "WORKER_LOADER__TIMEOUT_S" in lines[0] and "WORKER_HEALTH__STALL_TIMEOUT_S" in lines[0]


def test_check_says_ready_or_names_each_problem(settings_for, nats_server):
    settings = settings_for(nats_server.url)
    env = worker_env(settings)
    assert cli("provision", env=env).returncode == 0
    ready = cli("check", env=env)
    assert ready.returncode == 0, ready.stderr
    assert "ready" in ready.stdout
    unreachable = f"nats://worker:hunter2@127.0.0.1:{free_port()}"
    broken = cli("check", env={**env, "WORKER_NATS__URL": unreachable})
    assert broken.returncode == 1
    assert "NATS at nats://127.0.0.1:" in broken.stderr and "unreachable" in broken.stderr
    assert "hunter2" not in broken.stderr + broken.stdout


def test_check_loads_every_served_pipeline_and_names_the_one_that_cannot_load(
    settings_for, nats_server, tmp_path
):
    from pipelines.models import save_classifier

    tomls = []
    for name, seed in (("animals", 1), ("colours", 2)):
        weights = save_classifier("mobilenet_v3_small", ["a", "b"], str(tmp_path / name), seed=seed)
        toml = tmp_path / f"{name}.toml"
        arch = "mobilenet_v3_small" if name == "animals" else "resnet18"  # not its weights
        toml.write_text(
            f'name = "{name}"\n[classifier]\nkey = "{name}"\narchitecture = "{arch}"\n'
            f'weights = "{weights}"\n'
        )
        tomls.append(str(toml))
    env = worker_env(settings_for(nats_server.url), WORKER_MODEL__PIPELINES=",".join(tomls))
    assert cli("provision", env=env).returncode == 0
    done = cli("check", env=env, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    model_lines = [line for line in done.stderr.splitlines() if "model:" in line]
    assert model_lines and all("colours" in line for line in model_lines), done.stderr
    assert not any("animals" in line for line in model_lines)


@pytest.mark.parametrize(
    "command",
    [
        ["provision"],
        ["results", "--job", "j"],
        ["submit", "--job", "j", "s3://b/k.jpg"],
        ["submit", "--job", "j", "--wait", "s3://b/k.jpg"],
        ["watch", "--job", "j"],
    ],
)
def test_a_command_that_cannot_reach_nats_says_so_in_one_line_and_exits_1(
    settings_for, nats_server, command
):
    unreachable = f"nats://worker:hunter2@127.0.0.1:{free_port()}"
    env = worker_env(
        settings_for(nats_server.url),
        WORKER_NATS__URL=unreachable,
        WORKER_NATS__COMMAND_CONNECT_TIMEOUT_S="1",
    )
    done = cli(*command, env=env)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert lines == [
        f"error: NATS at {unreachable.replace('worker:hunter2@', '')} could not be "
        "reached within 1.0s"
    ]
    assert "hunter2" not in done.stderr + done.stdout
    assert "nats_connection_closed" not in done.stderr, "a close it asked for, not a lost link"


async def test_provision_is_idempotent_and_updates_an_existing_consumer(settings_for, nats_server):
    settings = settings_for(nats_server.url)
    env = worker_env(settings)
    first, again = cli("provision", env=env), cli("provision", env=env)
    assert first.returncode == again.returncode == 0
    assert f"created stream {settings.nats.tasks_stream}" in first.stdout
    assert f"updated stream {settings.nats.tasks_stream}" in again.stdout
    assert cli("provision", env={**env, "WORKER_NATS__MAX_DELIVER": "2"}).returncode == 0
    async with client(settings) as js:
        info = await js.consumer_info(settings.nats.tasks_stream, settings.nats.consumer)
        results = await js.stream_info(settings.nats.results_stream)
    assert info.config.max_deliver == 2
    assert results.config.max_msgs_per_subject == 1 and results.config.discard_new_per_subject


async def test_submit_and_results_commands(nats_server, s3_server, bucket, settings_for):
    settings = settings_for(nats_server.url)
    env = worker_env(settings)
    upload_images(s3_server.client(), bucket, 3, prefix="listing")
    assert cli("provision", env=env).returncode == 0
    submitted = cli("submit", "--job", "job-listed", f"s3://{bucket}/listing/", env=env)
    assert submitted.returncode == 0, submitted.stderr
    assert "submitted 3 tasks" in submitted.stdout
    shown = cli("results", "--job", "job-listed", env=env)
    assert shown.returncode == 0
    assert "ok=0 error=0 missing=3" in shown.stderr


async def test_a_job_larger_than_the_publish_window_is_stored_once_and_a_failure_raises(
    nats_server, settings_for
):
    import nats

    from worker.commands.job_client import make_tasks, publish_tasks
    from worker.nats.provision import provision

    settings = settings_for(nats_server.url)
    tasks = make_tasks("job-window", [f"s3://b/{i}.jpg" for i in range(150)])
    async with client(settings) as js:
        with pytest.raises(nats.errors.Error):  # no stream takes tasks.<pipeline> yet
            await publish_tasks(js, settings.nats, settings.model.pipeline, tasks)
        await provision(js, settings.nats, settings.model.pipeline)
        first = await publish_tasks(js, settings.nats, settings.model.pipeline, tasks)
        again = await publish_tasks(js, settings.nats, settings.model.pipeline, tasks)
        info = await js.stream_info(settings.nats.tasks_stream)

    assert (first.new, first.duplicates) == (150, 0)
    assert (again.new, again.duplicates) == (0, 150), "the stream's PubAcks said duplicate"
    assert info.state.messages == 150, "a republished job is dropped by its task ids"


async def test_run_until_idle_serves_what_is_queued_then_exits_0(
    nats_server, s3_server, bucket, settings_for
):
    from worker.commands.job_client import job_results

    settings = settings_for(nats_server.url)
    env = worker_env(settings)
    uris = upload_images(s3_server.client(), bucket, 5, prefix="burst")
    assert cli("provision", env=env).returncode == 0
    async with client(settings) as js:
        await submit(js, settings, "job-burst", uris)
    done = cli("run", "--until-idle", env=env, timeout=120)  # no polling: it ends by itself
    assert done.returncode == 0, done.stderr[-3000:]
    async with client(settings) as js:
        results = await job_results(js, settings.nats, "job-burst")
    assert sorted(r["status"] for r in results) == ["ok"] * 5


def test_sigterm_while_nats_is_unreachable_at_start_ends_the_process_with_0_and_no_children(
    settings_for, tmp_path
):
    # Nothing listens on this port: the start waits on NATS, reconnecting, for ever.
    settings = settings_for(f"nats://127.0.0.1:{free_port()}")
    log_path = tmp_path / "worker.log"
    with worker_process(worker_env(settings), log_path) as proc:
        deadline = time.monotonic() + 60
        while "nats_error" not in log_path.read_text():  # it is waiting on NATS now
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        descendants = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert len(loader_children(proc.pid)) >= 2, "the loader started before NATS is tried"
        proc.send_signal(signal.SIGTERM)  # one signal: no second one needed
        code = proc.wait(timeout=30)
    assert code == 0, log_path.read_text()[-3000:]
    assert "stopped while starting" in log_path.read_text()
    assert until_gone(descendants) == []


def test_sigterm_while_the_model_is_still_loading_ends_the_process_with_0_and_no_children(
    settings_for, s3_server, bucket, model_path, tmp_path
):
    from pathlib import Path

    from testing.shapednet import Shape, ShapedProxy

    s3 = s3_server.client()
    for name in ("model.pt", "labels.txt"):
        s3.upload_file(str(Path(model_path).parent / name), bucket, f"model/{name}")
    # The first GET (the weights or their labels) gets no byte for a minute: the start is
    # loading the model when the signal comes.
    quiet = Shape(first_byte_median_s=0.0, bytes_per_s=0.0, stall_first=1, stall_s=60)
    with ShapedProxy(s3_server.port, quiet) as proxy:
        settings = settings_for(f"nats://127.0.0.1:{free_port()}")
        env = worker_env(
            settings,
            WORKER_S3__ENDPOINT_URL=proxy.url,
            WORKER_S3__READ_TIMEOUT_S="40",
            WORKER_S3__MAX_ATTEMPTS="1",
            WORKER_LOADER__TIMEOUT_S="50",
            WORKER_HEALTH__STALL_TIMEOUT_S="55",
            WORKER_MODEL__WEIGHTS=f"s3://{bucket}/model/model.pt",
        )
        log_path = tmp_path / "worker.log"
        with worker_process(env, log_path) as proc:
            deadline = time.monotonic() + 60
            while proxy.stats()["stalled"] < 1:  # the model's read is on the wire, stalled
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.2)
            while len(loader_children(proc.pid)) < 2:  # they start while the model loads
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.05)
            descendants = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            proc.send_signal(signal.SIGTERM)
            # Well before the stalled read would give up (40 s): the start is abandoned.
            code = proc.wait(timeout=30)
    assert code == 0, log_path.read_text()[-3000:]
    assert "stopped while starting" in log_path.read_text()
    assert until_gone(descendants) == []
