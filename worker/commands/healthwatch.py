"""``inference-worker healthwatch``: a supervisord event listener that restarts wedged workers.

On every TICK event it asks each RUNNING worker process of the group for ``/healthz``. A process
that answers 503 (stalled) or does not answer for ``failures`` ticks in a row, after its
start-up grace, is restarted over supervisor's XML-RPC interface: ``stopProcess`` (SIGTERM to
the group, SIGKILL after ``stopwaitsecs``) then ``startProcess``. The listener protocol uses
stdout, so everything else goes to stderr.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from config.derived import port_for
from worker.exits import CommandExit

RUNNING = 20  # supervisor's ProcessStates.RUNNING


@dataclass(frozen=True)
class Probe:
    healthy: bool
    reason: str


def probe(url: str, timeout_s: float) -> Probe:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return Probe(response.status == 200, f"HTTP {response.status}")
    except urllib.error.HTTPError as error:
        body = error.read(300).decode("utf-8", "replace").strip()
        return Probe(False, f"HTTP {error.code}: {body}")
    except (OSError, TimeoutError) as error:
        return Probe(False, f"no answer: {error}")


def process_port(name: str, port_base: int) -> int | None:
    """``inference-worker_03`` -> port_base + 3 (the program's process_name convention, and the
    worker's own rule, ``config.derived.port_for``)."""
    _, _, number = name.rpartition("_")
    return port_for(port_base, int(number)) if number.isdigit() else None


@dataclass
class HealthWatch:
    rpc: Any
    group: str
    port_base: int
    failures: int = 2
    startup_grace_s: float = 120.0
    timeout_s: float = 5.0
    probe: Callable[[str, float], Probe] = probe
    log: TextIO = sys.stderr
    strikes: dict[str, int] = field(default_factory=dict)

    def tick(self, now: float | None = None) -> list[str]:
        """Check every worker once; returns the names restarted."""
        now = time.time() if now is None else now
        restarted = []
        for info in self.rpc.supervisor.getAllProcessInfo():
            if info["group"] != self.group:
                continue
            name = info["name"]
            if info["state"] != RUNNING or now - info["start"] < self.startup_grace_s:
                self.strikes.pop(name, None)
                continue
            port = process_port(name, self.port_base)
            if port is None:
                continue
            result = self.probe(f"http://127.0.0.1:{port}/healthz", self.timeout_s)
            if result.healthy:
                self.strikes.pop(name, None)
                continue
            self.strikes[name] = self.strikes.get(name, 0) + 1
            self._say(
                f"{self.group}:{name} unhealthy ({self.strikes[name]}/{self.failures}): "
                f"{result.reason}"
            )
            if self.strikes[name] >= self.failures:
                self._restart(name, result.reason)
                self.strikes.pop(name, None)
                restarted.append(name)
        return restarted

    def _restart(self, name: str, reason: str) -> None:
        full = f"{self.group}:{name}"
        self._say(
            f"restarting {full} (pid stopped with TERM, then KILL after stopwaitsecs): {reason}"
        )
        try:
            self.rpc.supervisor.stopProcess(full, True)
        except Exception as error:  # noqa: BLE001 - it may have died on its own meanwhile
            self._say(f"stopProcess {full} failed: {error}")
        try:
            self.rpc.supervisor.startProcess(full, False)
        except Exception as error:  # noqa: BLE001
            self._say(f"startProcess {full} failed: {error}; autorestart will try")

    def _say(self, line: str) -> None:
        print(f"healthwatch: {line}", file=self.log, flush=True)


def serve(watch: HealthWatch, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> None:
    """supervisord's event-listener protocol: READY, header line, payload, RESULT."""
    while True:
        stdout.write("READY\n")
        stdout.flush()
        line = stdin.readline()
        if not line:
            return  # supervisord went away
        headers = dict(part.split(":", 1) for part in line.split())
        stdin.read(int(headers.get("len", "0")))
        if headers.get("eventname", "").startswith("TICK"):
            try:
                watch.tick()
            except Exception as error:  # noqa: BLE001 - never let one bad tick kill the listener
                watch._say(f"tick failed: {type(error).__name__}: {error}")
        stdout.write("RESULT 2\nOK")
        stdout.flush()


def main(
    group: str, port_base: int, failures: int, startup_grace_s: float, timeout_s: float
) -> int:
    from supervisor import childutils

    rpc = childutils.getRPCInterface(os.environ)
    watch = HealthWatch(rpc, group, port_base, failures, startup_grace_s, timeout_s)
    watch._say(f"watching group {group}, ports from {port_base}, {failures} strikes")
    serve(watch)
    return CommandExit.OK  # supervisord went away
