"""A batch's forward pass when it fails: each image alone, so one image that breaks the model
(or its output) fails alone and its batch-mates keep their deliveries; out of device memory,
the batch halved instead, down to one image (``too_large_for_device``); a device that failed
for good (a sticky CUDA error), no image at all: ``DeviceFailed`` ends the process."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from config.errors import DeviceFailed, Failure, PermanentError
from pipelines.device import is_out_of_memory, is_sticky_device_error
from worker.core.outcome import Outcome

log = structlog.get_logger(__name__)

Pass = Callable[[Sequence[int]], dict[int, Outcome]]  # one forward pass of these keys


class Split:
    """``out_of_memory`` counts the batches split for lack of device memory (a metric)."""

    def __init__(
        self, release_memory: Callable[[], None], on_out_of_memory: Callable[[], None]
    ) -> None:
        self._release_memory = release_memory
        self._on_out_of_memory = on_out_of_memory  # before the halves run
        self.out_of_memory = 0

    def infer(self, keys: list[int], forward: Pass) -> dict[int, Outcome]:
        """``forward`` of ``keys``; if it fails, of fewer of them at a time. DeviceFailed at
        once when the device failed for good: no pass can run on it again, so none is tried."""
        if not keys:
            return {}
        out_of_memory = False
        try:
            return forward(keys)
        except Exception as error:  # the model is the user's code: a result each
            if is_out_of_memory(error):
                out_of_memory = True  # split outside this block: its traceback holds memory
            elif is_sticky_device_error(error):
                raise device_failed(error) from error
            elif len(keys) == 1:
                return {keys[0]: _failed(error)}
            else:
                log.warning("batch_failed_trying_each_image", batch=len(keys), error=repr(error))
        if out_of_memory:
            return self._halve(keys, forward)
        outcomes: dict[int, Outcome] = {}
        for key in keys:
            outcomes.update(self.infer([key], forward))
        return outcomes

    def _halve(self, keys: list[int], forward: Pass) -> dict[int, Outcome]:
        """Out of device memory: trim the allocator's cache, then run each half on its own; an
        image that does not fit alone gets ``too_large_for_device``. The process keeps going."""
        self.out_of_memory += 1
        self._on_out_of_memory()
        self._release_memory()
        if len(keys) == 1:
            log.warning("image_too_large_for_device", key=keys[0])
            message = "out of device memory with this image alone (try a smaller MAX_SIDE)"
            # Retried on later deliveries (another process on the GPU may have held the
            # memory); the last one stores this error.
            failure = Failure("too_large_for_device", message, retryable=True)
            return {keys[0]: Outcome(failure=failure)}
        half = len(keys) // 2
        log.warning("out_of_device_memory_splitting_batch", batch=len(keys), into=half)
        return {**self.infer(keys[:half], forward), **self.infer(keys[half:], forward)}


def device_failed(error: BaseException) -> DeviceFailed:
    """The process-ending error for a sticky one: its type and first line (torch adds lines
    of debugging advice), and CUDA's code when torch gave one."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    code = getattr(error, "error_code", None)
    return DeviceFailed(
        f"{type(error).__name__}: {first_line}",
        error_code=code if isinstance(code, int) else None,
    )


def _failed(error: Exception) -> Outcome:
    """A forward pass that raised: permanent when the pipeline says so (an output it cannot
    use for this image), else worth another delivery."""
    if isinstance(error, PermanentError):
        log.warning("inference_refused_image", error=str(error))
        return Outcome(failure=error.failure())
    log.error("inference_failed", error=repr(error), exc_info=error)
    message = f"inference failed: {type(error).__name__}: {error}"
    return Outcome(failure=Failure("inference_failed", message, retryable=True))
