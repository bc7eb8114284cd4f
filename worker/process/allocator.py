"""The C allocator told to keep the memory a CPU forward pass frees, for the next one.

A CPU forward pass of AMI's detector allocates and frees a few hundred activations an image,
the largest tens of MiB each (a 256-channel feature map at 192 x 336 is 63 MiB). glibc serves
every allocation over its mmap threshold (32 MiB at most) with a fresh ``mmap`` and gives it
back with ``munmap`` when freed, and a thread that allocates from an arena other than the main
one (the engine's thread, when glibc gave it one) has its large chunks mapped the same way. So
every large activation is new memory: each of its pages faulted in and zeroed by the kernel,
then handed back, once per layer per image. Measured on a 2-core host (BENCHMARKS.md, "The
allocator, and beside `ami worker` again on another CPU"): 13% of the worker's CPU went to the
kernel that way.

``for_process`` sets, through ``mallopt``, one arena for every thread of the main process, no
mapped chunks (every allocation from the heap) and the heap trimmed only past
``TRIM_THRESHOLD_BYTES`` free at its top: what a pass frees is there, paged in, for the next
pass. The peak is about the same (the same tensors are live at once, give or take
fragmentation); the resident memory stays near that peak between jobs instead of falling back
(``release_freed_memory`` hands the free pages back when pipelines are unloaded). Only for a
process whose device is the CPU, or ``auto`` on a host without an NVIDIA driver (a GPU's
activations are in its own memory: on the host this would only hold the model loads' copies),
whose loader children are not forked (they would inherit it), where the C library is glibc and
no other allocator is preloaded. Called once by ``worker run`` before ``asyncio.run``, before
any torch import: glibc fixes how many arenas it makes when a second thread first needs one.
``WORKER_MODEL__KEEP_FREED_MEMORY=false`` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from config.derived import chosen_device
from config.names import env_name
from config.settings import Settings

# mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: the most it can be told
# Present where an NVIDIA driver is loaded: "auto" is then taken for a GPU (torch is not asked:
# its CUDA check may start threads, and this must come before any).
NVIDIA_CONTROL = "/dev/nvidiactl"
_OPTIONS = (
    ("M_ARENA_MAX", M_ARENA_MAX, 1),
    ("M_MMAP_MAX", M_MMAP_MAX, 0),
    ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
)


@dataclass(frozen=True)
class Allocator:
    """What the start did to the C allocator, for the start's log line."""

    kept: bool
    why: str


def for_process(s: Settings) -> Allocator:
    """The allocator set to keep freed memory where it helps this process (the module's doc);
    what was done, and why."""
    setting = env_name("model", "keep_freed_memory")
    if not s.model.keep_freed_memory:
        return Allocator(False, f"{setting} is false: glibc's defaults")
    device = chosen_device(s)
    if device != "cpu" and not (device == "auto" and not Path(NVIDIA_CONTROL).exists()):
        return Allocator(False, f"device {device}: activations are not in host memory")
    if s.loader.mp_context == "fork":
        return Allocator(False, "the loader's children are forked: they would inherit it")
    return keep_freed_memory()


def keep_freed_memory() -> Allocator:
    """glibc's allocator set to keep freed memory; what was done."""
    library, version = platform.libc_ver()
    if library != "glibc":
        return Allocator(False, f"the C library is not glibc ({library or 'unknown'})")
    preloaded = os.environ.get("LD_PRELOAD", "")
    if "malloc" in preloaded:  # jemalloc, tcmalloc, mimalloc: glibc's mallopt would not act
        return Allocator(False, f"another allocator is preloaded ({preloaded})")
    mallopt = ctypes.CDLL(None).mallopt  # this process's own C library
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    refused = [name for name, option, value in _OPTIONS if mallopt(option, value) != 1]
    if refused:
        return Allocator(
            False, f"glibc {version} refused mallopt {', '.join(refused)} (the rest set)"
        )
    return Allocator(True, f"glibc {version}: one arena, no mapped chunks, trim past 2 GiB")


def release_freed_memory() -> None:
    """The heap's free pages handed back to the kernel (``malloc_trim``), as when pipelines
    are unloaded; nothing where the C library is not glibc."""
    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)
