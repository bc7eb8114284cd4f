"""The device's identity as dcgm-exporter names it, read from torch's device properties,
CUDA_VISIBLE_DEVICES, nvidia-ml-py when there is one, and the driver's /proc file: on the CPU,
on a whole GPU and on a MIG slice, with NVML and without."""

from __future__ import annotations

from ctypes import c_uint
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipelines.device_identity import read_identity

GPU_HEX = "8e2b7d4c-1a2b-4c3d-9e8f-0a1b2c3d4e5f"
MIG_HEX = "5c7d2f10-3b4a-5e6f-8a9b-c0d1e2f30415"
GPU = f"GPU-{GPU_HEX}"
MIG = f"MIG-{MIG_HEX}"
# As the open kernel module writes it (the proprietary one says "Kernel Module  550.54.15").
PROC_VERSION = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Thu Jan 23 21:38:30 UTC 2025\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
)


class _CUuuid:
    """torch's ``_CUuuid``: its str() is the UUID's hex digits, without a prefix."""

    def __init__(self, text: str) -> None:
        self._text = text

    def __str__(self) -> str:
        return self._text


def properties(uuid_hex: str, name: str = "NVIDIA A100-SXM4-40GB"):
    def get(index: int) -> SimpleNamespace:
        return SimpleNamespace(uuid=_CUuuid(uuid_hex), name=name, index=index)

    return get


class FakeNvml:
    """The parts of nvidia-ml-py's ``pynvml`` the reader calls, answering as it does: handles
    by UUID (GPU- and MIG- alike), ``c_uint`` for "is MIG", bytes or str for strings."""

    class NVMLError(Exception):
        pass

    def __init__(self, migs: dict[str, tuple[str, int]], gpus: set[str], init_fails=False):
        self.migs = migs  # MIG UUID -> (parent GPU UUID, GPU instance id)
        self.gpus = gpus
        self.init_fails = init_fails
        self.open = 0

    def nvmlInit(self) -> None:
        if self.init_fails:
            raise self.NVMLError("NVML Shared Library Not Found")
        self.open += 1

    def nvmlShutdown(self) -> None:
        self.open -= 1

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"550.54.15"  # bytes, as releases before 11.515 return

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid not in self.migs and uuid not in self.gpus:
            raise self.NVMLError("Not Found")
        return uuid

    def nvmlDeviceIsMigDeviceHandle(self, handle: str) -> c_uint:
        return c_uint(handle in self.migs)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: str) -> str:
        return self.migs[handle][0]

    def nvmlDeviceGetGpuInstanceId(self, handle: str) -> int:
        return self.migs[handle][1]

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return handle


def no_nvml():
    return None


@pytest.fixture
def driver_file(tmp_path: Path) -> Path:
    path = tmp_path / "version"
    path.write_text(PROC_VERSION)
    return path


def test_on_the_cpu_it_says_cpu_and_asks_no_gpu_source():
    def untouched(*_):
        raise AssertionError("no GPU source is read on the CPU")

    identity = read_identity(
        torch.device("cpu"), visible="GPU-x", properties=untouched, nvml=untouched
    )

    assert identity.labels() == {
        "device": "cpu",
        "UUID": "",
        "GPU_I_ID": "",
        "mig_uuid": "",
        "name": "cpu",
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda or "",
        "driver_version": "",
    }


def test_a_whole_gpu_without_nvml_gets_torchs_uuid_prefixed_and_the_proc_files_driver(
    driver_file,
):
    identity = read_identity(
        torch.device("cuda:0"),
        visible=None,
        properties=properties(GPU_HEX),
        nvml=no_nvml,
        driver_file=driver_file,
    )

    assert (identity.device, identity.uuid, identity.gpu_instance_id) == ("cuda:0", GPU, "")
    assert (identity.mig_uuid, identity.name) == ("", "NVIDIA A100-SXM4-40GB")
    assert identity.driver_version == "570.86.15"


def test_the_device_index_picks_its_entry_of_cuda_visible_devices(tmp_path):
    identity = read_identity(
        torch.device("cuda:1"),
        visible=f"{GPU}, {MIG}",
        properties=properties(MIG_HEX),
        nvml=no_nvml,
        driver_file=tmp_path / "absent",
    )

    assert (identity.device, identity.mig_uuid) == ("cuda:1", MIG)
    assert identity.driver_version == "", "no driver file, no NVML: empty"


@pytest.mark.parametrize("visible", [MIG, MIG[:12]], ids=["whole-uuid", "its-first-digits"])
def test_a_mig_slice_without_nvml_names_the_slice_and_leaves_its_parent_unknown(
    driver_file, visible
):
    # torch reports the slice's own UUID: the parent GPU cannot be told without NVML.
    identity = read_identity(
        torch.device("cuda:0"),
        visible=visible,
        properties=properties(MIG_HEX, "NVIDIA A100-SXM4-40GB MIG 1g.5gb"),
        nvml=no_nvml,
        driver_file=driver_file,
    )

    assert (identity.uuid, identity.gpu_instance_id, identity.mig_uuid) == ("", "", MIG)
    assert identity.name == "NVIDIA A100-SXM4-40GB MIG 1g.5gb"


def test_a_mig_slice_with_nvml_gets_its_parent_gpu_and_instance_id_as_dcgm_labels_them(
    driver_file,
):
    nvml = FakeNvml(migs={MIG: (GPU, 3)}, gpus={GPU})

    identity = read_identity(
        torch.device("cuda:0"),
        visible=MIG,
        properties=properties(MIG_HEX),
        nvml=lambda: nvml,
        driver_file=driver_file,
    )

    labels = identity.labels()
    assert (labels["UUID"], labels["GPU_I_ID"], labels["mig_uuid"]) == (GPU, "3", MIG)
    assert labels["driver_version"] == "550.54.15", "NVML's driver, before the file's"
    assert nvml.open == 0, "NVML shut down again"


def test_a_mig_slice_torch_sees_without_cuda_visible_devices_is_found_by_nvml(driver_file):
    # MIG mode on and nothing set: CUDA shows the first slice, torch gives its UUID bare.
    nvml = FakeNvml(migs={MIG: (GPU, 7)}, gpus={GPU})

    identity = read_identity(
        torch.device("cuda:0"),
        visible=None,
        properties=properties(MIG_HEX),
        nvml=lambda: nvml,
        driver_file=driver_file,
    )

    assert (identity.uuid, identity.gpu_instance_id, identity.mig_uuid) == (GPU, "7", MIG)


def test_a_whole_gpu_with_nvml_keeps_no_instance(driver_file):
    identity = read_identity(
        torch.device("cuda:0"),
        visible="0",
        properties=properties(GPU_HEX),
        nvml=lambda: FakeNvml(migs={}, gpus={GPU}),
        driver_file=driver_file,
    )

    assert (identity.uuid, identity.gpu_instance_id, identity.mig_uuid) == (GPU, "", "")
    assert identity.driver_version == "550.54.15"


def test_nvml_that_cannot_start_leaves_what_torch_and_the_proc_file_tell(driver_file):
    identity = read_identity(
        torch.device("cuda:0"),
        visible=MIG,
        properties=properties(GPU_HEX),  # torch gives the parent's UUID here
        nvml=lambda: FakeNvml(migs={}, gpus=set(), init_fails=True),
        driver_file=driver_file,
    )

    assert (identity.uuid, identity.gpu_instance_id, identity.mig_uuid) == (GPU, "", MIG)
    assert identity.driver_version == "570.86.15"


def test_the_old_mig_name_carries_its_parent_and_instance_without_nvml(tmp_path):
    old = f"MIG-{GPU}/2/0"  # drivers before R470 named slices so

    identity = read_identity(
        torch.device("cuda:0"),
        visible=old,
        properties=properties(MIG_HEX),
        nvml=no_nvml,
        driver_file=tmp_path / "absent",
    )

    assert (identity.uuid, identity.gpu_instance_id, identity.mig_uuid) == (GPU, "2", old)


def test_nvml_failing_part_way_leaves_what_torch_tells(driver_file):
    class Refusing(FakeNvml):
        def nvmlDeviceGetGpuInstanceId(self, handle: str) -> int:
            raise self.NVMLError("Insufficient Permissions")

    nvml = Refusing(migs={MIG: (GPU, 3)}, gpus={GPU})

    identity = read_identity(
        torch.device("cuda:0"),
        visible=MIG,
        properties=properties(MIG_HEX),
        nvml=lambda: nvml,
        driver_file=driver_file,
    )

    assert (identity.uuid, identity.gpu_instance_id, identity.mig_uuid) == ("", "", MIG)
    assert identity.driver_version == "570.86.15" and nvml.open == 0


def test_an_old_pynvml_without_mig_calls_leaves_what_torch_tells_and_the_start_goes_on(
    driver_file,
):
    """pynvml 8 (older images) has no MIG functions and wants bytes for a UUID: it raises
    AttributeError and TypeError, not NVMLError. The identity is labels, never a failed start."""

    class Old(FakeNvml):
        nvmlDeviceIsMigDeviceHandle = None  # absent in that release: calling it fails

        def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
            if isinstance(uuid, str):
                raise TypeError("bytes or integer address expected instead of str instance")
            return super().nvmlDeviceGetHandleByUUID(uuid)

    identity = read_identity(
        torch.device("cuda:0"),
        visible=MIG,
        properties=properties(GPU_HEX),
        nvml=lambda: Old(migs={MIG: (GPU, 3)}, gpus={GPU}),
        driver_file=driver_file,
    )

    assert (identity.uuid, identity.gpu_instance_id, identity.mig_uuid) == (GPU, "", MIG)
    assert identity.driver_version == "570.86.15"


@pytest.mark.cuda
def test_on_a_real_gpu_torchs_uuid_is_one_nvidia_smi_lists():
    import os
    import shutil
    import subprocess

    identity = read_identity(torch.device("cuda:0"), visible=os.environ.get("CUDA_VISIBLE_DEVICES"))

    assert identity.uuid.startswith("GPU-") or identity.mig_uuid.startswith("MIG-")
    assert identity.name == torch.cuda.get_device_name(0)
    if shutil.which("nvidia-smi"):
        listed = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        assert (identity.uuid or identity.mig_uuid) in listed
