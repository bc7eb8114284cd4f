"""The device: which GPU a process sees, precision, out-of-memory, and copies that overlap
compute. Everything here is a no-op or a plain fallback on the CPU, so the same code runs in
tests without CUDA (docs/gpu.md)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from datasets.images import Decoded, DecodePlan, decode

Precision = Literal["float32", "bfloat16", "float16"]
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def visibility(entry: str) -> tuple[str | None, str]:
    """(CUDA_VISIBLE_DEVICES to set before CUDA starts, or None; the torch device to use) for
    one WORKER_MODEL__DEVICE entry: a GPU or MIG UUID, or ``cuda:N``, becomes the only device
    the process sees, used as ``cuda:0``; ``cuda``, ``auto`` and ``cpu`` stay as they are."""
    if entry.startswith(("MIG-", "GPU-")):
        return entry, "cuda:0"
    head, _, index = entry.partition(":")
    if head == "cuda" and index.isdigit():
        return index, "cuda:0"
    return None, entry


def autocast(device: torch.device, precision: str) -> AbstractContextManager[Any]:
    """The forward pass's precision: float32 as is, else autocast to bfloat16 or float16."""
    if precision == "float32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


_OOM_TEXT = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def is_out_of_memory(error: BaseException) -> bool:
    """torch's own out-of-memory error, or cuBLAS/cuDNN failing to allocate (plain
    RuntimeErrors that say so)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _OOM_TEXT)


def release_cached_memory() -> None:
    """After an out-of-memory error: give the caching allocator's free blocks back."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def default_budget_bytes(device: torch.device) -> int:
    """The models' memory budget when none is set: half the device's memory on CUDA (a MIG
    slice reports its own), the rest left to images and activations; a quarter of the host's
    memory on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory // 2)
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4)


def memory_bytes(device: torch.device) -> dict[str, float]:
    """Allocated, reserved and peak allocated bytes of ``device``; empty off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return {}
    return {
        "allocated": float(torch.cuda.memory_allocated(device)),
        "reserved": float(torch.cuda.memory_reserved(device)),
        "peak": float(torch.cuda.max_memory_allocated(device)),
    }


@dataclass
class CopyStats:
    """Seconds the compute stream waited for host-to-device copies (the copy overlap)."""

    waited_s: float = 0.0
    copies: int = 0


def to_device_overlapped(
    chunks: Iterable[Sequence[torch.Tensor]],
    device: torch.device,
    stats: CopyStats | None = None,
    copy_stream: Any = None,
) -> Iterator[list[torch.Tensor]]:
    """``chunks`` (lists of tensors) on ``device``. On CUDA, chunk k+1 is pinned and copied on
    a side stream while the caller computes on chunk k, and each chunk is handed over only once
    its copy is done (the compute stream waits on the copy, not the host); tensors already on
    the device are handed over as they are. Elsewhere, each chunk as it is."""
    if device.type != "cuda":
        for chunk in chunks:
            yield list(chunk)
        return
    copy_stream = copy_stream or torch.cuda.Stream(device)  # pass one: streams are pooled
    compute = torch.cuda.current_stream(device)

    def start(chunk: Sequence[torch.Tensor]) -> _Copy:
        if all(tensor.is_cuda for tensor in chunk):  # copied ahead, cut or decoded there already
            return _Copy(list(chunk), None)
        done = torch.cuda.Event()
        with torch.cuda.stream(copy_stream):
            moved = [
                tensor if tensor.is_cuda else tensor.pin_memory().to(device, non_blocking=True)
                for tensor in chunk
            ]
            done.record(copy_stream)
        return _Copy(moved, done)

    pending: _Copy | None = None
    for chunk in chunks:
        upcoming = start(chunk)
        if pending is not None:
            yield _handed_over(pending, compute, stats)
        pending = upcoming
    if pending is not None:
        yield _handed_over(pending, compute, stats)


def copy_ahead(
    tensors: Sequence[torch.Tensor], device: torch.device, copy_stream: Any
) -> list[torch.Tensor]:
    """``tensors`` copied to ``device`` now, pinned, on ``copy_stream``, without the host waiting:
    called while the device still runs the current batch, so the next batch's first images
    are there when it starts. Work the compute stream is given after this call waits for the
    copy; work given before it does not. Off CUDA, ``tensors`` as they are."""
    return next(to_device_overlapped([tensors], device, None, copy_stream))


class _Copy(NamedTuple):
    tensors: list[torch.Tensor]
    done: torch.cuda.Event | None  # None: nothing was copied (nothing to wait for)


def _handed_over(
    pending: _Copy, compute: torch.cuda.Stream, stats: CopyStats | None
) -> list[torch.Tensor]:
    moved, done = pending
    if done is None:
        return moved
    if stats is not None:
        started = time.perf_counter()
        if not done.query():  # the copy is still running: measure what waiting on it costs
            done.synchronize()
        stats.waited_s += time.perf_counter() - started
        stats.copies += 1
    compute.wait_event(done)
    for tensor in moved:
        tensor.record_stream(compute)
    return moved


def to_host(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Start bringing ``tensor`` back to the host; the call returned waits for it. On CUDA the
    copy is queued now, into pinned memory, so what the compute stream is given after this
    (the next batch's work) does not delay it."""
    if not tensor.is_cuda:
        return lambda: tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(tensor.device))

    def wait() -> torch.Tensor:
        done.synchronize()
        return host

    return wait


class InFlight:
    """At most ``depth`` chunks given to the device and not done: past that the host waits for
    the oldest, so a host running ahead of the GPU holds ``depth`` chunks' inputs there, not
    a whole batch's crops. Nothing to wait for off CUDA."""

    def __init__(self, device: torch.device, depth: int = 2) -> None:
        self._device = device
        self._depth = depth
        self._launched: deque[torch.cuda.Event] = deque()

    def launched(self) -> None:
        """A chunk's work was just given to the compute stream."""
        if self._device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        self._launched.append(event)
        while len(self._launched) > self._depth:
            self._launched.popleft().synchronize()


def decode_on_device(
    image: Decoded, device: torch.device, max_side: int, max_pixels: int = 0
) -> Decoded:
    """A JPEG the loader left encoded, decoded on the GPU (nvJPEG, torchvision's
    ``decode_jpeg``) and bounded by ``max_side`` there (kept whole when ``max_pixels``: a
    full-size plan, whose loader checked its pixels); on the CPU when there is no CUDA, or
    when the device cannot decode it (progressive or CMYK JPEGs, corrupt data), where a
    corrupt one becomes the usual ``corrupt_image`` error."""
    assert image.encoded is not None
    if device.type == "cuda":
        try:
            from torchvision.io import ImageReadMode, decode_jpeg
            from torchvision.transforms.v2 import functional as F

            data = torch.frombuffer(bytearray(image.encoded), dtype=torch.uint8)
            pixels = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
            _, height, width = pixels.shape
            if not max_pixels and max(height, width) > max_side:
                scale = max_side / max(height, width)
                size = [max(1, int(height * scale)), max(1, int(width * scale))]
                pixels = F.resize(pixels, size, antialias=True)
            return Decoded(pixels, image.source_width, image.source_height)
        except RuntimeError as error:
            if is_out_of_memory(error) or is_sticky_device_error(error):
                raise  # the engine splits the batch, or ends the process: not the CPU's to mend
            # Otherwise the device cannot decode this one: the CPU does, below.
    decoded = decode(image.encoded, DecodePlan(max_side=max_side, max_pixels=max_pixels))
    if device.type == "cuda":  # one place for a batch's pixels: crops are stacked together
        return decoded._replace(pixels=torch.from_numpy(decoded.pixels).to(device))
    return decoded


# CUDA's sticky errors, by code, with the text cudaGetErrorString gives each (what torch's
# "CUDA error: ..." messages carry). The header documents them (cudaError_t in CUDA 13's
# driver_types.h): "the process is in an inconsistent state and any further CUDA work will
# return the same error; to continue using CUDA, the process must be terminated and
# relaunched". Uncorrectable ECC and NVLink errors are hardware faults (Xid 48, 74) after which
# NVIDIA asks for the application to be restarted: sticky here too.
STICKY_CUDA_ERRORS: dict[int, str] = {
    214: "uncorrectable ECC error encountered",  # cudaErrorECCUncorrectable
    220: "uncorrectable NVLink error detected during the execution",  # NvlinkUncorrectable
    226: "Invalid access of peer GPU memory over nvlink or a hardware error",  # Contained
    700: "an illegal memory access was encountered",  # cudaErrorIllegalAddress
    702: "the launch timed out and was terminated",  # cudaErrorLaunchTimeout
    710: "device-side assert triggered",  # cudaErrorAssert
    714: "hardware stack error",  # cudaErrorHardwareStackError
    715: "an illegal instruction was encountered",  # cudaErrorIllegalInstruction
    716: "misaligned address",  # cudaErrorMisalignedAddress
    717: "operation not supported on global/shared address space",  # InvalidAddressSpace
    718: "invalid program counter",  # cudaErrorInvalidPc
    719: "unspecified launch failure",  # cudaErrorLaunchFailure
    721: "tensor memory not completely freed",  # cudaErrorTensorMemoryLeak
    810: "the MPS client has been terminated by the server",  # cudaErrorMpsClientTerminated
    911: "an async error has occured in external entity outside of CUDA",  # ExternalDevice
}
# How torch names a CUDA error in a plain RuntimeError (C10_CUDA_CHECK in older torch,
# extensions, the driver API); cuBLAS and cuDNN report a kernel that did not run with a status
# of their own, in practice the first sign of a context already poisoned.
_CUDA_PREFIXES = ("CUDA error", "CUDA driver error")
_STICKY_LIBRARY_STATUSES = ("CUBLAS_STATUS_EXECUTION_FAILED", "CUDNN_STATUS_EXECUTION_FAILED")


def is_sticky_device_error(error: BaseException) -> bool:
    """Whether ``error`` poisoned the device's context: every later CUDA call of this process
    fails the same way, and only a new process can use the device again. A
    ``torch.AcceleratorError`` (current torch) by the CUDA error code torch puts on it
    (``error_code``), else by its message; a plain RuntimeError by a message that names a CUDA
    error and one of ``STICKY_CUDA_ERRORS`` (or cuBLAS/cuDNN's execution failures). Out of
    memory never is; nor is a CUDA error that one input caused (an invalid argument, nvJPEG
    refusing an image): that image fails alone and the process goes on."""
    if not isinstance(error, RuntimeError) or is_out_of_memory(error):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    code = getattr(error, "error_code", None)
    by_code = accelerator_error is not None and isinstance(error, accelerator_error)
    if by_code and isinstance(code, int):
        return code in STICKY_CUDA_ERRORS
    text = str(error)
    if any(status in text for status in _STICKY_LIBRARY_STATUSES):
        return True
    return any(prefix in text for prefix in _CUDA_PREFIXES) and any(
        sticky in text for sticky in STICKY_CUDA_ERRORS.values()
    )


def sticky_cause(error: BaseException) -> BaseException | None:
    """The sticky device error in ``error``'s chain (its ``__cause__`` and ``__context__``, a
    few links deep), or None: a model load wraps what it met into a configuration error
    (``raise ... from None`` still keeps the original as the context), and a sticky error
    met under it is still the device's, not the pipeline's."""
    seen: set[int] = set()
    link: BaseException | None = error
    for _ in range(_CHAIN_LINKS):
        if link is None or id(link) in seen:
            return None
        if is_sticky_device_error(link):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


_CHAIN_LINKS = 8  # a load's wrappers are two or three deep
