"""The allocator kept: a forward pass's activations are not faulted in afresh each pass."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from config.settings import load_settings
from worker.process.allocator import for_process

# A child process (mallopt is the whole process's): on a thread that is not the main one, as
# the engine runs them, four forward passes of a ResNet-18 on a 768 x 768 image (activations of
# up to 36 MiB, a few hundred allocations a pass) after a first one; the page faults of the four
# counted by the process's own rusage.
CHILD = textwrap.dedent(
    """
    import ctypes, json, resource, sys, threading
    from worker.process.allocator import Allocator, keep_freed_memory

    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages on any host
    kept = sys.argv[1] == "kept"
    allocator = keep_freed_memory() if kept else Allocator(False, "glibc's defaults")
    import torch, torchvision

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torchvision.models.resnet18().eval()
    image = torch.rand(1, 3, 768, 768)
    faults = []

    def passes():
        with torch.inference_mode():
            net(image)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(4):
                net(image)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    thread = threading.Thread(target=passes)
    thread.start()
    thread.join()
    print(json.dumps({"kept": allocator.kept, "why": allocator.why, "faults": faults[0]}))
    """
)


def _faults(mode: str) -> dict[str, Any]:
    env = {  # glibc's own defaults in the child, whatever this environment tunes
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))
    }
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting acts on glibc only")
def test_a_kept_allocator_reuses_freed_activations_instead_of_faulting_them_in_again() -> None:
    default, kept = _faults("default"), _faults("kept")
    assert default["kept"] is False and kept["kept"] is True, kept["why"]
    # glibc's defaults: each large activation a fresh mapping, every page of it faulted in
    # (about 160,000 faults for the four passes here); kept: the memory of the first pass again.
    assert int(default["faults"]) > 40_000
    assert int(kept["faults"]) < int(default["faults"]) // 4


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"model": {"keep_freed_memory": False}}, "WORKER_MODEL__KEEP_FREED_MEMORY is false"),
        ({"model": {"device": "cuda:0"}}, "device cuda:0"),
        ({"model": {"device": "cpu"}, "loader": {"mp_context": "fork"}}, "forked"),
    ],
)
def test_the_allocator_is_left_alone_where_keeping_would_not_help(
    settings: dict[str, Any], why: str
) -> None:
    allocator = for_process(load_settings(**settings))
    assert not allocator.kept
    assert why in allocator.why
