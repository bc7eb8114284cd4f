"""A directory served over HTTP on 127.0.0.1 by a real server, its GETs counted (model-file
tests: pipelines/files, ``models fetch``); it answers 403 to every GET while ``refusing`` (a
file host refusing a new host for a while)."""

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
    each while ``refusing`` (settable while it runs), those counted in ``refused``."""

    def __init__(
        self, root: Path, delay_s: float = 0.0, refuse: int = 0, refusing: bool = False
    ) -> None:
        self.root = root
        self.gets = 0
        self.refusing = refusing
        self.refused = 0
        counting = threading.Lock()
        served = self

        class Handler(SimpleHTTPRequestHandler):
            def do_GET(self) -> None:
                with counting:
                    served.gets += 1
                    status = refuse or (403 if served.refusing else 0)
                    served.refused += bool(status)
                time.sleep(delay_s)
                if status:
                    self.send_error(status)
                    return
                super().do_GET()

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
