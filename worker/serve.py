"""A worker process's life, in one place: startup, main loop, shutdown (uvicorn's
``Server.serve`` is the model).

- Signals: SIGTERM and SIGINT only record that the process should stop; the main loop drains.
  A second one while stopping means "now": out at once with 128 + the signal's number.
- Startup: the run directory (``datasets.rundir``: this process's temporary files, emptied
  of a dead predecessor's leftovers), then the parts (``WorkerApp.start``). A start waits on
  an unreachable NATS server or a slow model for as long as it takes, so a signal gives it
  up: nothing is held yet, exit 0.
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
from collections.abc import Callable

from config.derived import run_dir_base
from config.settings import Settings
from datasets import rundir
from worker.app import WorkerApp
from worker.exits import FORCED_BY, STOPPED, Exit, forced_exit_code


class Server:
    def __init__(self, settings: Settings, *, until_idle: bool = False) -> None:
        self.settings = settings
        self.until_idle = until_idle
        self.should_exit = asyncio.Event()
        self.exit_now: Callable[[int], None] = os._exit

    async def serve(self) -> int:
        self.install_signal_handlers()
        run = rundir.claim(run_dir_base(self.settings), self.settings.process_index)
        rundir.use(run)  # before anything of multiprocessing starts
        app = WorkerApp(self.settings, until_idle=self.until_idle)
        try:
            exit = await self.main_loop(app) if await self.startup(app) else STOPPED
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

    async def startup(self, app: WorkerApp) -> bool:
        """``app.start()``, given up when a signal comes first; False then."""
        starting = asyncio.ensure_future(app.start())
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

    async def main_loop(self, app: WorkerApp) -> Exit:
        return await app.run(self.should_exit)

    async def shutdown(self, app: WorkerApp) -> None:
        await app.close()


async def serve(settings: Settings, *, until_idle: bool = False) -> int:
    """Run one worker process from start to exit; returns its exit code."""
    return await Server(settings, until_idle=until_idle).serve()
