"""``inference-worker healthwatch``: a supervisord event listener that restarts wedged workers.

It acts on liveness alone: ``/livez``, which answers 503 only for what a restart mends (a
stall, a failed device, a start not finished). A task source that is down, or its server
refusing a consumer, makes ``/readyz`` (and ``/healthz``) 503, never ``/livez``: a restart
mends neither, and each costs a drain, a model load and the batches in hand. A worker of a
release before ``/livez`` (it answers 404 there) is asked ``/healthz`` instead.

On every TICK event it asks each RUNNING worker process of the group for ``/livez`` on the
worker's loopback health listener (``127.0.0.1``, the metrics port + 1000 + N: never the
/metrics listener, which any number of idle connections may fill; never through a proxy), all
processes at once, each within ``timeout_s``. A process that answers 503 (stalled) or does not
answer for ``failures`` ticks in a row, after its start-up grace, is restarted over
supervisor's XML-RPC interface without waiting. A process that answers ``503 starting`` (its
models still loading, NATS not reached yet) is given the time it needs, up to
``max_start_s`` since it was started: a slow start is no strike, however much slower than the
grace it is; past ``max_start_s`` each ``starting`` answer is one. Once a process has answered
anything but ``starting`` (it started), a ``starting`` answer is a strike like any 503. The
restart: ``stopProcess`` (SIGTERM to the group, SIGKILL
after ``stopwaitsecs``) is asked at once for every such process, and ``startProcess`` at the
first tick that finds it stopped. So one tick takes at most ``timeout_s`` and a few calls,
whatever the number of processes, and frozen processes are restarted together: the last of
16 as soon as the first. The listener protocol uses stdout, so everything else goes to stderr.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TextIO

from config.derived import healthz_base, port_for
from worker.core.exits import CommandExit

RUNNING = 20  # supervisor's ProcessStates.RUNNING
STOPPED_STATES = frozenset({0, 100, 200})  # STOPPED, EXITED, FATAL: startProcess may start it
_MAX_PROBES_AT_ONCE = 64
# No proxy, whatever http_proxy / no_proxy say: a proxy would answer for the worker.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Probe:
    healthy: bool
    reason: str
    starting: bool = False  # 503 ``starting: ...``: the process has not finished its start


_STARTING = "starting"  # the body of the worker's 503 until it serves (worker.process.app)


LIVEZ, HEALTHZ = "/livez", "/healthz"


def probe(url: str, timeout_s: float) -> Probe:
    """GET ``url``; a ``/livez`` that is not found (a worker older than it) is asked again
    at ``/healthz``, as healthwatch asked before."""
    try:
        with _DIRECT.open(url, timeout=timeout_s) as response:
            return Probe(response.status == 200, f"HTTP {response.status}")
    except urllib.error.HTTPError as error:
        if error.code == 404 and url.endswith(LIVEZ):
            return probe(url.removesuffix(LIVEZ) + HEALTHZ, timeout_s)
        body = error.read(300).decode("utf-8", "replace").strip()
        starting = error.code == 503 and body.startswith(_STARTING)
        return Probe(False, f"HTTP {error.code}: {body}", starting)
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
    port_base: int  # the metrics port of process 0 (IW_METRICS_PORT_BASE)
    failures: int = 2
    startup_grace_s: float = 120.0
    timeout_s: float = 3.0
    probe: Callable[[str, float], Probe] = probe
    log: TextIO = sys.stderr
    healthz_port_base: int = 0  # WORKER_METRICS__HEALTHZ_PORT when the workers set it
    max_start_s: float = 1800.0  # a process may say `starting` this long after it was started
    strikes: dict[str, int] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)  # name -> start of the run that
    # answered something other than `starting` (so its `starting` now is a strike)
    stopping: dict[str, str] = field(default_factory=dict)  # name -> why it is being restarted
    answered: dict[str, float] = field(default_factory=dict)  # name -> start it answered since

    def tick(self, now: float | None = None) -> list[str]:
        """Check every worker once; returns the names whose restart began. Restarts asked at
        an earlier tick are started once supervisord has stopped them."""
        now = time.time() if now is None else now
        infos = [i for i in self.rpc.supervisor.getAllProcessInfo() if i["group"] == self.group]
        self._start_stopped(infos)
        due, in_grace = self._due(infos, now)
        starts = {info["name"]: float(info["start"]) for info in infos}
        restarting = []
        for name, result in self._probe_all(due).items():
            if self._still_starting(name, result, starts[name], now):
                self.strikes.pop(name, None)
                continue
            if result.healthy:
                self.strikes.pop(name, None)
                self.answered[name] = starts[name]  # its grace is over
                continue
            if name in in_grace:
                continue
            self.strikes[name] = self.strikes.get(name, 0) + 1
            self._say(
                f"{self.group}:{name} unhealthy ({self.strikes[name]}/{self.failures}): "
                f"{result.reason}"
            )
            if self.strikes[name] >= self.failures:
                self.strikes.pop(name, None)
                self._stop(name, result.reason)
                restarting.append(name)
        return restarting

    def _due(self, infos: list[dict[str, Any]], now: float) -> tuple[dict[str, str], set[str]]:
        """The running processes to probe (name -> URL), and those still in their start-up
        grace: ``startup_grace_s`` from their start, or until their first healthy answer."""
        due: dict[str, str] = {}
        in_grace: set[str] = set()
        for info in infos:
            name = info["name"]
            if name in self.stopping:
                continue
            if info["state"] != RUNNING:
                self.strikes.pop(name, None)
                continue
            if (
                now - info["start"] < self.startup_grace_s
                and self.answered.get(name) != info["start"]
            ):
                in_grace.add(name)  # probed, but no strike until it answers healthy once
                self.strikes.pop(name, None)
            port = process_port(name, healthz_base(self.port_base, self.healthz_port_base))
            if port is not None:
                due[name] = f"http://127.0.0.1:{port}{LIVEZ}"
        return due, in_grace

    def _still_starting(self, name: str, result: Probe, start: float, now: float) -> bool:
        """True for a ``starting`` answer of a run that has not answered otherwise and has
        not run past ``max_start_s``: no strike. Remembers the runs that have started."""
        if self.started.get(name) == start:
            return False
        if not result.starting:
            if result.reason.startswith("HTTP"):  # it answered: this run has started
                self.started[name] = start
            return False
        if now - start <= self.max_start_s:
            return True
        self._say(
            f"{self.group}:{name} still starting {now - start:.0f}s after it was started "
            f"(--max-start-s {self.max_start_s:g})"
        )
        return False

    def _probe_all(self, urls: dict[str, str]) -> dict[str, Probe]:
        """Every process probed at once: a tick takes one timeout, not one per process."""
        if not urls:
            return {}
        workers = min(len(urls), _MAX_PROBES_AT_ONCE)
        with ThreadPoolExecutor(workers, thread_name_prefix="probe") as pool:
            answers = pool.map(lambda url: self.probe(url, self.timeout_s), urls.values())
            return dict(zip(urls, answers, strict=True))

    def _stop(self, name: str, reason: str) -> None:
        full = f"{self.group}:{name}"
        self._say(
            f"restarting {full} (pid stopped with TERM, then KILL after stopwaitsecs): {reason}"
        )
        try:
            self.rpc.supervisor.stopProcess(full, False)  # asked, not waited for
        except Exception as error:  # noqa: BLE001 - it may have died on its own meanwhile
            self._say(f"stopProcess {full} failed: {error}; autorestart will try")
            return
        self.stopping[name] = reason

    def _start_stopped(self, infos: list[dict[str, Any]]) -> None:
        """Start each process this listener stopped, once supervisord reports it stopped."""
        states = {info["name"]: info["state"] for info in infos}
        for name in list(self.stopping):
            state = states.get(name)
            if state is None or state == RUNNING:  # gone from the config, or started by another
                self.stopping.pop(name)
                continue
            if state not in STOPPED_STATES:
                continue  # still stopping: SIGKILL comes after stopwaitsecs
            self.stopping.pop(name)
            full = f"{self.group}:{name}"
            try:
                self.rpc.supervisor.startProcess(full, False)
                self._say(f"started {full} again")
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
    group: str,
    port_base: int,
    failures: int,
    startup_grace_s: float,
    timeout_s: float,
    healthz_port_base: int = 0,
    max_start_s: float = 1800.0,
) -> int:
    from supervisor import childutils

    rpc = childutils.getRPCInterface(os.environ)
    watch = HealthWatch(
        rpc,
        group,
        port_base,
        failures,
        startup_grace_s,
        timeout_s,
        healthz_port_base=healthz_port_base,
        max_start_s=max_start_s,
    )
    first = healthz_base(port_base, healthz_port_base)
    watch._say(
        f"watching group {group}, {LIVEZ} on 127.0.0.1 from {first}, {failures} strikes, "
        f"starts of up to {max_start_s:g}s"
    )
    serve(watch)
    return CommandExit.OK  # supervisord went away
