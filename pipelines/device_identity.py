"""Which device this process runs on, named as NVIDIA's dcgm-exporter names it, so its series
(utilisation, memory, faults per GPU and per MIG instance) join ours: the GPU's UUID
(``GPU-...``; a MIG slice's parent GPU), the GPU instance id (dcgm's ``GPU_I_ID``), the MIG
slice's own UUID (``MIG-...``), the name, and the versions of torch, CUDA and the driver.

Read once at start, after the device is claimed; nothing here runs at import. No source is
required but torch: nvidia-ml-py (``import pynvml``), when installed, gives the driver and a
MIG slice's parent GPU and instance id; without it the driver comes from
``/proc/driver/nvidia/version`` and what no source tells stays empty. Knows nothing of
Prometheus: ``DeviceIdentity.labels`` is the metric's label set.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")


@dataclass(frozen=True)
class DeviceIdentity:
    device: str  # as the worker uses it: cuda:0, cpu
    uuid: str = ""  # GPU-...: the GPU's, a MIG slice's parent's (dcgm-exporter's UUID)
    gpu_instance_id: str = ""  # a MIG slice's GPU instance (dcgm-exporter's GPU_I_ID)
    mig_uuid: str = ""  # MIG-...: the slice this process was given
    name: str = ""
    torch_version: str = ""
    cuda_version: str = ""  # the CUDA torch was built with (torch.version.cuda)
    driver_version: str = ""

    def labels(self) -> dict[str, str]:
        """The metric's labels: the join keys spelt as dcgm-exporter spells them (``UUID``,
        ``GPU_I_ID``), so a PromQL ``on (UUID, GPU_I_ID)`` needs no ``label_replace``."""
        return {
            "device": self.device,
            "UUID": self.uuid,
            "GPU_I_ID": self.gpu_instance_id,
            "mig_uuid": self.mig_uuid,
            "name": self.name,
            "torch_version": self.torch_version,
            "cuda_version": self.cuda_version,
            "driver_version": self.driver_version,
        }


def optional_nvml() -> Any:
    """nvidia-ml-py's ``pynvml`` when it is installed, else None (it is optional)."""
    try:
        return importlib.import_module("pynvml")
    except Exception:  # noqa: BLE001 - not installed, or broken: the identity does without it
        return None


def read_identity(
    device: torch.device,
    *,
    visible: str | None,
    properties: Callable[[int], Any] = torch.cuda.get_device_properties,
    nvml: Callable[[], Any] = optional_nvml,
    driver_file: Path = DRIVER_VERSION_FILE,
) -> DeviceIdentity:
    """The identity of ``device`` (resolved: ``cuda:N`` or ``cpu``). ``visible``: the process's
    CUDA_VISIBLE_DEVICES, which names a MIG slice by its UUID; ``nvml``: gives the ``pynvml``
    module, or None (asked on CUDA only)."""
    versions = {"torch_version": str(torch.__version__), "cuda_version": torch.version.cuda or ""}
    if device.type != "cuda":
        return DeviceIdentity(device=str(device), name=device.type, **versions)
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = properties(index)
    torch_uuid = str(getattr(props, "uuid", ""))  # hex digits, no GPU-/MIG- (absent: old torch)
    found = _from_torch(_visible_entry(visible, index), torch_uuid)
    if (module := nvml()) is not None:
        found = _nvml_or_none(module, found, torch_uuid) or found
    driver = found.pop("driver_version", "") or _driver_from_file(driver_file)
    return DeviceIdentity(
        device=f"cuda:{index}", name=str(props.name), driver_version=driver, **found, **versions
    )


def _visible_entry(visible: str | None, index: int) -> str:
    entries = [entry.strip() for entry in (visible or "").split(",") if entry.strip()]
    return entries[index] if index < len(entries) else ""


_OLD_MIG = re.compile(r"MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/\d+")  # drivers before R470


def _from_torch(entry: str, torch_uuid: str) -> dict[str, str]:
    """What CUDA_VISIBLE_DEVICES and torch's UUID (its hex digits, no prefix) tell. On a MIG
    slice torch's UUID may be the slice's own (CUDA takes a UUID's first digits too): then
    the parent GPU is unknown without NVML."""
    if old := _OLD_MIG.fullmatch(entry):
        return {"uuid": old[1], "gpu_instance_id": old[2], "mig_uuid": entry}
    mig = entry if entry.startswith("MIG-") else ""
    if mig and torch_uuid.startswith(mig.removeprefix("MIG-")):
        return {"uuid": "", "gpu_instance_id": "", "mig_uuid": f"MIG-{torch_uuid}"}
    return {
        "uuid": f"GPU-{torch_uuid}" if torch_uuid else "",
        "gpu_instance_id": "",
        "mig_uuid": mig,
    }


def _nvml_or_none(nvml: Any, found: dict[str, str], torch_uuid: str) -> dict[str, str] | None:
    """``_from_nvml``, best effort: the identity is a label set, never a reason for a start to
    fail, and an old or odd pynvml raises more than NVMLError (a function it lacks, a str where
    it wants bytes): then what torch and /proc tell stands."""
    try:
        return _from_nvml(nvml, found, torch_uuid)
    except Exception as error:  # noqa: BLE001 - logged; the labels do without NVML
        log.warning("device_identity_nvml_failed", error=f"{type(error).__name__}: {error}")
        return None


def _from_nvml(nvml: Any, found: dict[str, str], torch_uuid: str) -> dict[str, str] | None:
    """What NVML adds: the driver, and for a MIG slice its parent GPU and GPU instance id
    (torch's UUID may be a slice's: NVML is asked for it as both). None when NVML cannot
    answer (no driver library, no permission)."""
    candidates = [found["mig_uuid"], found["uuid"], f"MIG-{torch_uuid}" if torch_uuid else ""]
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return None
    try:
        handle = _first_handle(nvml, [c for c in candidates if c])
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        if handle is None:
            return {**found, "driver_version": driver}
        if not nvml.nvmlDeviceIsMigDeviceHandle(handle):
            gpu = _text(nvml.nvmlDeviceGetUUID(handle))
            return {**found, "uuid": gpu, "driver_version": driver}
        parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
        return {
            "uuid": _text(nvml.nvmlDeviceGetUUID(parent)),
            "gpu_instance_id": str(nvml.nvmlDeviceGetGpuInstanceId(handle)),
            "mig_uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
            "driver_version": driver,
        }
    except nvml.NVMLError:
        return None
    finally:
        with contextlib.suppress(nvml.NVMLError):  # the answers above stand
            nvml.nvmlShutdown()


def _first_handle(nvml: Any, uuids: list[str]) -> Any:
    """The first of ``uuids`` NVML knows (it takes GPU- and MIG- UUIDs alike)."""
    for uuid in uuids:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(uuid)
        except nvml.NVMLError:
            continue
    return None


def _text(value: str | bytes) -> str:
    """pynvml's strings: bytes in its older releases."""
    return value.decode() if isinstance(value, bytes) else str(value)


_DRIVER = re.compile(r"NVRM version:.*?\s(\d+\.\d+(?:\.\d+)?)\s")


def _driver_from_file(path: Path) -> str:
    """The kernel module's version, as ``/proc/driver/nvidia/version`` states it; empty when
    the file is not there (no NVIDIA driver, or a container that does not show it)."""
    try:
        found = _DRIVER.search(path.read_text())
    except OSError:
        return ""
    return found[1] if found else ""
