"""The allocator kept: a forward pass's activations are not faulted in afresh each pass."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from worker.process.allocator import keep_freed_memory

# A child process (mallopt is the whole process's): on a thread that is not the main one, as
# the engine runs them, four forward passes of a ResNet-18 on a 768 x 768 image (activations of
# up to 36 MiB, a few hundred allocations a pass) after a first one; the page faults of the four
# counted by the process's own rusage.
CHILD = textwrap.dedent(
    """
    import json, resource, sys, threading
    from worker.process.allocator import keep_freed_memory

    allocator = keep_freed_memory(sys.argv[1] == "kept")
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
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120
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


def test_the_setting_off_leaves_the_allocator_alone() -> None:
    allocator = keep_freed_memory(False)
    assert not allocator.kept
    assert "WORKER_MODEL__KEEP_FREED_MEMORY" in allocator.why
