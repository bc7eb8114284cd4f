"""The process's life: a signal only records that the process should stop, a second one exits
at once, and a start a signal comes before is given up and still closed."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import psutil
import pytest

from config.errors import ConfigError
from config.settings import load_settings
from worker.health.procstats import living
from worker.process.serve import Lifetime, kill_descendants


def a_server() -> tuple[Lifetime, list[int]]:
    server = Lifetime(load_settings(for_worker=False))
    exits: list[int] = []
    server.exit_now = exits.append
    return server, exits


async def test_the_first_signal_asks_for_a_drain_and_the_second_exits_at_once():
    server, exits = a_server()
    server.handle_exit(signal.SIGTERM)
    assert server.should_exit.is_set() and exits == []
    server.handle_exit(signal.SIGINT)
    assert exits == [130]


class StartsForever:
    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = False

    async def start(self, _checked: object = None) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()  # NATS unreachable: it retries for ever
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def test_a_signal_during_the_start_gives_the_start_up():
    server, exits = a_server()
    app = StartsForever()
    starting = asyncio.create_task(server.startup(app))  # type: ignore[arg-type]
    await asyncio.wait_for(app.started.wait(), 5)
    server.handle_exit(signal.SIGTERM)
    assert await asyncio.wait_for(starting, 5) is False
    assert app.cancelled and exits == []


class FailsToStart:
    async def start(self, _checked: object = None) -> None:
        raise RuntimeError("no model")


async def test_a_start_that_fails_raises_its_failure():
    server, _ = a_server()
    try:
        await server.startup(FailsToStart())  # type: ignore[arg-type]
    except RuntimeError as error:
        assert str(error) == "no model"
    else:
        raise AssertionError("the failure was swallowed")


async def test_an_unusable_run_dir_is_a_config_error_before_anything_starts(monkeypatch):
    monkeypatch.setenv("WORKER_RUN_DIR", "/proc/iw")
    server = Lifetime(load_settings(for_worker=False))
    with pytest.raises(ConfigError, match="WORKER_RUN_DIR=/proc/iw"):
        await server.serve()


def test_the_second_signals_exit_kills_and_reaps_the_children_first():
    # A stand-in for the worker: a child (the fork server) with a child of its own (a loader).
    script = (
        "import subprocess, sys; c = subprocess.Popen(['sleep', '60']);"
        " print(c.pid, flush=True); sys.stdin.read()"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        grandchild = int(parent.stdout.readline())  # type: ignore[union-attr]
        assert psutil.pid_exists(grandchild)
        # As in exit_at_once, from the worker's side: its descendants, recursively.
        assert kill_descendants(parent.pid, timeout_s=10) == []
        assert not living([grandchild])
    finally:
        parent.kill()
        parent.wait(10)
