"""The process's life: a signal only records that the process should stop, a second one exits
at once, and a start a signal comes before is given up and still closed."""

from __future__ import annotations

import asyncio
import signal

from config.settings import load_settings
from worker.serve import Server


def a_server() -> tuple[Server, list[int]]:
    server = Server(load_settings(for_worker=False))
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

    async def start(self) -> None:
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
    async def start(self) -> None:
        raise RuntimeError("no model")


async def test_a_start_that_fails_raises_its_failure():
    server, _ = a_server()
    try:
        await server.startup(FailsToStart())  # type: ignore[arg-type]
    except RuntimeError as error:
        assert str(error) == "no model"
    else:
        raise AssertionError("the failure was swallowed")
