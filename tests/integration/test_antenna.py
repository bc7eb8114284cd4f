"""The worker process with ``WORKER_SOURCE=antenna`` against the fake Antenna
(tests/antenna_fake.py, a real HTTP server): register, a mixed job, SIGKILL and restart, a 503
storm on result, two jobs."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.antenna_fake import FakeAntenna, reserved_port
from tests.antenna_pipelines import ANIMALS
from tests.helpers import cli, start_run
from worker.commands.demo_images import corrupt_bytes, rectangles_bytes
from worker.commands.demo_models import COLOURS
from worker.commands.localservers import stop_process

pytestmark = pytest.mark.integration
TOKEN = "s3cr3t-antenna-token-7f1c2a9e"
# Antenna keeps results only of a pipeline with a detector: the demo's, no weights files.
PIPELINE = "boxes-and-colours"
DECLARED = "worker.commands.demo_models:boxes_and_colours"


@pytest.fixture
def antenna() -> Iterator[FakeAntenna]:
    fake = FakeAntenna(token=TOKEN)
    with fake.running():
        yield fake


def env_for(fake: FakeAntenna, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKER_", "AMI_"))}
    host = fake.url.split("/")[2]
    env.update(
        {
            "WORKER_SOURCE": "antenna",
            "WORKER_ANTENNA__BASE_URL": fake.url,
            "WORKER_ANTENNA__TOKEN": TOKEN,
            "WORKER_ANTENNA__PROJECT_IDS": "1",
            "WORKER_ANTENNA__POLL_INTERVAL_S": "0.3",
            "WORKER_SOURCES__ALLOWED_HOSTS": host,
            "WORKER_ANTENNA__FETCH_WAIT_S": "0.3",
            "WORKER_LOADER__NUM_WORKERS": "1",
            "WORKER_LOADER__BATCH_SIZE": "4",
            "WORKER_S3__HTTP_TIMEOUT_S": "3",
            "WORKER_MODEL__PIPELINE": DECLARED,
            "WORKER_MODEL__DEVICE": "cpu",
            "WORKER_METRICS__PORT": "0",
            "WORKER_LOG_LEVEL": "INFO",
        }
    )
    env.update(extra)
    return env


def add_images(fake: FakeAntenna, prefix: str, count: int) -> list[tuple[str, str]]:
    images = []
    for i in range(count):
        name = f"{prefix}-{i}.jpg"
        colour = COLOURS[i % len(COLOURS)]  # one bright box: one detection each
        fake.images[name] = rectangles_bytes(96 + 8 * (i % 3), 80, [(20, 16, 60, 56, colour)])
        images.append((f"{prefix}{i}", fake.media_url(name)))
    return images


def wait_for(
    condition: Callable[[], bool],
    timeout_s: float,
    what: str,
    log: Path,
    proc: subprocess.Popen[bytes] | None = None,
) -> None:
    """Until ``condition``; an AssertionError after ``timeout_s``, or as soon as ``proc``
    has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"the worker exited {proc.returncode} before {what}:\n{log.read_text()[-4000:]}"
            )
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout_s}s; worker log:\n{log.read_text()[-4000:]}")


def events(log: Path) -> list[dict[str, Any]]:
    """The worker's JSON log lines."""
    lines = log.read_text(errors="replace").splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def held(fake: FakeAntenna, job: int) -> int:
    """How many of ``job``'s tasks are reserved and not yet answered."""
    return sum(1 for t in fake.jobs[job].tasks.values() if t.delivered and not t.acked)


def registered(fake: FakeAntenna) -> None:
    done = cli("register", env=env_for(fake), timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout


def saved_once(fake: FakeAntenna, job: int, images: list[tuple[str, str]]) -> dict[str, Any]:
    saved = fake.jobs[job].saved
    return {image: len(saved.get(image, [])) for image, _ in images}


def test_register_is_idempotent_and_a_mixed_job_completes_with_every_image_saved_once(
    antenna: FakeAntenna, tmp_path: Path
) -> None:
    first = cli("register", env=env_for(antenna), timeout=120)
    again = cli("register", env=env_for(antenna), timeout=120)
    assert first.returncode == 0 and "created" in first.stdout, first.stderr
    assert again.returncode == 0 and "already registered" in again.stdout, again.stderr
    (config,) = [p["config"] for p in antenna.projects[1].values()]
    detector, classifier = config["algorithms"]
    assert detector["task_type"] == "localization" and "category_map" not in detector
    assert classifier["category_map"]["labels"] == list(COLOURS)
    assert classifier["key"].startswith("colour-classifier-")

    good = add_images(antenna, "good", 6)
    antenna.images["corrupt.jpg"] = corrupt_bytes()
    bad = [("corrupt", antenna.media_url("corrupt.jpg")), ("gone", antenna.media_url("no.jpg"))]
    job = antenna.add_job(PIPELINE, good + bad)
    log = tmp_path / "worker.log"
    proc = start_run(env_for(antenna), log, "--until-idle")
    try:
        assert proc.wait(timeout=180) == 0, log.read_text()[-4000:]
    finally:
        stop_process(proc)

    assert antenna.jobs[job].status == "SUCCESS"
    assert antenna.pending(job) == set()
    assert saved_once(antenna, job, good) == {image: 1 for image, _ in good}
    assert antenna.jobs[job].failed == {"corrupt", "gone"}  # error results with image_id
    text = log.read_text()
    assert TOKEN not in text
    assert all(TOKEN.encode() not in body for body in antenna.bodies)
    assert antenna.headers_seen and set(antenna.headers_seen) == {f"Token {TOKEN}"}


def test_run_serves_only_its_projects_jobs_with_its_auth_scheme_and_says_who_it_is(
    antenna: FakeAntenna, tmp_path: Path
) -> None:
    antenna.schemes = {"Api-Key"}  # an Antenna that takes processing-service keys only
    antenna.projects[2] = {}
    env = env_for(antenna, WORKER_ANTENNA__AUTH_SCHEME="Api-Key")
    done = cli("register", env=env, timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout
    ours = antenna.add_job(PIPELINE, add_images(antenna, "p", 3), project=1)
    theirs = antenna.add_job(PIPELINE, add_images(antenna, "q", 3), project=2)
    log = tmp_path / "worker.log"
    proc = start_run(env, log, "--until-idle")  # WORKER_ANTENNA__PROJECT_IDS=1
    try:
        assert proc.wait(timeout=180) == 0, log.read_text()[-4000:]
    finally:
        stop_process(proc)
    assert antenna.jobs[ours].status == "SUCCESS"
    assert antenna.jobs[theirs].status == "STARTED"
    assert all(t.delivered == 0 for t in antenna.jobs[theirs].tasks.values())
    assert set(antenna.headers_seen) == {f"Api-Key {TOKEN}"}
    sent = {endpoint for endpoint, _ in antenna.client_infos}
    assert sent == {"tasks", "result"}, sent
    (info,) = {json.dumps(i, sort_keys=True) for _, i in antenna.client_infos}
    assert json.loads(info)["pipelines"] == [PIPELINE] and json.loads(info)["pid"] == proc.pid
    assert TOKEN not in info and TOKEN not in log.read_text()


def test_sigkill_mid_job_and_a_restart_lose_nothing_antenna_would_not_redeliver(
    tmp_path: Path,
) -> None:
    fake = FakeAntenna(token=TOKEN, ttr_s=8.0)
    with fake.running():
        registered(fake)
        images = add_images(fake, "k", 24)
        job = fake.add_job(PIPELINE, images)
        env = env_for(fake, WORKER_ANTENNA__TTR_S="8", WORKER_HEALTH__DRAIN_TIMEOUT_S="5")
        log = tmp_path / "worker.log"
        proc = start_run(env, log)
        try:
            wait_for(lambda: len(fake.jobs[job].done) >= 4, 120, "4 images saved", log)
            fake.results_unavailable = True  # what it holds now stays held until the kill
            seen = len(fake.requests)
            wait_for(
                lambda: any(r[2] == 503 for r in fake.requests[seen:]), 60, "a result held", log
            )
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            held = {
                t.image_id for t in fake.jobs[job].tasks.values() if t.delivered and not t.acked
            }
            assert held, "the killed process held no reservation"
            fake.results_unavailable = False
            proc = start_run(env, log)
            wait_for(lambda: fake.jobs[job].status == "SUCCESS", 180, "the job done", log)
        finally:
            stop_process(proc)
        assert fake.lost(job) == set() and fake.jobs[job].failed == set()
        assert saved_once(fake, job, images) == {image: 1 for image, _ in images}
        redelivered = {t.image_id for t in fake.jobs[job].tasks.values() if t.delivered == 2}
        assert held <= redelivered  # what the killed process held came back, once


def test_a_503_storm_on_result_loses_nothing(antenna: FakeAntenna, tmp_path: Path) -> None:
    registered(antenna)
    images = add_images(antenna, "s", 10)
    antenna.fail_results = 6  # the next six result posts answer 503
    job = antenna.add_job(PIPELINE, images)
    log = tmp_path / "worker.log"
    proc = start_run(env_for(antenna), log, "--until-idle")
    try:
        assert proc.wait(timeout=180) == 0, log.read_text()[-4000:]
    finally:
        stop_process(proc)
    assert antenna.fail_results == 0
    assert antenna.jobs[job].status == "SUCCESS" and antenna.jobs[job].failed == set()
    assert saved_once(antenna, job, images) == {image: 1 for image, _ in images}
    assert all(t.delivered == 1 for t in antenna.jobs[job].tasks.values())
    assert "result_post_retried" in log.read_text()


def test_a_small_job_behind_a_large_one_finishes_long_before_it(
    antenna: FakeAntenna, tmp_path: Path
) -> None:
    registered(antenna)
    large = antenna.add_job(PIPELINE, add_images(antenna, "L", 60))
    small = antenna.add_job(PIPELINE, add_images(antenna, "S", 5))
    log = tmp_path / "worker.log"
    proc = start_run(env_for(antenna), log, "--until-idle")
    try:
        wait_for(lambda: antenna.jobs[small].status == "SUCCESS", 180, "the small job done", log)
        left_in_large = len(antenna.pending(large))
        assert proc.wait(timeout=240) == 0, log.read_text()[-4000:]
    finally:
        stop_process(proc)
    assert left_in_large >= 30, f"the small job waited for the large one ({left_in_large} left)"
    assert antenna.jobs[large].status == "SUCCESS"
    times = antenna.jobs[large].result_times
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) < 30  # the large job kept getting results while the small one ran


def test_sigterm_posts_what_is_finished_reserves_nothing_more_and_metrics_show_antenna(
    tmp_path: Path,
) -> None:
    import urllib.request

    from worker.commands.localservers import free_port

    fake = FakeAntenna(token=TOKEN, ttr_s=6.0)
    with fake.running():
        registered(fake)
        images = add_images(fake, "t", 40)
        job = fake.add_job(PIPELINE, images)
        port = free_port()
        env = env_for(
            fake,
            WORKER_ANTENNA__TTR_S="6",
            WORKER_HEALTH__DRAIN_TIMEOUT_S="4",
            WORKER_METRICS__PORT=str(port),
            WORKER_LOADER__BATCH_SIZE="2",
        )
        log = tmp_path / "worker.log"
        proc = start_run(env, log)
        try:
            wait_for(lambda: len(fake.jobs[job].done) >= 4, 120, "4 images saved", log)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                metrics = answer.read().decode()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
                assert answer.status == 200
            stopped_at = len(fake.requests)  # before the signal: a request racing it counts
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, log.read_text()[-4000:]
        finally:
            stop_process(proc)
        after = fake.requests[stopped_at:]
        assert sum(1 for m, path, _ in after if path.endswith("/tasks/")) <= 1  # one in flight
        # Every result the worker finished was posted and saved by Antenna, the last ones too
        finished = {e["image_id"] for e in events(log) if e.get("event") == "task_done"}
        assert len(finished) >= 4 and finished <= fake.jobs[job].done, finished
        assert all(status == 200 for m, path, status in after if path.endswith("/result/"))
        assert 'inference_worker_antenna_requests_total{endpoint="tasks",status="200"}' in metrics
        assert "inference_worker_antenna_oldest_reservation_seconds_left" in metrics
        held = {t.image_id for t in fake.jobs[job].tasks.values() if t.delivered and not t.acked}
        text = log.read_text()
        assert all(f'"image_id": "{image}"' in text for image in held)  # each said in the log
        assert TOKEN not in text
        # What was left comes back from Antenna: a second worker finishes the job.
        proc = start_run(
            env_for(fake, WORKER_ANTENNA__TTR_S="6", WORKER_HEALTH__DRAIN_TIMEOUT_S="4"),
            log,
        )
        try:
            wait_for(lambda: fake.jobs[job].status == "SUCCESS", 180, "the job done", log)
        finally:
            stop_process(proc)
        assert fake.lost(job) == set()
        assert saved_once(fake, job, images) == {image: 1 for image, _ in images}


def test_one_process_serves_the_jobs_of_every_pipeline_it_serves_and_no_other(
    antenna: FakeAntenna, tmp_path: Path
) -> None:
    declared = "tests.antenna_pipelines:animals,tests.antenna_pipelines:colours"
    env = env_for(antenna, WORKER_MODEL__PIPELINES=declared)
    done = cli("register", env=env, timeout=180)
    assert done.returncode == 0, done.stderr + done.stdout
    assert set(antenna.projects[1]) == {"animals", "colours"}
    assert "of animals" in done.stdout and "of colours" in done.stdout
    antenna.register_direct(1, {**antenna.projects[1]["animals"]["config"], "slug": "other"})

    jobs = {
        "animals": (antenna.add_job("animals", add_images(antenna, "A", 5)), ANIMALS),
        "colours": (antenna.add_job("colours", add_images(antenna, "C", 5)), COLOURS),
    }
    other = antenna.add_job("other", add_images(antenna, "O", 3))
    log = tmp_path / "worker.log"
    proc = start_run(env, log, "--until-idle")
    try:
        assert proc.wait(timeout=240) == 0, log.read_text()[-4000:]
    finally:
        stop_process(proc)

    for slug, (job, labels) in jobs.items():
        assert antenna.jobs[job].status == "SUCCESS", (slug, log.read_text()[-4000:])
        saved = antenna.jobs[job].saved
        assert {image: len(found) for image, found in saved.items()} == {
            image: 1 for image in antenna.jobs[job].tasks
        }
        classifications = [c for found in saved.values() for c in found[0]["classifications"]]
        assert {c["algorithm"]["key"].rsplit("-", 1)[0] for c in classifications} == {
            f"{slug}-classifier"
        }
        assert {len(c["scores"]) for c in classifications} == {len(labels)}
    assert antenna.pending(other) == {"O0", "O1", "O2"}  # another pipeline's: never reserved
    assert not [p for _m, p, _s in antenna.requests if p.startswith(f"/api/v2/jobs/{other}/tasks")]


def test_a_pipeline_without_a_detector_is_refused_by_register_check_and_run(
    antenna: FakeAntenna, tmp_path: Path
) -> None:
    """Antenna answers 200 to its result posts and then drops every one ("Pipeline does not
    have a detection algorithm"): it is refused before anything is registered or reserved."""
    env = env_for(antenna, WORKER_MODEL__PIPELINE="worker.commands.demo_models:colour_classifier")
    registering = cli("register", env=env, timeout=120)
    checking = cli("check", env=env, timeout=120)
    antenna.register_direct(1, {"slug": "colours", "name": "colours", "version": 1})
    job = antenna.add_job("colours", add_images(antenna, "c", 3))
    log = tmp_path / "worker.log"
    proc = start_run(env, log, "--until-idle")
    try:
        code = proc.wait(timeout=120)
    finally:
        stop_process(proc)

    assert registering.returncode == 1 and "algorithm" not in registering.stdout
    assert antenna.projects[1].keys() == {"colours"}  # only what the test put there
    (refused,) = [line for line in registering.stderr.splitlines() if "not registered" in line]
    assert "'colours' has no detector" in refused and "detection algorithm" in refused
    assert checking.returncode == 1
    assert "not ready" in checking.stdout + checking.stderr
    assert "'colours' has no detector" in checking.stdout + checking.stderr
    assert code == 2, log.read_text()[-4000:]
    assert "config error: pipeline 'colours' has no detector" in log.read_text()
    assert not [p for _m, p, _s in antenna.requests if p.endswith("/tasks/")]
    assert antenna.pending(job) == {"c0", "c1", "c2"}


def test_until_idle_exits_6_when_antenna_refused_the_token_or_was_never_reached(
    antenna: FakeAntenna, tmp_path: Path
) -> None:
    from worker.commands.localservers import free_port

    registered(antenna)
    job = antenna.add_job(PIPELINE, add_images(antenna, "r", 2))
    codes = {}
    for case, extra in {
        "refused": {"WORKER_ANTENNA__TOKEN": "wrong-token-0000"},
        "unreachable": {
            "WORKER_ANTENNA__BASE_URL": f"http://127.0.0.1:{free_port()}/api/v2",
            "WORKER_ANTENNA__UNREACHABLE_WAIT_S": "3",  # never up: given up after the bound
        },
    }.items():
        log = tmp_path / f"{case}.log"
        proc = start_run(env_for(antenna, **extra), log, "--until-idle")
        try:
            codes[case] = proc.wait(timeout=120)
        finally:
            stop_process(proc)
        assert "idle_not_served" in log.read_text(), log.read_text()[-4000:]
        assert "wrong-token-0000" not in log.read_text()
        if case == "unreachable":  # retried, with backoff, then given up past the bound
            failed = [e for e in events(log) if e.get("event") == "antenna_jobs_unreachable"]
            assert len(failed) >= 2 and failed[-1]["retry_in_s"] > failed[0]["retry_in_s"]
            (why,) = [e["reason"] for e in events(log) if e.get("event") == "idle_not_served"]
            waited_s = float(why.split("jobs for ")[1].split("s ")[0])
            assert waited_s >= 3 and "WORKER_ANTENNA__UNREACHABLE_WAIT_S=3" in why, why
    assert codes == {"refused": 6, "unreachable": 6}
    assert antenna.pending(job) == {"r0", "r1"}


def test_until_idle_serves_the_projects_that_answer_then_exits_6_naming_a_refused_one(
    antenna: FakeAntenna, tmp_path: Path
) -> None:
    registered(antenna)
    job = antenna.add_job(PIPELINE, add_images(antenna, "v", 3), project=1)
    log = tmp_path / "worker.log"
    env = env_for(antenna, WORKER_ANTENNA__PROJECT_IDS="1,99")  # 99: no such project
    proc = start_run(env, log, "--until-idle")
    try:
        code = proc.wait(timeout=180)
    finally:
        stop_process(proc)
    assert antenna.jobs[job].status == "SUCCESS", log.read_text()[-4000:]
    assert code == 6, log.read_text()[-4000:]
    (why,) = [e["reason"] for e in events(log) if e.get("event") == "idle_not_served"]
    assert "project 99's jobs: HTTP 400" in why and "WORKER_ANTENNA__PROJECT_IDS" in why, why
    refused = [e for e in events(log) if e.get("event") == "antenna_project_refused"]
    assert [e["project"] for e in refused] == [99]  # said once, not at every poll


def test_until_idle_rides_out_an_antenna_restart_then_serves_its_job(tmp_path: Path) -> None:
    # The port stays bound (not listening) while Antenna is down: no other process takes it.
    bound = reserved_port()
    host = f"127.0.0.1:{bound.getsockname()[1]}"
    fake = FakeAntenna(token=TOKEN)
    log = tmp_path / "worker.log"
    with fake.running():  # for the rest of the settings: the worker is sent to the bound port
        env = env_for(
            fake,
            WORKER_ANTENNA__BASE_URL=f"http://{host}/api/v2",
            WORKER_SOURCES__ALLOWED_HOSTS=host,
            WORKER_ANTENNA__UNREACHABLE_WAIT_S="120",
        )
    proc = start_run(env, log, "--until-idle")  # Antenna down: nothing listens
    try:

        def failed() -> int:
            return sum(e.get("event") == "antenna_jobs_unreachable" for e in events(log))

        wait_for(lambda: failed() >= 3, 120, "three failed listings", log, proc)
        fake.misbehave("jobs", "down")  # up, its listing not yet: registered meanwhile
        with fake.running(bound=bound):
            registered(fake)
            images = add_images(fake, "u", 3)
            job = fake.add_job(PIPELINE, images)
            fake.behave("jobs")
            assert proc.wait(timeout=180) == 0, log.read_text()[-4000:]
    finally:
        stop_process(proc)
        bound.close()
    assert fake.jobs[job].status == "SUCCESS"
    assert saved_once(fake, job, images) == {image: 1 for image, _ in images}
    assert "idle_not_served" not in log.read_text()


def test_until_idle_holding_results_exits_6_once_antenna_is_down_past_the_bound(
    antenna: FakeAntenna, tmp_path: Path
) -> None:
    """WORKER_ANTENNA__UNREACHABLE_WAIT_S bounds an outage with results held too: the run
    once retried their posts until the reservations ran out (300 s) and exited 0."""
    registered(antenna)
    job = antenna.add_job(PIPELINE, add_images(antenna, "h", 4))
    antenna.misbehave("result", "down")  # no result post is ever answered
    env = env_for(
        antenna, WORKER_ANTENNA__UNREACHABLE_WAIT_S="3", WORKER_HEALTH__DRAIN_TIMEOUT_S="3"
    )
    log = tmp_path / "worker.log"
    proc = start_run(env, log, "--until-idle")
    try:
        wait_for(lambda: held(antenna, job) > 0, 120, "tasks reserved", log, proc)
        for endpoint in ("jobs", "tasks"):  # then Antenna is down for every call
            antenna.misbehave(endpoint, "down")
        assert proc.wait(timeout=120) == 6, log.read_text()[-4000:]
    finally:
        stop_process(proc)
    said = events(log)
    (ended,) = [e for e in said if e.get("event") == "idle_not_served"]
    assert "WORKER_ANTENNA__UNREACHABLE_WAIT_S=3" in ended["reason"], ended
    left = {e["image_id"] for e in said if e.get("event") == "task_left_to_redelivery"}
    reserved = {t.image_id for t in antenna.jobs[job].tasks.values() if t.delivered}
    assert reserved and left == reserved, log.read_text()[-4000:]
    assert not antenna.jobs[job].done


def reserved_by_an_earlier_process(fake: FakeAntenna, job: int, count: int) -> None:
    """``count`` of ``job``'s tasks reserved by a process that then vanished."""
    body = json.dumps({"batch_size": count}).encode()
    status, answer = fake.handle("POST", f"/api/v2/jobs/{job}/tasks/", {}, f"Token {TOKEN}", body)
    assert status == 200 and len(answer["tasks"]) == count


def test_until_idle_waits_for_the_tasks_an_earlier_process_left_and_serves_them(
    tmp_path: Path,
) -> None:
    # Out for 25 s: longer than the worker takes to start and serve the other two.
    fake = FakeAntenna(token=TOKEN, ttr_s=25.0)
    with fake.running():
        registered(fake)
        images = add_images(fake, "w", 6)
        job = fake.add_job(PIPELINE, images)
        reserved_by_an_earlier_process(fake, job, 4)
        log = tmp_path / "worker.log"
        env = env_for(fake, WORKER_ANTENNA__TTR_S="25", WORKER_HEALTH__DRAIN_TIMEOUT_S="5")
        proc = start_run(env, log, "--until-idle")
        try:
            assert proc.wait(timeout=180) == 0, log.read_text()[-4000:]
        finally:
            stop_process(proc)
        assert fake.jobs[job].status == "SUCCESS", log.read_text()[-4000:]
        assert saved_once(fake, job, images) == {image: 1 for image, _ in images}
        assert sum(t.delivered == 2 for t in fake.jobs[job].tasks.values()) == 4


def test_until_idle_exits_6_naming_the_job_whose_tasks_stay_out(
    antenna: FakeAntenna, tmp_path: Path
) -> None:
    registered(antenna)
    job = antenna.add_job(PIPELINE, add_images(antenna, "o", 3))
    reserved_by_an_earlier_process(antenna, job, 3)  # out for the fake's TTR, 300 s
    log = tmp_path / "worker.log"
    proc = start_run(env_for(antenna, WORKER_ANTENNA__IDLE_WAIT_S="3"), log, "--until-idle")
    try:
        code = proc.wait(timeout=120)
    finally:
        stop_process(proc)
    assert code == 6, log.read_text()[-4000:]
    (line,) = [e for e in events(log) if e.get("event") == "idle_not_served"]
    assert f"job(s) {job} as active" in line["reason"] and "TTR_S" in line["reason"]
    assert antenna.pending(job) == {"o0", "o1", "o2"}


def test_check_says_not_ready_for_a_token_that_may_not_reserve_before_any_job(
    antenna: FakeAntenna,
) -> None:
    registered(antenna)
    antenna.tokens["member-token-1234"] = {1}  # manages project 1; no superuser: 403 on tasks
    ready = cli("check", env=env_for(antenna), timeout=120)
    member = cli("check", env=env_for(antenna, WORKER_ANTENNA__TOKEN="member-token-1234"))
    assert ready.returncode == 0, ready.stdout + ready.stderr
    assert member.returncode == 1
    said = member.stdout + member.stderr
    assert "not ready" in said and "may not take tasks or post results" in said
    assert "member-token-1234" not in said


def test_150_active_jobs_the_one_with_tasks_listed_last_is_served(
    antenna: FakeAntenna, tmp_path: Path
) -> None:
    registered(antenna)
    for _ in range(149):
        antenna.add_job(PIPELINE, [])  # active, with nothing left to reserve
    images = add_images(antenna, "last", 3)
    last = antenna.add_job(PIPELINE, images)
    log = tmp_path / "worker.log"
    # The 149 stay active with nothing to give: once the wait for them is over, NOT_SERVED.
    proc = start_run(env_for(antenna, WORKER_ANTENNA__IDLE_WAIT_S="3"), log, "--until-idle")
    try:
        assert proc.wait(timeout=180) == 6, log.read_text()[-4000:]
    finally:
        stop_process(proc)
    assert "and 139 more as active" in log.read_text()
    assert antenna.jobs[last].status == "SUCCESS", log.read_text()[-4000:]
    assert saved_once(antenna, last, images) == {image: 1 for image, _ in images}
    pages = [p for _m, p, _s in antenna.requests if p.rstrip("/").split("/")[-1].isdigit()]
    assert pages == []  # no job's own page was asked: the list says all the worker needs


def test_sigterm_finishes_what_it_reserved_when_the_drain_time_allows(
    antenna: FakeAntenna, tmp_path: Path
) -> None:
    """A task given back to Antenna costs its reservation time (300 s) and one of its two
    deliveries: a stop with drain time to spare runs the held tasks' batches instead."""
    registered(antenna)
    images = []
    for i in range(40):
        name = f"big-{i}.jpg"
        antenna.images[name] = rectangles_bytes(1280, 720, [(100, 100, 400, 500, "red")])
        images.append((f"big{i}", antenna.media_url(name)))
    job = antenna.add_job(PIPELINE, images)
    # Each result post is saved, then answered over about a second: with two posts in flight,
    # the worker's reservations run ahead of its posts, so tasks wait for a batch when the
    # signal comes, whether the machine is idle or busy (a fast idle worker could otherwise
    # finish every reservation before one was seen held, a busy one have none waiting).
    # Whole answers, however many results a post gathered (an answer cut short would leave its
    # tasks to redelivery: about 170 bytes a result, and a post can gather 8 here).
    antenna.misbehave("result", "slow", interval_s=0.004, drip_bytes=4096)
    env = env_for(
        antenna,
        WORKER_LOADER__BATCH_SIZE="2",
        WORKER_LOADER__PREFETCH_BATCHES="8",
        WORKER_HEALTH__DRAIN_TIMEOUT_S="60",
    )
    log = tmp_path / "worker.log"
    proc = start_run(env, log)
    try:
        # The signal comes while tasks wait beyond the batch in hand (batches of 2).
        wait_for(
            lambda: len(antenna.jobs[job].done) >= 4 and held(antenna, job) >= 6,
            120,
            "4 images saved and 6 more reserved",
            log,
        )
        held_at_signal = held(antenna, job)
        done_at_signal = len(antenna.jobs[job].done)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log.read_text()[-4000:]
    finally:
        stop_process(proc)
    text = log.read_text()
    tasks = antenna.jobs[job].tasks.values()
    reserved = {t.image_id for t in tasks if t.delivered}
    assert {t.image_id for t in tasks if t.delivered and not t.acked} == set(), text[-4000:]
    assert "drain_finished_held" in text, text[-4000:]  # some were waiting at the signal
    # What it held at the signal was run and saved after it, not given back.
    assert len(antenna.jobs[job].done) >= done_at_signal + held_at_signal, text[-4000:]
    assert reserved <= antenna.jobs[job].done and "task_left_to_redelivery" not in text
    assert all(t.delivered <= 1 for t in tasks)
    assert "never retrieved" not in text, text[-4000:]  # no post's failure left unread


def stopped_while_reserving(
    fake: FakeAntenna, tmp_path: Path, answer_in_s: float, **extra: str
) -> tuple[int, str]:
    """A worker SIGTERMed while its first reservation is in flight: Antenna has reserved the
    tasks and holds its answer ``answer_in_s`` (a proxy, a busy server). The job's id and
    the worker's log once it exited 0."""
    registered(fake)
    job = fake.add_job(PIPELINE, add_images(fake, "r", 4))
    fake.misbehave("tasks", "late", times=1, interval_s=answer_in_s)
    log = tmp_path / "worker.log"
    proc = start_run(env_for(fake, **extra), log)
    try:
        wait_for(lambda: held(fake, job) > 0, 120, "a reservation made", log, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
    finally:
        stop_process(proc)
    return job, log.read_text()


def test_a_reservation_answered_during_the_drain_is_run_and_its_results_posted(
    antenna: FakeAntenna, tmp_path: Path
) -> None:
    # Its answer comes 8 s after the signal, well within the drain's 60 s: the tasks Antenna
    # reserved are run and posted, not lost to the TTR (once cancelled after FETCH_WAIT_S + 5 s
    # with no line, and they came back only after the TTR, as their last delivery).
    job, text = stopped_while_reserving(antenna, tmp_path, 8.0, WORKER_HEALTH__DRAIN_TIMEOUT_S="60")
    tasks = antenna.jobs[job].tasks.values()
    reserved = {t.image_id for t in tasks if t.delivered}
    assert reserved and reserved <= antenna.jobs[job].done, text[-4000:]
    assert "task_left_to_redelivery" not in text and "antenna_reservation_unanswered" not in text


def test_a_reservation_still_unanswered_when_the_drain_ends_is_named(
    antenna: FakeAntenna, tmp_path: Path
) -> None:
    job, text = stopped_while_reserving(antenna, tmp_path, 8.0, WORKER_HEALTH__DRAIN_TIMEOUT_S="3")
    said = [
        e
        for e in events(tmp_path / "worker.log")
        if e.get("event") == "antenna_reservation_unanswered"
    ]
    assert len(said) == 1, text[-4000:]
    assert said[0]["job_id"] == job and said[0]["asked"] == 4
    assert said[0]["action"] == "left to Antenna's redelivery"
    assert "WORKER_ANTENNA__TTR_S" in said[0]["hint"]


def test_a_failed_register_prints_no_algorithm_lines(antenna: FakeAntenna) -> None:
    done = cli("register", env=env_for(antenna, WORKER_ANTENNA__PROJECT_IDS="1,42"), timeout=120)
    assert done.returncode == 1
    assert "project 1: boxes-and-colours created" in done.stdout
    (refused,) = [line for line in done.stderr.splitlines() if line.startswith("not registered")]
    assert "project 42: HTTP 404" in refused and "<" not in refused
    assert "algorithm " not in done.stdout  # keys that may be in no project: not listed


def posted_images(fake: FakeAntenna) -> list[str]:
    """The image of every result in every body the worker posted, in order."""
    images = []
    for body in fake.bodies:
        for entry in json.loads(body)["results"]:
            result = entry["result"]
            sources = result.get("source_images")
            images += [s["id"] for s in sources] if sources else [result.get("image_id")]
    return images


def test_result_posts_slower_than_finish_within_never_stop_the_reservations(
    tmp_path: Path,
) -> None:
    """Each result post is answered over about 7 s, longer than FINISH_WITHIN_S (half the 12 s TTR)
    and shorter than the TTR (5 s to spare for the rest, on a busy machine): one task at a time
    measures a rate that finishes less than one task within it. The worker still reserves
    whenever it holds nothing, and the job ends with each task reserved and posted once (it used
    to reserve two tasks, then none again while /healthz said ok: the rate is measured only from
    what is held)."""
    fake = FakeAntenna(token=TOKEN, ttr_s=12.0)
    with fake.running():
        registered(fake)
        images = add_images(fake, "p", 3)
        job = fake.add_job(PIPELINE, images)
        # About 235 bytes (head and body of one result's answer), one every 30 ms.
        fake.misbehave("result", "slow", interval_s=0.030)
        env = env_for(
            fake,
            WORKER_ANTENNA__TTR_S="12",
            WORKER_LOADER__BATCH_SIZE="1",
            WORKER_HEALTH__DRAIN_TIMEOUT_S="5",
        )
        log = tmp_path / "worker.log"
        proc = start_run(env, log, "--until-idle")
        try:
            wait_for(lambda: fake.jobs[job].status == "SUCCESS", 90, "the job done", log, proc)
            assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
        finally:
            stop_process(proc)
        assert sorted(posted_images(fake)) == sorted(image for image, _ in images)
        assert all(t.delivered == 1 for t in fake.jobs[job].tasks.values())
        assert saved_once(fake, job, images) == {image: 1 for image, _ in images}
