"""The C allocator told to keep the memory a forward pass frees, for the next one.

A CPU forward pass of AMI's detector allocates and frees a few hundred activations an image,
the largest tens of MiB each (a 256-channel feature map at 192 x 336 is 63 MiB). glibc serves
every allocation over its mmap threshold (32 MiB at most) with a fresh ``mmap`` and gives it
back with ``munmap`` when freed, and each thread but the main one allocates from an arena of
its own, whose large chunks are mapped the same way. So every large activation is new memory:
each of its pages faulted in and zeroed by the kernel, then handed back, once per layer per
image. Measured on a 2-core host (BENCHMARKS.md, "The allocator"): about an eighth of the
worker's CPU went to the kernel that way.

``keep_freed_memory`` sets, through ``mallopt``, one arena for every thread, no mapped chunks
(every allocation from the heap) and the heap trimmed only past ``TRIM_THRESHOLD_BYTES`` free at
its top: what a pass frees is there, paged in, for the next pass. The peak is the same (the
same tensors are live at once, give or take fragmentation); the resident memory stays near that
peak between jobs instead of falling back. Only where the C library is glibc; called once, at
the start of a worker process, before its threads (an arena is a thread's from its first
allocation). ``WORKER_MODEL__KEEP_FREED_MEMORY=false`` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass

from config.names import env_name

# mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: the most it can be told


@dataclass(frozen=True)
class Allocator:
    """What the start did to the C allocator, for the start's log line."""

    kept: bool
    why: str


def keep_freed_memory(enabled: bool) -> Allocator:
    """glibc's allocator set to keep freed memory (see the module's doc); what was done."""
    if not enabled:
        return Allocator(
            False, f"{env_name('model', 'keep_freed_memory')} is false: glibc's defaults"
        )
    library, version = platform.libc_ver()
    if library != "glibc":
        return Allocator(False, f"the C library is not glibc ({library or 'unknown'})")
    mallopt = ctypes.CDLL(None).mallopt  # this process's own C library
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    refused = [name for name, (option, value) in zip(_NAMES, settings, strict=True)
               if mallopt(option, value) != 1]  # fmt: skip
    if refused:
        return Allocator(False, f"glibc {version} refused mallopt {', '.join(refused)}")
    return Allocator(True, f"glibc {version}: one arena, no mapped chunks, trim past 2 GiB")


_NAMES = ("M_ARENA_MAX", "M_MMAP_MAX", "M_TRIM_THRESHOLD")
