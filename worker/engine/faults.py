"""Faults for chaos tests on the engine, installed by the wiring when a setting asks: a model
load made slower, an engine thread wedged, forward passes made slow or frozen, a device that
fails for good."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import structlog

from datasets.faults import claim_once
from datasets.images import Decoded
from pipelines.found import Detection
from worker.core.ports import BatchReport
from worker.engine import Engine
from worker.engine.predictors import Models, Predictor

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


class _ModelsWrapper:
    """The engine's models, passed through but for what a fault changes in ``acquire``."""

    def __init__(self, models: Models) -> None:
        self._models = models

    def release(self, name: str) -> None:
        self._models.release(name)

    def ready(self, name: str) -> bool:
        return self._models.ready(name)

    def load(self, name: str) -> None:
        self._models.load(name)


class SlowForwardModels(_ModelsWrapper):
    """The engine's models, except that each stage's forward pass sleeps ``seconds`` per input
    (image or crop) before it runs, without the GIL (a slow host: the pass advances chunk by
    chunk); the pass given the ``freeze_at``-th input of the process's batches (0: none)
    never returns (a wedged device)."""

    def __init__(self, models: Models, seconds: float, freeze_at: int) -> None:
        super().__init__(models)
        self._seconds = seconds
        self._freeze_at = freeze_at
        self._inputs = 0  # of every batch's forward passes so far
        self._slowed: set[int] = set()  # ids of the stage models already slowed

    def acquire(self, name: str) -> Predictor:
        predictor = self._models.acquire(name)
        for stage in ("detector", "filter", "classifier"):
            model = getattr(predictor, stage, None)
            if model is not None and id(model) not in self._slowed:
                self._slowed.add(id(model))
                model.forward = self._slow(model.forward)
        return predictor

    def _slow(self, forward: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def slowly(inputs: Any) -> Any:
            for _ in range(len(inputs)):
                self._inputs += 1
                if self._inputs == self._freeze_at:
                    log.error("fault_hook_frozen_forward_pass", input=self._inputs)
                    while True:
                        time.sleep(3600)
                time.sleep(self._seconds)
            return forward(inputs)

        return slowly


# What torch says of an illegal memory access, as C10_CUDA_CHECK words it (with its advice).
_ILLEGAL_ACCESS = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)
_ILLEGAL_ADDRESS = 700  # cudaErrorIllegalAddress


def sticky_cuda_error(error_type: str) -> RuntimeError:
    """The error a poisoned CUDA context raises, of the real type: ``accelerator``, a
    ``torch.AcceleratorError`` made as torch makes it (the message, then ``error_code`` set on
    it); ``runtime``, the plain RuntimeError of older torch and of extensions (and of any
    torch without AcceleratorError)."""
    import torch

    accelerator_error = getattr(torch, "AcceleratorError", None)
    if error_type != "accelerator" or accelerator_error is None:
        return RuntimeError(_ILLEGAL_ACCESS)
    error: RuntimeError = accelerator_error(_ILLEGAL_ACCESS)
    setattr(error, "error_code", _ILLEGAL_ADDRESS)  # noqa: B010 - as torch sets it, not typed
    return error


class DeviceFaultModels(_ModelsWrapper):
    """The engine's models, except that the first process to claim ``path`` at its
    ``at_batch``-th batch has its device fail for good there: that batch's forward passes, and
    every later one, raise ``sticky_cuda_error(error_type)``, as a poisoned context does."""

    def __init__(self, models: Models, path: str, at_batch: int, error_type: str) -> None:
        super().__init__(models)
        self._path = path
        self._at_batch = at_batch
        self._error_type = error_type
        self._batches = 0  # acquired once per batch
        self._failed = False

    def acquire(self, name: str) -> Predictor:
        predictor = self._models.acquire(name)
        self._batches += 1
        if not self._failed and self._batches == self._at_batch:
            self._failed = claim_once(self._path)
            if self._failed:
                log.error("fault_hook_device_error", path=self._path, batch=self._batches)
        if self._failed:
            return _FailingPredictor(predictor, self._error_type)
        return predictor


class _FailingPredictor:
    """A pipeline on a device that failed: nothing runs, nothing is copied."""

    def __init__(self, predictor: Predictor, error_type: str) -> None:
        self._predictor = predictor
        self._error_type = error_type

    @property
    def copy_ahead_images(self) -> int:
        return self._predictor.copy_ahead_images

    def copy_ahead(self, images: Sequence[Decoded]) -> list[Decoded]:
        raise sticky_cuda_error(self._error_type)

    def run(
        self, images: Sequence[Decoded], while_running: Callable[[], None]
    ) -> list[list[Detection]]:
        raise sticky_cuda_error(self._error_type)
