"""A local HTTP listener that records every request it sees, for tests of the source policy.

Bound to 127.0.0.1 on a free port; routes by path: ``/image`` serves ``body``,
``/redirect?to=URL`` redirects, ``/drip`` sends a byte every ``drip_interval_s``, ``/endless``
streams bytes with no Content-Length, ``/hints`` answers ``100 Continue`` (unasked) and
``103 Early Hints`` before serving ``body`` as ``/image`` does, ``/hints-forever`` answers
``103`` every ``drip_interval_s``. With ``head_interval_s`` every answer's status line and
headers are sent one byte every ``head_interval_s`` (a server, or a proxy, that holds a read
before its body: any path, an S3 GET included). Every loop is bounded in count and time. With
``keep_alive`` it answers HTTP/1.1 and keeps connections open (``/endless`` excepted);
``connections`` counts the connections it accepted.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

_MAX_DRIP_BYTES = 600
_ENDLESS_CHUNKS = 4096
_EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"


class Listener:
    def __init__(
        self,
        body: bytes = b"",
        drip_interval_s: float = 0.1,
        keep_alive: bool = False,
        head_interval_s: float | None = None,
    ) -> None:
        self.body = body
        self.drip_interval_s = drip_interval_s
        self.head_interval_s = head_interval_s
        self.requests: list[str] = []
        self.connections = 0
        self._stop = threading.Event()
        listener = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def setup(self) -> None:
                super().setup()
                listener.connections += 1

            def do_GET(self) -> None:
                listener.requests.append(self.path)
                path = urlsplit(self.path).path
                if listener.head_interval_s is not None:
                    self._trickle_head(listener.head_interval_s)
                elif path == "/hints":
                    self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n" + _EARLY_HINTS)
                    self._serve_body()
                elif path == "/hints-forever":
                    self._drip_raw(_EARLY_HINTS * _MAX_DRIP_BYTES, len(_EARLY_HINTS))
                elif path == "/redirect":
                    target = parse_qs(urlsplit(self.path).query)["to"][0]
                    self.send_response(302)
                    self.send_header("Location", target)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif path == "/drip":
                    self._drip()
                elif path == "/endless":
                    self._endless()
                else:
                    self._serve_body()

            def _serve_body(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(listener.body)))
                self.end_headers()
                self.wfile.write(listener.body)

            def _trickle_head(self, interval_s: float) -> None:
                head = (
                    f"{self.protocol_version} 200 OK\r\nContent-Type: image/jpeg\r\n"
                    f"Content-Length: {len(listener.body)}\r\n\r\n"
                ).encode()
                self._drip_raw(head + listener.body, 1, interval_s)

            def _drip_raw(self, data: bytes, step: int, interval_s: float | None = None) -> None:
                """``data`` ``step`` bytes at a time, one step every ``interval_s`` (the drip
                interval when None), then the connection closed; ended early at stop."""
                self.close_connection = True
                wait_s = listener.drip_interval_s if interval_s is None else interval_s
                for start in range(0, len(data), step):
                    try:
                        self.wfile.write(data[start : start + step])
                        self.wfile.flush()
                    except OSError:
                        return
                    if listener._stop.wait(wait_s):
                        return

            def _drip(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(_MAX_DRIP_BYTES))
                self.end_headers()
                for _ in range(_MAX_DRIP_BYTES):
                    if listener._stop.wait(listener.drip_interval_s):
                        return
                    try:
                        self.wfile.write(b"x")
                        self.wfile.flush()
                    except OSError:
                        return

            def _endless(self) -> None:
                self.close_connection = True
                self.send_response(200)
                self.end_headers()  # no Content-Length: the body ends when the server closes
                chunk = b"y" * 65536
                for _ in range(_ENDLESS_CHUNKS):
                    try:
                        self.wfile.write(chunk)
                    except OSError:
                        return

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def __enter__(self) -> Listener:
        self._thread.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
