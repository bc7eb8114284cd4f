"""Faults for chaos tests on the engine, installed by the wiring when a setting asks."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import structlog

from datasets.faults import claim_once
from worker.engine import Engine
from worker.ports import BatchReport

log = structlog.get_logger(__name__)
T = TypeVar("T")
A = TypeVar("A")


def slow_loading(load: Callable[[A], T], seconds: float) -> Callable[[A], T]:
    """``load``, each call ``seconds`` longer first (on the loading thread, as a slow build)."""

    def slowly(chosen: A) -> T:
        log.warning("fault_hook_slow_model_load", seconds=seconds)
        time.sleep(seconds)
        return load(chosen)

    return slowly


class WedgingEngine:
    """The engine, except that the first process to claim ``path`` wedges its engine thread
    at its next batch: ``gil`` spins holding the GIL (only the watchdog can act), ``sleep``
    blocks without it (/healthz reports the stall), ``raise`` fails it with an error nothing
    expects (a part of the worker failed)."""

    def __init__(self, engine: Engine, path: str, mode: str) -> None:
        self._engine = engine
        self._path = path
        self._mode = mode

    def run_batch(self, keys: Sequence[int], pipeline: str = "") -> BatchReport:
        if claim_once(self._path):
            log.error("fault_hook_wedging_engine_thread", path=self._path, mode=self._mode)
            if self._mode == "raise":
                raise RuntimeError(f"fault hook {self._path}: the engine failed")
            if self._mode == "sleep":
                while True:
                    time.sleep(3600)
            sys.setswitchinterval(1e6)  # no other Python thread gets the GIL back
            while True:
                pass
        return self._engine.run_batch(keys, pipeline)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
