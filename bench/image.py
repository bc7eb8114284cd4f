"""The image `make image` built, run here: a job served by the container, its start time and
its size (BENCHMARKS.md, "The container image").

    .venv/bin/python -m bench.image [--image localhost/inference-worker:latest] [--images 24]

Starts a nats-server and an S3 endpoint (moto) on 127.0.0.1, uploads images of coloured
rectangles, provisions the streams with this checkout's CLI, then runs the image with
podman on the host's network (the demo's colour classifier, shipped in the package, so no
model file is downloaded), times `podman run` to the first `/readyz` 200 from outside the
container, submits the job from the host and waits for every result, runs the image's
HEALTHCHECK, and stops the container with SIGTERM (a drain: exit 0).
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.common.records import save
from worker.commands.demo_images import rectangles_bytes
from worker.commands.localservers import NatsServer, S3Server, free_port

PIPELINE = "worker.commands.demo_models:colour_classifier"
READY_WAIT_S = 600.0
# This machine (a container itself: cgroups v1, no systemd, capped rlimits) runs containers
# with PODMAN="podman --runtime runc --cgroup-manager=cgroupfs"; a host with systemd needs
# none of it.
PODMAN = shlex.split(os.environ.get("PODMAN", "podman"))
COLOURS = ("red", "green", "blue")


def _readyz(port: int) -> int | None:
    """/readyz's status from outside the container, or None when nothing answers yet."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        return int(opener.open(f"http://127.0.0.1:{port}/readyz", timeout=2).status)
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def _cli(env: dict[str, str], *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    command = [str(Path(sys.executable).with_name("inference-worker")), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)


def _upload(s3: S3Server, count: int) -> None:
    client = s3.client()
    client.create_bucket(Bucket="image-run")
    for i in range(count):
        colour = COLOURS[i % 3]
        body = rectangles_bytes(640, 480, [(40, 40, 600, 440, colour)])
        client.put_object(Bucket="image-run", Key=f"job/{i:04d}-{colour}.jpg", Body=body)


def _podman_run(image: str, env: dict[str, str], name: str) -> None:
    flags = [f"--env={key}={value}" for key, value in env.items()]
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    command = [*PODMAN, "run", "-d", "--name", name, "--network", "host", "--shm-size", "1g"]
    # No systemd here to time the HEALTHCHECK: it is run by hand below. Limits no higher than
    # this process's own (raising them is refused in a container without CAP_SYS_RESOURCE).
    command += ["--health-interval", "disable", "--ulimit", f"nofile={files}:{files}"]
    command += ["--ulimit", "nproc=4096:4096"]
    subprocess.run([*command, *flags, image], check=True, capture_output=True, timeout=120)


def _wait_ready(port: int, started: float) -> float:
    while time.monotonic() - started < READY_WAIT_S:
        if _readyz(port) == 200:
            return time.monotonic() - started
        time.sleep(0.2)
    raise TimeoutError(f"/readyz not 200 within {READY_WAIT_S:.0f} s")


def _podman(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=120)


def _serve_a_job(host: dict[str, str], name: str) -> dict[str, object]:
    """From outside the container: the job submitted and waited for, its results read, the
    image's HEALTHCHECK run."""
    submitted = time.monotonic()
    uris = "s3://image-run/job/"
    done = _cli(host, "submit", "--job", "image-run", "--pipeline", "colours", uris, "--wait")
    job_s = time.monotonic() - submitted
    results = _cli(host, "results", "--job", "image-run")
    ok = sum(1 for line in results.stdout.splitlines() if '"status": "ok"' in line)
    return {
        "submit_exit": done.returncode,
        "submit_tail": (done.stdout + done.stderr).strip().splitlines()[-2:],
        "job_s": round(job_s, 1),
        "results_ok": ok,
        "healthcheck_exit": _podman("healthcheck", "run", name).returncode,
    }


def _stopped(name: str) -> dict[str, object]:
    """SIGTERM (a drain), then how the container ended and the worker's last line."""
    stopped = _podman("stop", "-t", "90", name)
    code = _podman("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
    logs = _podman("logs", name).stderr.strip().splitlines()
    _podman("rm", "-f", name)
    return {"stop_exit": stopped.returncode, "container_exit": code, "last_log": logs[-1:]}


def run(image: str, images: int) -> dict[str, object]:
    name = f"iw-image-run-{os.getpid()}"
    with NatsServer() as nats, S3Server() as s3:
        _upload(s3, images)
        port = free_port()
        env = {
            "WORKER_NATS__URL": nats.url,
            "WORKER_S3__ENDPOINT_URL": s3.endpoint_url,
            "WORKER_MODEL__PIPELINE": PIPELINE,
            "WORKER_METRICS__PORT": str(port),
            "WORKER_LOADER__NUM_WORKERS": "2",
            **s3.credentials_env(),
        }
        host = {**os.environ, **env}
        provisioned = _cli(host, "provision")
        assert provisioned.returncode == 0, provisioned.stderr
        started = time.monotonic()
        _podman_run(image, env, name)
        figures: dict[str, object] = {}
        try:
            figures["start_to_readyz_200_s"] = round(_wait_ready(port, started), 1)
            figures |= _serve_a_job(host, name)
        finally:
            figures |= _stopped(name)
    size = _podman("image", "inspect", "-f", "{{.Size}}", image).stdout
    return {"image": image, "image_bytes": int(size), "images": images, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="localhost/inference-worker:latest")
    parser.add_argument("--images", type=int, default=24)
    args = parser.parse_args()
    figures = run(args.image, args.images)
    command = "PODMAN=... python -m bench.image " + " ".join(sys.argv[1:])
    save("image", {"command": command, "date": time.strftime("%Y-%m-%d"), **figures}, echo=True)


if __name__ == "__main__":
    main()
