"""A directory served over HTTP on 127.0.0.1 by a real server, its GETs counted (model-file
tests: pipelines/files, ``models fetch``); it answers 403 to every GET while ``refusing`` (a
file host refusing a new host for a while), and trickles its answer's head, a byte every
``trickle_s``, while ``trickling`` (a host that holds a download without end)."""

from __future__ import annotations

import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class Served:
    """A directory served over HTTP on 127.0.0.1, its GETs counted (each may be delayed);
    ``refuse``: every GET answered with this status instead (403: a host that denies); 403 to
    each while ``refusing`` (settable while it runs), those counted in ``refused``; while
    ``trickling``, each GET's head is sent a byte every ``trickle_s``, the connection closed
    as soon as it is switched off (those GETs counted in ``trickled``)."""

    def __init__(
        self,
        root: Path,
        delay_s: float = 0.0,
        refuse: int = 0,
        refusing: bool = False,
        trickling: bool = False,
        trickle_s: float = 2.0,
    ) -> None:
        self.root = root
        self.gets = 0
        self.refusing = refusing
        self.refused = 0
        self.trickling = trickling
        self.trickled = 0
        self._stopped = threading.Event()
        counting = threading.Lock()
        served = self

        class Handler(SimpleHTTPRequestHandler):
            def do_GET(self) -> None:
                with counting:
                    served.gets += 1
                    status = refuse or (403 if served.refusing else 0)
                    served.refused += bool(status)
                time.sleep(delay_s)
                if served.trickling:
                    self._trickle_head()
                    return
                if status:
                    self.send_error(status)
                    return
                super().do_GET()

            def _trickle_head(self) -> None:
                """The head of a 200, a byte every ``trickle_s``; ended (the connection
                closed) once trickling is switched off or the server stops."""
                with counting:
                    served.trickled += 1
                self.close_connection = True
                head = b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n" * 64
                for byte in head:  # bounded: the head's bytes
                    if not served.trickling or served._stopped.wait(trickle_s):
                        return
                    try:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                    except OSError:
                        return

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"

    def stop(self) -> None:
        self._stopped.set()
        self.server.shutdown()
        self.server.server_close()
