"""The Antenna source's parts against the fake Antenna (a real HTTP server on 127.0.0.1), and
the fake's own documented behaviours: what a worker relies on."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from config.aliases import alias_overrides
from config.redact import scrub
from config.settings import ConfigError, load_settings
from tests.antenna_fake import FakeAntenna, reserved_port
from tests.unit.antenna.common import (
    SERVED,
    SLUG,
    TOKEN,
    CoreSettle,
    client_of,
    images,
    outcome,
    parts_of,
    reserve_all,
    source_of,
    task_of,
)
from worker.antenna.catalog import Catalog
from worker.antenna.client import AntennaClient
from worker.antenna.identity import client_info
from worker.antenna.job_listing import JobRotation
from worker.antenna.post import Poster
from worker.antenna.reservations import Reservations
from worker.antenna.settle import AntennaSettler
from worker.antenna.source import AntennaSource


async def test_the_token_echoed_in_a_task_is_masked_in_the_log_and_intact_in_the_data(
    fake: FakeAntenna, capsys: pytest.CaptureFixture[str]
) -> None:
    """Given Antenna's answer echoes the token in a task's image id, the log line that names
    the malformed task shows it masked, while a well-formed task's data keeps it as it came
    (an image id is matched, not shown)."""
    import logging

    from config.logging import configure_logging

    fake.add_job(
        SLUG, [(f"bad-{TOKEN}", "http://127.0.0.1:1/a.jpg"), (f"good-{TOKEN}", "http://x/b.jpg")]
    )
    fake.spoil(f"bad-{TOKEN}", lambda t: {**t, "image_url": None})
    source = source_of(fake)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    configure_logging("INFO", json=True, secrets=(TOKEN,))
    # No logger of the modules used here may keep this chain for later tests' capture_logs.
    structlog.configure(cache_logger_on_first_use=False)
    try:
        got = await reserve_all(source, 2)
    finally:
        structlog.reset_defaults()
        root.handlers[:], root.level = handlers, level
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    (malformed,) = [e for e in lines if e["event"] == "antenna_task_malformed"]
    assert malformed["image_id"] == "bad-<redacted>"
    assert not [e for e in lines if TOKEN in json.dumps(e)]
    (good,) = [d for d in got if d.handle.image_id.startswith("good-")]
    assert task_of(good).image_id == f"good-{TOKEN}" == good.handle.image_id


async def test_client_info_goes_with_each_reservation_and_result_and_holds_no_secret(
    fake: FakeAntenna,
) -> None:
    info = client_info("svc", (SLUG,), 3)
    job = fake.add_job(SLUG, images(2))
    client = client_of(fake)
    source = AntennaSource(
        client,
        JobRotation(client, (SLUG,), 0.05, 100),
        Reservations(fake.ttr_s, 60.0, 2, batch_size=2),
        reservation_size=2,
        wait_s=0.05,
        max_deliver=2,
        client_info=info,
    )
    got = await reserve_all(source, 2)
    poster = Poster(client, 10**6, 5.0, client_info=info)
    catalog = Catalog([SLUG])
    catalog.add(SERVED)
    rules = CoreSettle(AntennaSettler(poster, catalog, 10**6))
    verdicts = await asyncio.gather(*(rules.settle(task_of(d), d, outcome()) for d in got))
    assert verdicts == ["ok", "ok"] and fake.jobs[job].done == {"i0", "i1"}
    endpoints = [endpoint for endpoint, _ in fake.client_infos]
    assert "tasks" in endpoints and "result" in endpoints
    assert all(seen == info for _, seen in fake.client_infos)
    assert info["hostname"] and info["pid"] and info["pipelines"] == [SLUG]
    assert info["software"] == "inference-worker" and info["version"]
    assert TOKEN not in json.dumps(fake.client_infos)
    # Antenna refuses a client_info that is not an object: the fake does too
    refused = await client.post(
        f"jobs/{job}/tasks/", "tasks", b'{"batch_size": 1, "client_info": "me"}'
    )
    assert refused.status == 400


async def test_the_token_goes_with_the_configured_scheme_and_is_masked_in_what_is_shown(
    fake: FakeAntenna,
) -> None:
    job = fake.add_job(SLUG, images(1))
    ask = b'{"batch_size": 1}'
    fake.schemes = {"Api-Key"}  # an Antenna that takes processing-service keys only
    as_token = await client_of(fake).post(f"jobs/{job}/tasks/", "tasks", ask)
    api_key = AntennaClient(fake.url, SecretStr(TOKEN), 5.0, scheme="Api-Key")
    as_key = await api_key.post(f"jobs/{job}/tasks/", "tasks", ask)
    assert as_token.status == 401  # another scheme: anonymous there
    assert as_key.status == 200 and len(as_key.body["tasks"]) == 1
    fake.schemes = {"Token"}  # Antenna's main
    assert (await api_key.post(f"jobs/{job}/tasks/", "tasks", ask)).status == 401
    assert set(fake.headers_seen) == {f"Token {TOKEN}", f"Api-Key {TOKEN}"}
    echoed = json.dumps({"detail": f"bad header Api-Key {TOKEN}"}).encode()
    fake.misbehave("tasks", "json", status=500, body=echoed)
    shown = await api_key.post(f"jobs/{job}/tasks/", "tasks", ask)
    assert shown.status == 500 and TOKEN not in shown.why() and TOKEN not in shown.text
    assert "Api-Key <redacted>" in scrub(f"Authorization: Api-Key {TOKEN}")
    with pytest.raises(ConfigError, match="WORKER_ANTENNA__AUTH_SCHEME"):
        load_settings(for_worker=False, antenna={"auth_scheme": "Bearer"})


async def test_the_fake_down_on_a_reserved_port_keeps_it_then_serves_on_it() -> None:
    bound = reserved_port()
    port = bound.getsockname()[1]
    try:
        with pytest.raises(ConnectionRefusedError):  # down: as an Antenna with nothing up
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with socket.socket() as other, pytest.raises(OSError):  # no other process takes it
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind(("127.0.0.1", port))
        fake = FakeAntenna(token=TOKEN)
        with fake.running(bound=bound):  # up again, on the same port
            assert fake.url == f"http://127.0.0.1:{port}/api/v2"
            assert (await client_of(fake).get("jobs/", "jobs", {"limit": 1})).ok
    finally:
        bound.close()


async def test_an_empty_fetch_waits_as_long_as_the_antenna_setting_says_not_the_nats_one(
    fake: FakeAntenna,
) -> None:
    # WORKER_ANTENNA__FETCH_WAIT_S is Antenna's own: WORKER_NATS__FETCH_TIMEOUT_S (which
    # once set both) tunes NATS only.
    antenna = {"base_url": fake.url, "token": TOKEN, "project_ids": "1", "poll_interval_s": 0.05}
    default = load_settings(for_worker=False, antenna=antenna)
    nats_only = load_settings(for_worker=False, antenna=antenna, nats={"fetch_timeout_s": 7.0})
    assert default.antenna.fetch_wait_s == nats_only.antenna.fetch_wait_s == 1.0
    registry = CollectorRegistry()
    configured = load_settings(
        for_worker=False,
        antenna={**antenna, "fetch_wait_s": 0.3},
        nats={"fetch_timeout_s": 7.0},
    )
    for settings_, wait_s in ((default, 1.0), (nats_only, 1.0), (configured, 0.3)):
        parts = parts_of(settings_, registry if settings_ is configured else None)
        try:
            assert parts.link.fetch_wait_s == wait_s
            if settings_ is configured:  # no job: the fetch gives nothing after the wait
                started = time.monotonic()
                assert await parts.source.fetch(4) == []
                assert 0.3 <= time.monotonic() - started < 3.0
        finally:
            parts.client.close()
    # The parts counted into the metrics they were made with (the jobs were listed)
    listed = registry.get_sample_value(
        "inference_worker_antenna_requests_total", {"endpoint": "jobs", "status": "200"}
    )
    assert listed is not None and listed >= 1


def test_amis_names_are_aliases_and_ours_win() -> None:
    environ = {
        "AMI_ANTENNA_API_AUTH_TOKEN": "t1",
        "AMI_NUM_WORKERS": "3",
        "WORKER_LOADER__NUM_WORKERS": "2",
    }
    overrides, used = alias_overrides(environ, {"AMI_ANTENNA_API_BASE_URL": "http://h/api/v2"})
    assert overrides == {"antenna": {"token": "t1", "base_url": "http://h/api/v2"}}
    assert "WORKER_LOADER__NUM_WORKERS set, AMI_NUM_WORKERS ignored" in used
    assert "WORKER_ANTENNA__TOKEN from AMI_ANTENNA_API_AUTH_TOKEN" in used


def test_the_token_never_shows_in_the_settings() -> None:
    from config.settings import load_settings

    s = load_settings(for_worker=False, antenna={"token": "very-secret-1"})
    assert "very-secret-1" not in repr(s) and "very-secret-1" not in str(s.model_dump())
    assert s.antenna.token.get_secret_value() == "very-secret-1"


def test_the_antenna_source_needs_a_base_url_and_full_score_vectors() -> None:
    from config.errors import ConfigError
    from config.settings import load_settings

    with pytest.raises(ConfigError) as refused:
        load_settings(for_worker=False, source="antenna", model={"scores": "top_k"})
    lines = str(refused.value).splitlines()
    assert any("WORKER_ANTENNA__BASE_URL" in line for line in lines)
    assert any("WORKER_MODEL__SCORES=all" in line for line in lines)
    with pytest.raises(ConfigError, match="WORKER_HEALTH__DRAIN_TIMEOUT_S"):
        load_settings(
            for_worker=False, source="antenna", antenna={"base_url": "http://h/api/v2", "ttr_s": 10}
        )


async def test_a_burst_run_is_not_idle_the_moment_it_settles_its_own_last_task() -> None:
    """The wait for tasks left out by others counts only while this process holds none: a
    job still listed a moment after our last post is not 'tasks out elsewhere'."""
    fake = FakeAntenna(token=TOKEN, ttr_s=60.0)
    fake.register_direct(1, SERVED.config())
    with fake.running():
        fake.add_job(SLUG, images(3))
        source = source_of(fake, idle_wait_s=0.5)
        held = await reserve_all(source, 3)
        deadline = time.monotonic() + 0.8
        while time.monotonic() < deadline:  # rounds that give nothing while ours are held
            assert await source.fetch(3) == []
        assert not await source.idle()
        for delivery in held:
            delivery.handle.posted()
        assert not await source.idle(), "idle at once: the wait counted our own held time"
        assert source.still_out() is None


async def test_nothing_is_reserved_from_jobs_of_a_pipeline_that_cannot_be_loaded_here(
    fake: FakeAntenna,
) -> None:
    # "orders"' models cannot be loaded on this host: what it reserved could only be left to
    # redelivery (a delivery of two spent), so its job is not asked at all; "moths" serves.
    orders = fake.add_job("orders", images(3, "o"))
    moths = fake.add_job(SLUG, images(3, "m"))
    client = client_of(fake)
    source = AntennaSource(
        client,
        JobRotation(client, (SLUG, "orders"), 0.05, 100),
        Reservations(fake.ttr_s, 60.0, 10, batch_size=10),
        reservation_size=10,
        wait_s=0.05,
        max_deliver=2,
    )
    got: list[Any] = []
    for _ in range(4):
        got += await source.fetch(10, available=lambda pipeline: pipeline != "orders")
    assert {task_of(d).image_id for d in got} == {"m0", "m1", "m2"}
    asked = {path for method, path, _ in fake.requests if method == "POST"}
    assert f"/api/v2/jobs/{moths}/tasks/" in asked
    assert f"/api/v2/jobs/{orders}/tasks/" not in asked
    assert fake.pending(orders) == {"o0", "o1", "o2"}
