"""One deadline per object (``datasets.deadline.Cutoff``): a read blocked on a socket whose
peer trickles or says nothing returns at the deadline, and a socket released in time is left
whole for the next request on it."""

from __future__ import annotations

import socket
import threading
import time

from datasets.deadline import Cutoff


def test_a_read_blocked_past_the_deadline_returns_and_the_cut_is_said():
    ours, peer = socket.socketpair()
    got: list[bytes] = []
    with ours, peer, Cutoff(0.2) as cutoff:
        watch = cutoff.watch(ours)
        reader = threading.Thread(target=lambda: got.append(ours.recv(10)))
        reader.start()
        reader.join(timeout=30)  # the peer sends nothing: only the cut ends the read
        assert not reader.is_alive() and got == [b""]
        assert cutoff.expired() and cutoff.fired
        assert watch.release() is False  # cut: not to be reused
        assert cutoff.remaining_s() == 0.0


def test_a_socket_released_before_the_deadline_is_not_cut_and_stays_usable():
    ours, peer = socket.socketpair()
    with ours, peer, Cutoff(0.3) as cutoff:
        watch = cutoff.watch(ours)
        peer.sendall(b"ok")
        assert ours.recv(2) == b"ok"
        assert watch.release() is True
        time.sleep(0.5)  # past the deadline: a released watch cuts nothing
        peer.sendall(b"again")
        assert ours.recv(5) == b"again" and not cutoff.fired


def test_without_a_socket_the_deadline_is_still_read():
    with Cutoff(0.0) as cutoff:
        assert cutoff.watch(None).release() is True
        assert cutoff.expired() and not cutoff.fired
