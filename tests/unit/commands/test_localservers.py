"""The ports the local servers and the tests' workers are given (commands/localservers.py)."""

from __future__ import annotations

import socket

from config.derived import HEALTHZ_PORT_OFFSET
from worker.commands import localservers
from worker.commands.localservers import free_port


def test_a_port_whose_healthz_port_is_held_is_never_given(monkeypatch):
    # Given a port free for its metrics but whose /healthz port (the offset above) is held,
    # drawn first
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held_healthz = holder.getsockname()[1]
        crowded = held_healthz - HEALTHZ_PORT_OFFSET
        draws = iter([crowded])

        def draw(low: int, high: int) -> int:
            return next(draws, 0) or localservers.random.SystemRandom().randrange(low, high)

        monkeypatch.setattr(localservers.random, "randrange", draw)
        # When a free port is asked for
        port = free_port()
    # Then that one is passed over for one whose own port and /healthz port both bind
    assert port != crowded
    for each in (port, port + HEALTHZ_PORT_OFFSET):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", each))


def test_a_port_handed_out_before_keeps_its_healthz_port_from_the_next(monkeypatch):
    # Given a port handed out for a server not started yet
    first = free_port()
    # When the next draw falls on its /healthz port, free to bind as nothing listens there yet
    draws = iter([first + HEALTHZ_PORT_OFFSET, first - HEALTHZ_PORT_OFFSET])

    def draw(low: int, high: int) -> int:
        return next(draws, 0) or localservers.random.SystemRandom().randrange(low, high)

    monkeypatch.setattr(localservers.random, "randrange", draw)
    port = free_port()
    # Then neither that one nor one whose /healthz port is the first is given
    assert abs(port - first) not in (0, HEALTHZ_PORT_OFFSET)
