"""The botocore adapter: the client's connections note their socket, so a watching thread's
deadline reaches an answer's headers; its release leaves a kept connection alone."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

from datasets import s3_sockets
from datasets.deadline import Cutoff
from datasets.s3_sockets import watch_requests, watching
from datasets.uris import SourceConfig, s3_client


def test_an_s3_client_is_made_with_connections_that_note_their_socket(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    client = s3_client(SourceConfig(s3_endpoint_url="http://127.0.0.1:9", s3_region="eu-west-2"))
    pools = client._endpoint.http_session._manager.pool_classes_by_scheme
    assert {
        pools["http"].ConnectionCls.__qualname__,
        pools["https"].ConnectionCls.__qualname__,
    } == {
        "_pool_classes.<locals>._HTTP",
        "_pool_classes.<locals>._HTTPS",
    }


def test_a_moved_layout_changes_nothing_and_says_so():
    assert watch_requests(SimpleNamespace()) is False


def test_a_noted_socket_is_cut_at_the_deadline_while_watched_and_left_alone_after():
    left, right = socket.socketpair()
    with left, right, Cutoff(0.1) as cutoff:
        left.settimeout(5.0)
        with watching(cutoff):
            s3_sockets._note(left)  # what a connection does as its answer starts
            assert left.recv(1) == b""  # shut down at the deadline: the read ends at once
        assert cutoff.fired
    left, right = socket.socketpair()
    with left, right, Cutoff(0.1) as cutoff:
        with watching(cutoff):
            s3_sockets._note(left)
        time.sleep(0.3)  # past the deadline, the watch released before it
        right.sendall(b"x")
        left.settimeout(5.0)
        assert left.recv(1) == b"x" and not cutoff.fired
