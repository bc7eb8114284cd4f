"""The worker process with ``WORKER_SOURCE=antenna`` against the fake Antenna answering as the
field does (issue 33): a proxy that redirects or answers a maintenance page, malformed and cut
answers, a slow-loris link, an outage while the worker is full. Each time the process lives,
believes only Antenna's own answers, and finishes the job once the answers are sane again."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.antenna_fake import FakeAntenna
from tests.helpers import cli, start_run
from tests.integration.test_antenna import PIPELINE, wait_for
from worker.commands.demo_images import image_bytes
from worker.commands.localservers import free_port, stop_process

pytestmark = pytest.mark.integration
TOKEN = "f13ld-antenna-token-4c2b9e"
_SANE = "the job done once answers are sane"


def env_for(fake: FakeAntenna, **extra: str) -> dict[str, str]:
    from tests.integration.test_antenna import env_for as base_env

    env = base_env(fake)
    env["WORKER_ANTENNA__TOKEN"] = TOKEN
    env.update(extra)
    return env


def add_images(fake: FakeAntenna, prefix: str, count: int) -> list[tuple[str, str]]:
    images = []
    for i in range(count):
        name = f"{prefix}-{i}.jpg"
        fake.images[name] = image_bytes(96 + 8 * (i % 3), 80, seed=i)
        images.append((f"{prefix}{i}", fake.media_url(name)))
    return images


# Short health timings, kept in the order the settings require (reads < loader < stall <
# watchdog): a stall or a watchdog would show within seconds.
QUICK_HEALTH = {
    "WORKER_S3__CONNECT_TIMEOUT_S": "1",
    "WORKER_S3__READ_TIMEOUT_S": "1",
    "WORKER_S3__MAX_ATTEMPTS": "2",
    "WORKER_SOURCES__OBJECT_DEADLINE_S": "4",
    "WORKER_LOADER__TIMEOUT_S": "5",
    "WORKER_HEALTH__STALL_TIMEOUT_S": "8",
    "WORKER_HEALTH__WARM_PASS": "false",  # tight budgets: no warm pass
    "WORKER_HEALTH__WATCHDOG_TIMEOUT_S": "12",
    "WORKER_HEALTH__DRAIN_TIMEOUT_S": "10",  # shorter than the watchdog (a settings rule)
}


def ready(fake: FakeAntenna) -> None:
    done = cli("register", env=env_for(fake), timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout


def saved_once(fake: FakeAntenna, job: int) -> bool:
    saved = fake.jobs[job].saved
    return all(len(saved.get(image, [])) == 1 for image in fake.jobs[job].tasks)


def healthz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read().decode()


@pytest.mark.parametrize("kind", ["redirect", "html"])
def test_a_result_post_redirected_or_answered_with_a_page_is_not_counted_as_posted(
    tmp_path: Path, kind: str
) -> None:
    fake = FakeAntenna(token=TOKEN)
    other = FakeAntenna(token="another-origin")  # a login page on another origin: 200 HTML
    with fake.running(), other.running():
        ready(fake)
        job = fake.add_job(PIPELINE, add_images(fake, "r", 6))
        other.misbehave("", "html")
        login = other.url.replace("/api/v2", "/accounts/login/?next=/result/")
        fake.misbehave("result", kind, location=login)
        log = tmp_path / "worker.log"
        proc = start_run(env_for(fake), log)
        try:
            wait_for(
                lambda: fake.modes["result"].used >= 3 or '"task_done"' in log.read_text(),
                120,
                "3 result posts tried",
                log,
                proc,
            )
            assert proc.poll() is None, log.read_text()[-4000:]
            assert other.requests == [] and other.headers_seen == []  # nothing left home
            assert fake.jobs[job].done == set()
            assert '"task_done"' not in log.read_text()  # not counted as posted
            fake.behave()
            wait_for(lambda: fake.jobs[job].status == "SUCCESS", 120, _SANE, log, proc)
        finally:
            stop_process(proc)
        assert saved_once(fake, job)
        text = log.read_text()
        assert "redirect to" in text if kind == "redirect" else "not JSON" in text
        assert TOKEN not in text


@pytest.mark.parametrize(
    ("endpoint", "kind", "body"),
    [
        ("tasks", "json", b'{"tasks": 5}'),
        ("jobs", "json", b'{"results": 7}'),
        ("tasks", "deep", b""),
        ("tasks", "cut", b""),
        ("jobs", "badstatus", b""),
    ],
    ids=["tasks-5", "results-7", "nested", "cut", "bad-status-line"],
)
def test_a_malformed_answer_is_retried_and_the_job_finishes_once_answers_are_sane(
    tmp_path: Path, endpoint: str, kind: str, body: bytes
) -> None:
    fake = FakeAntenna(token=TOKEN, ttr_s=6.0)
    with fake.running():
        ready(fake)
        job = fake.add_job(PIPELINE, add_images(fake, "m", 6))
        fake.misbehave(endpoint, kind, times=3, body=body)
        log = tmp_path / "worker.log"
        env = env_for(fake, WORKER_ANTENNA__TTR_S="6", WORKER_HEALTH__DRAIN_TIMEOUT_S="4")
        proc = start_run(env, log)
        try:
            wait_for(lambda: fake.jobs[job].status == "SUCCESS", 120, _SANE, log, proc)
            assert proc.poll() is None, log.read_text()[-4000:]  # no exit, no restart
        finally:
            stop_process(proc)
        assert saved_once(fake, job)
        assert TOKEN not in log.read_text()


def test_one_bad_task_in_a_reservation_gets_an_error_result_and_the_rest_are_saved(
    tmp_path: Path,
) -> None:
    fake = FakeAntenna(token=TOKEN, ttr_s=6.0)
    with fake.running():
        ready(fake)
        job = fake.add_job(PIPELINE, add_images(fake, "b", 6))
        fake.spoil("b1", lambda t: {**t, "image_url": None})  # every time: it cannot be run
        superscript = {"reply_subject": "$JS.ACK.job_1.job-1-consumer.1.1\u00b2.1.1.0"}
        fake.spoil("b2", lambda t: {**t, **superscript}, times=1)  # no result could be acked
        log = tmp_path / "worker.log"
        env = env_for(fake, WORKER_ANTENNA__TTR_S="6", WORKER_HEALTH__DRAIN_TIMEOUT_S="4")
        proc = start_run(env, log)
        try:
            wait_for(lambda: fake.jobs[job].status == "SUCCESS", 120, "the job done", log, proc)
        finally:
            stop_process(proc)
        assert fake.jobs[job].failed == {"b1"}  # its error result
        saved = fake.jobs[job].saved
        assert all(len(saved.get(f"b{i}", [])) == 1 for i in (0, 2, 3, 4, 5))
        lines = log.read_text().splitlines()
        skipped = [json.loads(line) for line in lines if '"antenna_task_skipped"' in line]
        assert [(e["job_id"], e["image_id"]) for e in skipped] == [(job, "b2")]


def test_a_slow_loris_answer_ends_at_the_deadline_and_sigterm_exits_within_the_drain(
    tmp_path: Path,
) -> None:
    fake = FakeAntenna(token=TOKEN, ttr_s=12.0)  # a reservation given up comes back soon
    with fake.running():
        ready(fake)
        job = fake.add_job(PIPELINE, add_images(fake, "s", 6))
        fake.misbehave("tasks", "slow", times=1, interval_s=3.0)
        env = env_for(
            fake,
            WORKER_ANTENNA__REQUEST_TIMEOUT_S="4",
            WORKER_ANTENNA__TTR_S="12",
            WORKER_HEALTH__DRAIN_TIMEOUT_S="8",
        )
        log = tmp_path / "worker.log"
        proc = start_run(env, log)
        try:
            wait_for(
                lambda: "no complete answer within 4s" in log.read_text(), 120, "the end", log, proc
            )
            wait_for(lambda: fake.jobs[job].status == "SUCCESS", 120, _SANE, log, proc)
            # Slow again, and a stop while the reservation is dripping in.
            fake.add_job(PIPELINE, add_images(fake, "t", 2))
            fake.misbehave("tasks", "slow", interval_s=3.0)
            wait_for(lambda: fake.modes["tasks"].used >= 1, 60, "a slow reservation", log, proc)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, log.read_text()[-4000:]
        finally:
            stop_process(proc)


def test_a_result_answer_cut_mid_body_does_not_stop_the_poster(tmp_path: Path) -> None:
    fake = FakeAntenna(token=TOKEN)
    with fake.running():
        ready(fake)
        job = fake.add_job(PIPELINE, add_images(fake, "c", 8))
        fake.misbehave("result", "cut", times=2)  # served, then the answer cut
        env = env_for(fake, **QUICK_HEALTH)
        log = tmp_path / "worker.log"
        proc = start_run(env, log, "--until-idle")
        try:
            assert proc.wait(timeout=180) == 0, log.read_text()[-4000:]
        finally:
            stop_process(proc)
        assert fake.jobs[job].status == "SUCCESS"
        assert saved_once(fake, job)  # the cut ones posted again, saved once


def test_an_outage_while_full_is_blocked_not_wedged_and_results_are_posted_after(
    tmp_path: Path,
) -> None:
    fake = FakeAntenna(token=TOKEN, ttr_s=120.0)
    with fake.running():
        ready(fake)
        job = fake.add_job(PIPELINE, add_images(fake, "o", 12))
        port = free_port()
        env = env_for(
            fake,
            WORKER_ANTENNA__TTR_S="120",
            WORKER_METRICS__PORT=str(port),
            WORKER_HEALTH__DISCONNECTED_TIMEOUT_S="3",
            **QUICK_HEALTH,
        )
        fake.misbehave("result", "down")  # runserver stopped with results to post
        log = tmp_path / "worker.log"
        proc = start_run(env, log)
        try:
            wait_for(lambda: fake.modes["result"].used >= 1, 120, "a post tried", log, proc)
            for endpoint in ("jobs", "job", "tasks"):
                fake.misbehave(endpoint, "down")
            seen: list[tuple[int, str]] = []
            outage_ends = time.monotonic() + 25  # past the stall timeout and the watchdog's
            while time.monotonic() < outage_ends:
                assert proc.poll() is None, log.read_text()[-4000:]
                seen.append(healthz(port))
                time.sleep(0.5)
            assert any(status == 503 and "Antenna unreachable" in why for status, why in seen)
            assert not any("stalled" in why for _, why in seen), seen
            assert fake.jobs[job].done == set()
            fake.behave()
            wait_for(
                lambda: fake.jobs[job].status == "SUCCESS", 120, "the job done after", log, proc
            )
            assert proc.poll() is None  # never restarted
            # Ready again at the first job listing that answers (its backoff after the outage)
            wait_for(lambda: healthz(port)[0] == 200, 60, "ready again", log, proc)
        finally:
            stop_process(proc)
        assert saved_once(fake, job)
        assert "Fatal Python error" not in log.read_text()  # the watchdog never fired
