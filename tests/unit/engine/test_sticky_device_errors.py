"""A device that fails for good is told apart from one image's failure: the classifier
(``pipelines.device.is_sticky_device_error``) on the exception types torch really raises, and
the engine that raises ``DeviceFailed`` at once instead of failing each image of the batch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from config.errors import DeviceFailed, Failure, ModelLoadFailed
from datasets.images import Decoded
from datasets.loader import Loaded
from pipelines.device import STICKY_CUDA_ERRORS, is_out_of_memory, is_sticky_device_error
from tests.fakes import FakePredictor
from worker.core.outcome import Outcome
from worker.engine import Engine
from worker.engine.faults import DeviceFaultModels, sticky_cuda_error
from worker.engine.split import Split

# torch's own wording of a CUDA error (c10's C10_CUDA_CHECK): "CUDA error: <cudaGetErrorString>"
# and lines of advice after it.
ADVICE = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)


def accelerator_error(text: str, code: int | None) -> RuntimeError:
    """A ``torch.AcceleratorError`` as torch makes one (torch/csrc/Exceptions.cpp,
    ``_new_accelerator_error_object``): called with the message, then ``error_code`` set."""
    error = torch.AcceleratorError(f"CUDA error: {text}{ADVICE}")
    if code is not None:
        error.error_code = code  # type: ignore[attr-defined]
    return error


def test_torch_has_the_accelerator_error_the_classifier_reads_and_it_is_a_runtime_error():
    assert issubclass(torch.AcceleratorError, RuntimeError)
    assert not issubclass(torch.AcceleratorError, torch.OutOfMemoryError)


@pytest.mark.parametrize("code, text", sorted(STICKY_CUDA_ERRORS.items()))
def test_every_sticky_cuda_error_is_sticky_by_its_code_and_by_its_message(code, text):
    assert is_sticky_device_error(accelerator_error(text, code))
    assert is_sticky_device_error(accelerator_error(text, None)), "no code: by its message"
    assert is_sticky_device_error(RuntimeError(f"CUDA error: {text}{ADVICE}"))


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: an illegal memory access was encountered",
        "CUDA error: device-side assert triggered\nDevice-side assertions were explicitly omitted",
        "CUDA error: unspecified launch failure",
        "CUDA error: uncorrectable ECC error encountered",
        "CUDA driver error: an illegal memory access was encountered",
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, ...)`",
        "cuDNN error: CUDNN_STATUS_EXECUTION_FAILED",
    ],
)
def test_a_plain_runtime_error_naming_a_sticky_cuda_error_is_sticky(message):
    assert is_sticky_device_error(RuntimeError(message))


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: out of memory"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        accelerator_error("out of memory", 2),  # cudaErrorMemoryAllocation, raised by a check
    ],
)
def test_out_of_memory_is_never_sticky(error):
    assert is_out_of_memory(error) and not is_sticky_device_error(error)


@pytest.mark.parametrize(
    "error",
    [
        accelerator_error("invalid argument", 1),  # one input's bad shape or parameter
        accelerator_error("an illegal memory access was encountered", 1),  # the code decides
        RuntimeError("CUDA error: invalid argument"),
        RuntimeError("nvjpegDecode failed: 7"),  # nvJPEG refusing one image
        RuntimeError("Expected all tensors to be on the same device, but found cuda:0 and cpu"),
        RuntimeError("an illegal memory access was encountered"),  # names no CUDA error
        RuntimeError("CUDA error: an illegal memory access"),  # not CUDA's text: a model's own
        ValueError("CUDA error: an illegal memory access was encountered"),  # not torch's type
    ],
)
def test_a_cuda_error_of_one_input_or_an_error_that_names_no_cuda_error_is_not_sticky(error):
    assert not is_sticky_device_error(error)


@pytest.mark.parametrize("error_type", ["accelerator", "runtime"])
def test_the_fault_hooks_errors_are_torchs_real_types_and_sticky(error_type):
    error = sticky_cuda_error(error_type)
    wanted = torch.AcceleratorError if error_type == "accelerator" else RuntimeError
    assert type(error) is wanted
    assert str(error).startswith("CUDA error: an illegal memory access was encountered")
    assert getattr(error, "error_code", None) == (700 if error_type == "accelerator" else None)
    assert is_sticky_device_error(error)


# -- Split ------------------------------------------------------------------------------------


def a_split() -> tuple[Split, list[str]]:
    released: list[str] = []
    return Split(lambda: released.append("cache"), lambda: released.append("paused")), released


def passes_failing_with(error: BaseException, on_key: int | None = None) -> tuple[Any, list[Any]]:
    """A forward pass that raises ``error`` for any batch holding ``on_key`` (None: every
    batch), and the batches it was given."""
    calls: list[list[int]] = []

    def forward(keys):
        calls.append(list(keys))
        if on_key is None or on_key in keys:
            raise error
        return {key: Outcome(detections=[]) for key in keys}

    return forward, calls


@pytest.mark.parametrize("error_type", ["accelerator", "runtime"])
def test_a_sticky_error_raises_device_failed_at_once_without_trying_each_image(error_type):
    split, released = a_split()
    forward, calls = passes_failing_with(sticky_cuda_error(error_type))

    with pytest.raises(DeviceFailed) as raised:
        split.infer([1, 2, 3, 4], forward)

    assert calls == [[1, 2, 3, 4]], "no image is tried again on a failed device"
    assert released == [] and split.out_of_memory == 0
    wanted = "AcceleratorError" if error_type == "accelerator" else "RuntimeError"
    assert str(raised.value) == f"{wanted}: CUDA error: an illegal memory access was encountered"
    assert raised.value.error_code == (700 if error_type == "accelerator" else None)


def test_a_sticky_error_met_while_trying_each_image_still_ends_the_batch():
    """A batch fails for one image's reason, then the device fails under one of the images."""
    split, _ = a_split()
    calls: list[list[int]] = []

    def forward(keys):
        calls.append(list(keys))
        if len(keys) > 1:
            raise RuntimeError("shape mismatch in the head")
        if keys == [2]:
            raise sticky_cuda_error("runtime")
        return {key: Outcome(detections=[]) for key in keys}

    with pytest.raises(DeviceFailed):
        split.infer([1, 2, 3], forward)
    assert calls == [[1, 2, 3], [1], [2]], "nothing runs after the device failed"


def test_a_transient_cuda_error_on_one_image_stays_that_images_retryable_failure():
    split, _ = a_split()
    forward, calls = passes_failing_with(RuntimeError("CUDA error: invalid argument"), on_key=3)

    outcomes = split.infer([1, 2, 3, 4], forward)

    assert [key for key, outcome in outcomes.items() if outcome.ok] == [1, 2, 4]
    failure = outcomes[3].failure
    assert failure is not None and (failure.kind, failure.retryable) == ("inference_failed", True)
    assert "invalid argument" in failure.message
    assert calls[0] == [1, 2, 3, 4] and sorted(calls[1:]) == [[1], [2], [3], [4]]


def test_out_of_memory_as_an_accelerator_error_halves_the_batch_and_is_not_a_device_failure():
    split, released = a_split()
    forward, calls = passes_failing_with(accelerator_error("out of memory", 2), on_key=4)

    outcomes = split.infer([1, 2, 3, 4], forward)

    assert calls == [[1, 2, 3, 4], [1, 2], [3, 4], [3], [4]]
    failure = outcomes[4].failure
    assert failure is not None and failure.kind == "too_large_for_device"
    assert all(outcomes[key].ok for key in (1, 2, 3)) and "cache" in released


# -- the engine -------------------------------------------------------------------------------


class Loader:
    """Hands back every image submitted, at once (a CPU image whose pixels hold its key)."""

    def __init__(self) -> None:
        self.queue: list[Any] = []
        self.restarts = 0

    def submit(self, requests: list[Any]) -> None:
        self.queue.extend(requests)

    def next_loaded(self) -> Loaded:
        request = self.queue.pop(0)
        pixels = np.full((3, 8, 8), request.key, dtype=np.uint8)
        return Loaded(request.key, Decoded(pixels, 8, 8), None, 0.0, 1)

    def child_pids(self) -> list[int]:
        return [1]

    def unhealthy_children(self) -> list[str]:
        return []


class Echo(FakePredictor):
    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def run(self, images, while_running=None):
        self.batches.append([int(image.pixels[0, 0, 0]) for image in images])
        return [[{"bbox": None, "classifications": []}] for _ in images]


class Models:
    """One pipeline's model, for ``DeviceFaultModels`` to wrap as the wiring does."""

    def __init__(self, predictor: Any) -> None:
        self.predictor = predictor
        self.load_error: BaseException | None = None

    def acquire(self, name: str) -> Any:
        if self.load_error is not None:
            failure = Failure("model_load_failed", f"cannot load: {self.load_error}")
            raise ModelLoadFailed(failure, self.load_error)
        return self.predictor

    def release(self, name: str) -> None:
        pass

    def ready(self, name: str) -> bool:
        return self.load_error is None

    def load(self, name: str) -> None:
        self.acquire(name)


def an_engine(models: Any) -> Engine:
    return Engine(Loader(), models=models)  # type: ignore[arg-type]


def run(engine: Engine, keys: list[int]) -> dict[int, Outcome]:
    engine.submit([(key, f"file:///{key}.jpg") for key in keys])
    return engine.run_batch(keys).outcomes


@pytest.mark.parametrize("error_type", ["accelerator", "runtime"])
def test_the_device_fault_fails_the_chosen_batch_and_every_later_one_of_the_claiming_process(
    tmp_path, error_type
):
    echo = Echo()
    models = DeviceFaultModels(Models(echo), str(tmp_path / "fault"), 2, error_type)
    engine = an_engine(models)

    assert all(outcome.ok for outcome in run(engine, [1, 2]).values())
    with pytest.raises(DeviceFailed, match="an illegal memory access was encountered"):
        run(engine, [3, 4])
    with pytest.raises(DeviceFailed):  # the context stays poisoned
        run(engine, [5])
    assert echo.batches == [[1, 2]]
    assert (tmp_path / "fault").exists()


def test_the_device_fault_spares_every_process_but_the_first_to_claim_it(tmp_path):
    (tmp_path / "fault").touch()  # claimed by another process
    echo = Echo()
    engine = an_engine(DeviceFaultModels(Models(echo), str(tmp_path / "fault"), 1, "runtime"))

    assert all(outcome.ok for outcome in run(engine, [1, 2]).values())
    assert all(outcome.ok for outcome in run(engine, [3]).values())
    assert echo.batches == [[1, 2], [3]]


def test_a_model_load_that_a_failed_device_broke_raises_device_failed_not_a_load_failure():
    models = Models(Echo())
    engine = an_engine(models)
    models.load_error = sticky_cuda_error("accelerator")

    with pytest.raises(DeviceFailed):
        engine.load("p")
    with pytest.raises(DeviceFailed):
        run(engine, [1])

    models.load_error = FileNotFoundError("weights.pt")  # the pipeline's own fault, as before
    assert engine.load("p") is not None
    failure = run(engine, [2])[2].failure
    assert failure is not None and failure.kind == "model_load_failed"


def load_runner_failing_with(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> Exception:
    """What the real ``load_runner`` raises when the device fails under it: it wraps every
    error into a ConfigError ``from None`` (the original kept only as the context)."""
    import pipelines.models as models
    import pipelines.runner as runner
    from pipelines.declare import Classifier, Pipeline

    def broken(_device: Any) -> Any:
        raise error

    monkeypatch.setattr(models, "resolve_device", broken)  # load_runner imports it when run
    pipeline = Pipeline("p", classifier=Classifier("c", architecture="resnet18", weights="w.pt"))
    try:
        runner.load_runner(pipeline, None, "cuda")  # type: ignore[arg-type]
    except Exception as raised:  # noqa: BLE001 - the wrapper is what the test is about
        return raised
    raise AssertionError("load_runner did not fail")


def test_a_sticky_error_that_the_model_load_wrapped_still_raises_device_failed(monkeypatch):
    wrapped = load_runner_failing_with(monkeypatch, sticky_cuda_error("accelerator"))
    assert type(wrapped).__name__ == "ConfigError" and wrapped.__cause__ is None
    models = Models(Echo())
    engine = an_engine(models)
    models.load_error = wrapped  # as ModelCache passes it on: ModelLoadFailed(..., cause)

    with pytest.raises(DeviceFailed, match="an illegal memory access was encountered"):
        engine.load("p")
    with pytest.raises(DeviceFailed):
        run(engine, [1])


def test_a_load_that_fails_for_the_pipelines_own_reason_stays_a_load_failure(monkeypatch):
    models = Models(Echo())
    engine = an_engine(models)
    models.load_error = load_runner_failing_with(monkeypatch, FileNotFoundError("w.pt"))

    failure = engine.load("p")
    assert failure is not None and failure.kind == "model_load_failed"


def test_a_sticky_error_at_the_start_preload_is_the_devices_not_a_config_error(monkeypatch):
    from worker.engine.build import _preload

    wrapped = load_runner_failing_with(monkeypatch, sticky_cuda_error("runtime"))

    class Served:
        def load(self, name: str) -> None:
            raise ModelLoadFailed(Failure("model_load_failed", str(wrapped)), wrapped)

    with pytest.raises(DeviceFailed):
        _preload(Served(), ["p"])  # type: ignore[arg-type]


def test_a_device_failed_at_start_exits_7_with_one_device_failed_line():
    from structlog.testing import capture_logs

    from config.settings import load_settings
    from worker.process.serve import device_failed_at_start

    settings = load_settings(for_worker=False, model={"device": "cpu"})
    with capture_logs() as lines:
        exit = device_failed_at_start(settings, DeviceFailed("AcceleratorError: CUDA error: x"))

    assert exit.code == 7 and "AcceleratorError: CUDA error: x" in exit.detail
    assert [line["event"] for line in lines] == ["device_failed"]
    assert lines[0]["log_level"] == "error" and lines[0]["exit_code"] == 7
    assert lines[0]["device"] == "cpu" and lines[0]["held"] == 0


def test_a_sticky_error_outside_the_forward_pass_still_ends_the_batch_as_device_failed():
    class ReleaseFails(Models):
        def release(self, name: str) -> None:  # the model's release touches the device
            raise sticky_cuda_error("runtime")

    engine = an_engine(ReleaseFails(Echo()))
    with pytest.raises(DeviceFailed, match="an illegal memory access was encountered"):
        run(engine, [1, 2])


def test_any_other_error_of_a_batch_is_left_as_it_was():
    class ReleaseFails(Models):
        def release(self, name: str) -> None:
            raise KeyError("not held")

    engine = an_engine(ReleaseFails(Echo()))
    with pytest.raises(KeyError):
        run(engine, [1, 2])
