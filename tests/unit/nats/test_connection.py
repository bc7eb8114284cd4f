"""What the NATS connection's state tells /healthz, how a store retry waits for a new
connection, and a results check that a silent replica does not hold up (the client itself:
tests/integration/test_stale_connection.py and the chaos suite's cluster_node_frozen_r3)."""

from __future__ import annotations

import asyncio

from config.errors import ResultsUnavailable
from config.settings import NatsSettings
from worker.nats.connection import ConnectionState
from worker.nats.patience import patiently
from worker.nats.result_store import ResultStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_stale_connection_is_a_problem_once_another_server_had_time_to_answer():
    clock = Clock()
    state = ConnectionState(clock)
    state.came_up("nats://a:4222")
    state.went_down()  # nats-py reported no error first: the pings went unanswered
    assert not state.connected()
    assert state.problem(down_timeout_s=60) is None, "a reconnect elsewhere takes a moment"
    clock.now += 6  # one server tried in vain (5 s), and the wait before the next
    problem = state.problem(down_timeout_s=60)
    assert problem is not None and "stale" in problem
    state.came_up("nats://b:4222")
    assert state.connected() and state.problem(down_timeout_s=60) is None


def test_a_connection_the_server_closed_gets_the_disconnect_grace():
    clock = Clock()
    state = ConnectionState(clock)
    state.came_up("nats://a:4222")
    state.errored()  # nats-py reports the server's close (unexpected EOF), then disconnects
    clock.now += 0.01
    state.went_down()
    assert not state.stale and state.problem(down_timeout_s=60) is None
    clock.now += 61
    assert (state.problem(down_timeout_s=60) or "").startswith("nats: disconnected for 61s")


def test_our_own_close_is_no_stale_connection():
    state = ConnectionState(Clock())
    state.came_up("nats://a:4222")
    state.went_down(ours=True)
    assert not state.stale and state.problem(down_timeout_s=60) is None


def test_the_defaults_notice_a_silent_server_within_20_s():
    s = NatsSettings()
    assert s.ping_interval_s * (s.max_outstanding_pings + 1) <= 20 < s.store_retry_s


async def test_a_store_retried_while_reconnecting_is_made_on_the_new_connection_at_once():
    state = ConnectionState()
    state.came_up("nats://a:4222")
    state.went_down()
    tries: list[bool] = []

    async def write() -> None:
        tries.append(state.connected())
        if not state.connected():
            raise ResultsUnavailable("results stream unavailable: TimeoutError")

    async def reconnect() -> None:
        await asyncio.sleep(0.5)
        state.came_up("nats://b:4222")

    reconnecting = asyncio.create_task(reconnect())
    await asyncio.wait_for(patiently(write, 10.0, state.until_connected), 5)
    await reconnecting
    assert tries == [False, True], "one try while down, the next as soon as it is back"


class SilentReplicaJetStream:
    """A direct get lands on a replica that never answers; the stream's leader does."""

    def __init__(self) -> None:
        self.asked: list[bool] = []

    async def get_last_msg(self, stream: str, subject: str, direct: bool = False) -> object:
        self.asked.append(direct)
        if direct:
            await asyncio.Event().wait()  # a frozen node: no answer, ever
        return object()


async def test_a_stored_result_asked_of_a_silent_replica_is_found_through_the_leader():
    js = SilentReplicaJetStream()
    n = NatsSettings()
    store = ResultStore(
        js,  # type: ignore[arg-type]
        stream=n.results_stream,
        objects=n.result_objects,
        publish_timeout_s=n.publish_timeout_s,
    )
    assert await asyncio.wait_for(store.exists("job", "task"), 3) is True
    assert js.asked == [True, False]


def test_a_reconnect_tries_the_other_servers_before_the_one_that_went_silent():
    from urllib.parse import urlparse

    from nats.aio.client import Server

    from worker.nats.connection import _NextServer

    state = ConnectionState(Clock())
    state.came_up("nats://127.0.0.1:4222")
    state.went_down()
    lost, b, c = (Server(urlparse(f"nats://127.0.0.1:{port}")) for port in (4222, 4223, 4224))
    choose = _NextServer(state)
    first, wait_s = choose([lost, b, c], {})
    assert first is b and wait_s == 0
    assert choose([lost, b, c], {}) == (c, 0.0)  # b did not answer either
    assert choose([lost, b, c], {}) == (lost, 0.0)
    assert choose([lost, b, c], {})[1] == 1.0, "each known server tried once, then a second apart"


def test_servers_that_failed_in_an_earlier_outage_still_come_before_the_silent_one():
    """nats-py's ``reconnects`` counts each server's failures since it last connected to it:
    after an earlier outage the other nodes carry old counts and the node just lost none."""
    from urllib.parse import urlparse

    from nats.aio.client import Server

    from worker.nats.connection import _NextServer

    state = ConnectionState(Clock())
    state.came_up("nats://127.0.0.1:4222")
    state.went_down()
    lost, b, c = (Server(urlparse(f"nats://127.0.0.1:{port}")) for port in (4222, 4223, 4224))
    b.reconnects = c.reconnects = 20
    choose = _NextServer(state)
    picked = [choose([lost, b, c], {})[0] for _ in range(3)]
    assert picked[:2] in ([b, c], [c, b]) and picked[2] is lost
