"""The GPU path's parts that run anywhere: device selection, precision, and out of device
memory (torch's own OutOfMemoryError, raised by a test double at a chosen size)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from torch import nn

from datasets.images import Decoded
from datasets.loader import Loaded
from datasets.sources import SourceConfig
from pipelines.declare import Classifier, Pipeline, Preprocess
from pipelines.device import visibility
from pipelines.runner import load_runner
from tests.fakes import FakePredictor
from tests.unit.test_engine import FlakyLoader, submit
from worker.engine import Engine
from worker.health.metrics import DeviceCollector


@pytest.mark.parametrize(
    ("entry", "visible", "device"),
    [
        ("cuda:3", "3", "cuda:0"),
        (
            "GPU-8f3c2a1e-55aa-4b0e-9c3d-0123456789ab",
            "GPU-8f3c2a1e-55aa-4b0e-9c3d-0123456789ab",
            "cuda:0",
        ),
        (
            "MIG-5c1e2d3f-0a1b-5c2d-8e9f-aabbccddeeff",
            "MIG-5c1e2d3f-0a1b-5c2d-8e9f-aabbccddeeff",
            "cuda:0",
        ),
        ("cuda", None, "cuda"),
        ("cpu", None, "cpu"),
        ("auto", None, "auto"),
    ],
)
def test_a_device_entry_becomes_the_only_visible_device(entry, visible, device):
    assert visibility(entry) == (visible, device)


class DeviceOfSize(FakePredictor):
    """A pipeline on a device that holds ``capacity`` pixels: more in one forward pass raises
    torch's own OutOfMemoryError, as CUDA's allocator does."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.batches: list[list[int]] = []

    def run(self, images, while_running=None):
        sides = [image.pixels.shape[1] for image in images]
        self.batches.append(sides)
        if sum(side * side for side in sides) > self.capacity:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return [[{"bbox": None, "classifications": []}] for _ in images]


class SizedLoader(FlakyLoader):
    """Image ``key`` is ``key`` x ``key`` pixels."""

    def next_loaded(self):
        request = self.queue.pop(0)
        pixels = np.zeros((3, request.key, request.key), dtype=np.uint8)
        return Loaded(request.key, Decoded(pixels, request.key, request.key), None, 0.0, 1)


def test_a_batch_out_of_device_memory_is_split_and_an_image_too_large_alone_fails_alone():
    trims = []
    device = DeviceOfSize(capacity=2 * 10 * 10)
    engine = Engine(SizedLoader(), device, release_memory=lambda: trims.append(1))  # type: ignore[arg-type]
    keys = [10, 11, 30, 9]  # 30x30 never fits; two of the others fit together
    submit(engine, keys)

    outcomes = engine.run_batch(keys).outcomes

    assert [k for k in keys if outcomes[k].ok] == [10, 11, 9]
    too_large = outcomes[30].failure
    assert too_large is not None and too_large.kind == "too_large_for_device"
    assert too_large.retryable, "another delivery may find the memory free"
    assert engine.out_of_memory == len(trims) >= 2
    assert len(device.batches[0]) == 4, "the whole batch was tried first"


def test_the_process_keeps_serving_after_running_out_of_device_memory():
    device = DeviceOfSize(capacity=10 * 10 - 1)
    engine = Engine(SizedLoader(), device, release_memory=lambda: None)  # type: ignore[arg-type]
    submit(engine, [10])
    assert engine.run_batch([10]).outcomes[10].failure is not None
    submit(engine, [8])
    assert engine.run_batch([8]).outcomes[8].ok and engine.out_of_memory == 1


class RecordsDtype(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        self.head = nn.Linear(3, num_classes)
        self.seen: list[torch.dtype] = []

    def forward(self, batch):
        out = self.head(batch.mean(dim=(2, 3)))
        self.seen.append(out.dtype)
        return out


@pytest.mark.parametrize(
    ("precision", "dtype"), [("float32", torch.float32), ("bfloat16", torch.bfloat16)]
)
def test_precision_is_the_forward_pass_dtype_and_outputs_stay_float32(precision, dtype):
    made: list[RecordsDtype] = []

    def build(num_classes):
        made.append(RecordsDtype(num_classes))
        return made[-1]

    stage = Classifier("c", architecture=build, labels=("a", "b"), preprocess=Preprocess(16))
    runner = load_runner(
        Pipeline("p", classifier=stage), SourceConfig(), "cpu", precision=precision
    )
    assert runner.classifier is not None
    logits = runner.classifier.logits(torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8))
    assert made[0].seen[-1] == dtype and logits.dtype == torch.float32


def test_device_memory_is_exported_when_there_is_a_device_and_left_out_when_not():
    on_gpu, on_cpu = CollectorRegistry(), CollectorRegistry()
    on_gpu.register(
        DeviceCollector(lambda: {"allocated": 1.0, "reserved": 2.0, "peak": 3.0}, lambda: 2)
    )
    on_cpu.register(DeviceCollector(dict, lambda: 0))
    gpu_text, cpu_text = generate_latest(on_gpu).decode(), generate_latest(on_cpu).decode()
    assert 'inference_worker_device_memory_bytes{kind="peak"} 3.0' in gpu_text
    assert "inference_worker_out_of_memory_splits_total 2.0" in gpu_text
    assert "device_memory_bytes" not in cpu_text
