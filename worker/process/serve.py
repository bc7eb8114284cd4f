"""A worker process's life, in one place: startup, main loop, shutdown (uvicorn's
``Server.serve`` is the model).

- Signals: SIGTERM and SIGINT only record that the process should stop; the main loop drains.
  A second one while stopping means "now": the process's children (fork server, loader
  children) are SIGKILLed and reaped, bounded, then out at once with 128 + the signal's number.
- Startup: the run directory's slot is claimed (``datasets.rundir``: this process's
  temporary files), then the parts start (``Assembly.start``). Only once the start's checks
  have passed, before its first child process, is the slot emptied of a dead predecessor's
  leftovers and made the temporary directory: a refused start (exit 2) removes nothing. A
  start waits on an unreachable NATS server or a slow model for as long as it takes, so a
  signal gives it up: nothing is held yet, exit 0.
- Main loop: the orchestrator, until a signal, a failure, a crossed limit or burst mode's end;
  it says how the process ends (``exits.Exit``).
- Shutdown: every part closed in order (loader children and the fork server reaped), each
  step bounded; then the run directory is let go.

The command line only parses and calls ``serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable

import psutil
import structlog

from config.derived import chosen_device, run_dir_base, run_dir_setting
from config.errors import DeviceFailed
from config.faults import FaultSettings
from config.settings import Settings
from datasets import rundir
from worker.core.exits import FORCED_BY, STOPPED, Exit, ExitReason, forced_exit_code
from worker.process.app import Assembly

log = structlog.get_logger(__name__)


class Lifetime:
    def __init__(
        self, settings: Settings, *, until_idle: bool = False, faults: FaultSettings | None = None
    ) -> None:
        self.settings = settings
        self.until_idle = until_idle
        self.faults = faults
        self.should_exit = asyncio.Event()
        self.exit_now: Callable[[int], None] = exit_at_once

    async def serve(self) -> int:
        self.install_signal_handlers()
        s = self.settings
        run = rundir.claim(run_dir_base(s), s.process_index, run_dir_setting(s))  # locked only
        app = Assembly(self.settings, until_idle=self.until_idle, faults=self.faults)
        try:
            try:
                started = await self.startup(app, checked=lambda: take_over(run))
            except DeviceFailed as failed:  # a model load met it: nothing is held yet
                return device_failed_at_start(s, failed).code
            exit = await self.main_loop(app) if started else STOPPED
        finally:
            await self.shutdown(app)
            run.release()
        return exit.code

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in FORCED_BY:
            loop.add_signal_handler(signum, self.handle_exit, signum)

    def handle_exit(self, signum: int) -> None:
        """Record the signal; the main loop drains. A second one means "now"."""
        if self.should_exit.is_set():
            name = signal.Signals(signum).name
            print(f"second signal {name}: exiting now", file=sys.stderr, flush=True)
            self.exit_now(forced_exit_code(signum))
            return
        self.should_exit.set()

    async def startup(self, app: Assembly, checked: Callable[[], None] = lambda: None) -> bool:
        """``app.start(checked)``, given up when a signal comes first; False then."""
        starting = asyncio.ensure_future(app.start(checked))
        stopping = asyncio.ensure_future(self.should_exit.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if starting.done():
            starting.result()  # its failure, if it failed
            return True
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        # No task is held yet; shutdown() ends what the start had begun (loader children too).
        print("stopped while starting: exiting 0", file=sys.stderr, flush=True)
        return False

    async def main_loop(self, app: Assembly) -> Exit:
        return await app.run(self.should_exit)

    async def shutdown(self, app: Assembly) -> None:
        await app.close()


def device_failed_at_start(s: Settings, failed: DeviceFailed) -> Exit:
    """A sticky device error while the models loaded at start: the same line and exit code
    (7) as one met later, so supervisord and the alerts see a broken device, not a
    configuration error."""
    device = chosen_device(s)
    log.error(
        "device_failed",
        error=str(failed),
        device=device,
        held=0,
        exit_code=ExitReason.DEVICE_FAILED.code,
        action="exiting for a new process before taking any task",
    )
    return Exit(ExitReason.DEVICE_FAILED, f"device {device} failed: {failed}")


def take_over(run: rundir.RunDir) -> None:
    """The start's checks have passed and no child process has started: empty what dead
    processes left (a refused start has removed nothing), then make the run directory this
    process's temporary directory, before anything of multiprocessing starts."""
    rundir.clear_leftovers(run)
    rundir.use(run)


REAP_TIMEOUT_S = 3.0


def kill_descendants(pid: int, timeout_s: float = REAP_TIMEOUT_S) -> list[int]:
    """SIGKILL every descendant of ``pid`` and wait (at most ``timeout_s``) for them to go;
    best effort: one already gone is skipped. Returns the pids that were still there."""
    try:
        tree = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    for child in tree:
        with contextlib.suppress(psutil.Error):
            child.kill()
    deadline = time.monotonic() + timeout_s
    alive = tree
    while alive and time.monotonic() < deadline:
        # Reaps our own children; a grandchild is gone once a zombie (its parent's to reap).
        _, alive = psutil.wait_procs(alive, timeout=0.05)
        alive = [child for child in alive if not _zombie(child)]
    return [child.pid for child in alive]


def _zombie(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def exit_at_once(code: int) -> None:
    """The second signal's way out: no finaliser runs, so the children are killed first
    (docs/operating.md: whatever the code, loader children and the fork server are killed and
    reaped)."""
    kill_descendants(os.getpid())
    os._exit(code)


async def serve(
    settings: Settings, *, until_idle: bool = False, faults: FaultSettings | None = None
) -> int:
    """Run one worker process from start to exit; returns its exit code. ``faults``: the
    test hooks a test set (``config/faults.py``); None: off."""
    return await Lifetime(settings, until_idle=until_idle, faults=faults).serve()
