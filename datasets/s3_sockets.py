"""The sockets under a botocore S3 client's requests, so that one deadline bounds a whole GET.

botocore's read timeout bounds each ``recv``: an endpoint (or a proxy in front of it) that
sends a header byte just inside it each time holds ``get_object`` for as long as it likes,
before any body exists to watch. ``watching`` puts the socket of every request made on this
thread under a ``Cutoff`` the moment its answer starts to be read (connect is bounded by the
connect timeout, a GET's few hundred bytes leave at once): at the deadline the socket is shut
down, the read blocked on it ends, and the caller reports the deadline.

The one place that reaches into botocore's and urllib3's internals (the client's connection
pool classes, a connection's ``sock``), with a fallback: ``watch_requests`` returns False when
the layout has moved, and the body alone is watched (``uris.body_socket``), as before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

from datasets.deadline import Cutoff, Watch

_local = threading.local()


def _note(sock: Any) -> None:
    """Put ``sock`` under this thread's cutoff, if it is watching."""
    cutoff: Cutoff | None = getattr(_local, "cutoff", None)
    if cutoff is not None and sock is not None:
        _local.watches.append(cutoff.watch(sock))


@contextmanager
def watching(cutoff: Cutoff) -> Iterator[None]:
    """Every answer read on this thread meanwhile is read under ``cutoff``; at the end the
    watches are released (a kept-alive connection outlives the exchange it served)."""
    _local.cutoff, _local.watches = cutoff, []
    try:
        yield
    finally:
        watches: list[Watch] = _local.watches
        _local.cutoff, _local.watches = None, []
        for watch in watches:
            watch.release()


@cache
def _pool_classes() -> dict[str, type]:
    """botocore's connection pools for http and https, whose connections note their socket
    when an answer starts to be read."""
    from botocore import awsrequest

    class _HTTP(awsrequest.AWSHTTPConnection):
        def getresponse(self, *args: Any, **kwargs: Any) -> Any:
            _note(self.sock)
            return super().getresponse(*args, **kwargs)

    class _HTTPS(awsrequest.AWSHTTPSConnection):
        def getresponse(self, *args: Any, **kwargs: Any) -> Any:
            _note(self.sock)
            return super().getresponse(*args, **kwargs)

    class _HTTPPool(awsrequest.AWSHTTPConnectionPool):
        ConnectionCls = _HTTP

    class _HTTPSPool(awsrequest.AWSHTTPSConnectionPool):
        ConnectionCls = _HTTPS

    return {"http": _HTTPPool, "https": _HTTPSPool}


def watch_requests(client: Any) -> bool:
    """Make ``client``'s connections note their socket for ``watching``; before its first
    request. False when botocore's layout has moved (nothing changed then)."""
    try:
        session = client._endpoint.http_session
        by_scheme = session._pool_classes_by_scheme
        manager = session._manager
    except AttributeError:
        return False
    if not isinstance(by_scheme, dict) or set(by_scheme) != {"http", "https"}:
        return False
    by_scheme.update(_pool_classes())  # also the proxy managers made later
    manager.pool_classes_by_scheme = by_scheme
    return True
