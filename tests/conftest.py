"""Shared fixtures: real servers on free ports, a small model, generated images.

Tests that need a server fail (not skip) when CI=true and the server cannot be found.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from config.errors import ServerNotFound
from tests.cputime import (  # noqa: F401 - hooks: the CPU time report at the end
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_runtest_protocol,
    pytest_terminal_summary,
)
from worker.commands.localservers import NatsServer, S3Server

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PIPELINE = "mobilenet-v3-small-classifier"
ARCHITECTURE = "mobilenet_v3_small"
LABELS = ["cat", "dog", "bird", "fish", "horse"]


# Run first, in this order: with several runners (make test's -n 3 --maxschedchunk 1, one
# test handed out at a time) the long tests start at once and the short ones fill the gaps, so
# the runners end together. First the tests of tests/slowest.tsv, longest first; then by
# marker. The sort is stable: a file's tests keep their order.
_FIRST = ("chaos", "slow", "supervisord", "integration")
_SLOWEST = Path(__file__).parent / "slowest.tsv"


# Tests of 20 s or more in a quiet serial run (--durations, 2026-12-01) in files whose other
# tests are short; whole files of such tests say so in their own pytestmark.
_SLOW = (
    "tests/integration/test_run_dir.py::test_group_kills_mid_job_leave_nothing_once_a_clean",
    "tests/integration/test_antenna.py::test_a_503_storm_on_result_loses_nothing",
    "tests/integration/test_antenna.py::test_sigterm_posts_what_is_finished",
    "tests/integration/test_antenna.py::test_sigkill_mid_job_and_a_restart",
    "tests/integration/test_antenna.py::test_register_is_idempotent",
    "tests/unit/antenna/test_source.py::test_a_29176_class_result",
    "tests/integration/test_alerts.py::",
    "tests/integration/test_cli.py::test_check_says_ready_or_names_each_problem",
    "tests/integration/test_nothing_lost.py::test_sigterm_mid_job_finishes_the_batch",
)


def _measured_walls() -> dict[str, float]:
    walls = {}
    for line in _SLOWEST.read_text().splitlines():
        if line and not line.startswith("#"):
            wall_s, nodeid = line.split("\t")
            walls[nodeid] = float(wall_s)
    return walls


def _skip_cuda_tests_without_cuda(items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip, saying why, where torch sees no CUDA device (the GPU kit,
    bench/gpukit, runs them where it does)."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return
    import torch

    if not torch.cuda.is_available():
        for item in marked:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _skip_cuda_tests_without_cuda(items)
    for item in items:
        if item.nodeid.startswith(_SLOW):
            item.add_marker(pytest.mark.slow)
    walls = _measured_walls()

    def rank(item: pytest.Item) -> tuple[int, float]:
        if item.nodeid in walls:
            return 0, -walls[item.nodeid]
        marked = [n for n, name in enumerate(_FIRST) if item.get_closest_marker(name)]
        return 1 + min(marked, default=len(_FIRST)), 0.0

    items.sort(key=rank)


def _unavailable(what: str, error: Exception) -> None:
    message = f"{what} unavailable: {error}"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session", autouse=True)
def aws_env() -> Iterator[None]:
    # Before any loader starts: the forkserver keeps the environment it started with.
    saved = {k: os.environ.get(k) for k in S3Server().credentials_env()}
    os.environ.update(S3Server().credentials_env())
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def model_file_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Model files the tests' workers download go to a cache of this session's (passed on by
    ``tests.helpers.worker_env``), never to the user's ``~/.cache``."""
    name = "WORKER_MODEL__CACHE_DIR"
    saved = os.environ.get(name)
    path = tmp_path_factory.mktemp("model-files")
    os.environ[name] = str(path)
    yield path
    if saved is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = saved


def _started_nats(store_dir: str) -> NatsServer:
    server = NatsServer(store_dir=store_dir)
    try:
        server.start()
    except (ServerNotFound, RuntimeError) as error:
        _unavailable("nats-server", error)
    return server


@pytest.fixture(scope="session")
def shared_nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = _started_nats(str(tmp_path_factory.mktemp("nats")))
    yield server
    server.stop()


@pytest.fixture
def nats_server(shared_nats_server: NatsServer) -> Iterator[NatsServer]:
    """The session's nats-server; every stream a test made is deleted after it (the SPEC's
    subjects, ``tasks.>`` and ``results.>``, can be held by one stream at a time)."""
    yield shared_nats_server
    asyncio.run(_delete_streams(shared_nats_server.url))


@pytest.fixture
def own_nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server of the test's own, for tests that stop and start it."""
    server = _started_nats(str(tmp_path / "nats"))
    yield server
    server.stop()


async def _delete_streams(url: str) -> None:
    import nats

    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        for name in await js.streams_info():
            await js.delete_stream(name.config.name)
    finally:
        await nc.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    try:
        server.start()
    except Exception as error:  # noqa: BLE001 - any start failure means no S3 endpoint
        _unavailable("S3 endpoint (moto server)", error)
    yield server
    server.stop()


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    name = f"images-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pipelines.models import save_classifier

    return save_classifier(ARCHITECTURE, LABELS, str(tmp_path_factory.mktemp("model")))


@pytest.fixture
def settings_for(model_path: str, s3_server: S3Server) -> Any:
    """Settings for a worker against the given nats server; keyword groups override."""
    from config.settings import load_settings

    unique = uuid.uuid4().hex[:8].upper()

    def make(nats_url: str, **groups: dict[str, Any]) -> Any:
        base: dict[str, dict[str, Any]] = {
            "nats": {
                "url": nats_url,
                "tasks_stream": f"TASKS_{unique}",
                "results_stream": f"RESULTS_{unique}",
                "dead_letter_stream": f"DEAD_{unique}",
                "advisory_stream": f"ADVISORIES_{unique}",
                "consumer": f"worker-{unique}",
                "result_objects": f"OBJECTS_{unique}",
                "algorithms": f"ALGORITHMS_{unique}",
                "fetch_timeout_s": 0.5,
                # A test's streams hold little. JetStream reserves every stream's limit on
                # the server's disk and refuses a stream past what the disk holds; the tests
                # share one server, so their reservations add up.
                "tasks_max_bytes": 64 * 1024**2,
                "dead_letter_max_bytes": 16 * 1024**2,
                "advisory_max_bytes": 16 * 1024**2,
                "nak_backoff_base_s": 0.1,
                "nak_backoff_max_s": 0.5,
            },
            "s3": {
                "endpoint_url": s3_server.endpoint_url,
                "connect_timeout_s": 1,
                "read_timeout_s": 3,
                "max_attempts": 1,
            },
            "loader": {"num_workers": 2, "batch_size": 4, "timeout_s": 10},
            "model": {"pipeline": PIPELINE, "weights": model_path, "device": "cpu", "top_k": 3},
            # The watchdog is process-wide: never let it kill the test runner.
            "health": {"stall_timeout_s": 30, "drain_timeout_s": 10, "watchdog_timeout_s": 0},
            "metrics": {"port": 0},
        }
        for group, values in groups.items():
            base[group] = {**base.get(group, {}), **values}
        return load_settings(**base)

    return make
