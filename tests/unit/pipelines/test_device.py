"""The GPU path: the parts that run anywhere (device selection, precision, out of device memory
as torch's own OutOfMemoryError raised by a test double at a chosen size), then, marked
``cuda``, the parts only a CUDA device runs (copies on the side stream, a real out-of-memory
halving, nvJPEG decode, bfloat16 autocast)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from torch import nn

from datasets.images import Decoded, DecodePlan, decode, encoded_jpeg
from datasets.loader import Loaded
from datasets.uris import SourceConfig
from pipelines.declare import Classifier, Pipeline, Preprocess
from pipelines.device import CopyStats, decode_on_device, to_device_overlapped, visibility
from pipelines.runner import DeviceLimits, load_runner
from tests.fakes import FakePredictor
from tests.unit.engine.test_engine import FlakyLoader, ReadyLoader, submit
from worker.commands.demo_images import image_bytes
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


# -- On a CUDA device (marked ``cuda``: skipped without one; the GPU kit, bench/gpukit, runs
# them and reports what each records) ------------------------------------------------------

CUDA = torch.device("cuda")


class SmallNet(nn.Module):
    """Two strided convolutions and a linear head: real kernels, cheap."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2), nn.ReLU()
        )
        self.head = nn.Linear(32, num_classes)

    def forward(self, batch):
        return self.head(self.body(batch).mean(dim=(2, 3)))


def _runner(architecture, labels, size, crop_batch=64, precision="float32"):
    stage = Classifier("c", architecture=architecture, labels=labels, preprocess=Preprocess(size))
    limits = DeviceLimits(crop_batch=crop_batch)
    return load_runner(
        Pipeline("p", classifier=stage), SourceConfig(), "cuda", limits, precision=precision
    )


def _photos(count: int, width: int, height: int, plan: DecodePlan) -> list[Decoded]:
    return [decode(image_bytes(width, height, seed=seed), plan) for seed in range(count)]


@pytest.mark.cuda
def test_copies_on_the_side_stream_equal_plain_copies(record_property):
    torch.manual_seed(0)
    chunks = [
        [torch.randint(0, 256, (3, 60 + i, 40 + 3 * i), dtype=torch.uint8) for i in range(k, k + 3)]
        for k in range(0, 15, 3)
    ]
    stats = CopyStats()
    moved = list(to_device_overlapped(chunks, CUDA, stats, torch.cuda.Stream(CUDA)))
    torch.cuda.synchronize()
    assert stats.copies == len(chunks)
    for chunk, copies in zip(chunks, moved, strict=True):
        assert all(
            c.is_cuda and torch.equal(c.cpu(), t) for t, c in zip(chunk, copies, strict=True)
        )

    runner = _runner(SmallNet, tuple("abcde"), 64, crop_batch=4)
    images = _photos(10, 160, 120, DecodePlan(size=64))
    plain = runner.run(images)
    copied: list[list[Decoded]] = []
    runner.run(images[:3], lambda: copied.append(runner.copy_ahead(images)))  # while a batch runs
    assert all(image.pixels.is_cuda for image in copied[0])
    again = runner.run(copied[0])

    def answers(results):
        best = [per_image[0].classifications[0] for per_image in results]
        return [c.classification for c in best], [s for c in best for s in c.scores]

    (labels_a, scores_a), (labels_b, scores_b) = answers(plain), answers(again)
    difference = max(abs(a - b) for a, b in zip(scores_a, scores_b, strict=True))
    record_property("chunks_copied", stats.copies)
    record_property("copy_wait_s", round(stats.waited_s, 6))
    record_property("max_score_difference", difference)
    assert labels_a == labels_b and difference <= 1e-4


class Hungry(nn.Module):
    """A convolution to 64 channels at full size: about 128 MiB of activations a 512 x 512
    image, so a batch of 16 needs about 2 GiB."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.conv = nn.Conv2d(3, 64, 3, padding=1)
        self.head = nn.Linear(64, num_classes)

    def forward(self, batch):
        return self.head(torch.relu(self.conv(batch)).mean(dim=(2, 3)))


@pytest.mark.cuda
def test_a_real_cuda_out_of_memory_halves_the_batch_and_every_image_is_answered(
    record_property,
):
    runner = _runner(Hungry, ("a", "b"), 512, crop_batch=16)
    engine = Engine(ReadyLoader(), runner)  # type: ignore[arg-type]
    submit(engine, [1])
    assert engine.run_batch([1]).outcomes[1].ok  # cuDNN and cuBLAS set up while memory is free
    keys = list(range(2, 18))
    torch.cuda.empty_cache()
    left_bytes = 384 * 2**20  # one image fits (about 128 MiB), the batch (about 2 GiB) does not
    filler = torch.empty(torch.cuda.mem_get_info()[0] - left_bytes, dtype=torch.uint8, device=CUDA)
    try:
        submit(engine, keys)
        outcomes = engine.run_batch(keys).outcomes
    finally:
        del filler
        torch.cuda.empty_cache()

    ok = [key for key in keys if outcomes[key].ok]
    too_large = [
        key for key in keys if (f := outcomes[key].failure) and f.kind == "too_large_for_device"
    ]
    record_property("batch", len(keys))
    record_property("free_mib_left", left_bytes // 2**20)
    record_property("out_of_memory_splits", engine.out_of_memory)
    record_property("answered_ok", len(ok))
    record_property("too_large_for_device", len(too_large))
    assert engine.out_of_memory >= 1, "the whole batch did not fit: it was split"
    assert len(ok) + len(too_large) == len(keys), {k: outcomes[k].failure for k in keys}
    assert ok, "an image alone fits"


@pytest.mark.cuda
def test_nvjpeg_decodes_a_4k_jpeg_as_the_cpu_does(record_property):
    from torchvision.io import ImageReadMode, decode_jpeg

    data = image_bytes(3840, 2160, seed=3, quality=90)
    on_gpu = decode_on_device(encoded_jpeg(data, 4096), CUDA, 4096).pixels
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    direct = decode_jpeg(raw, mode=ImageReadMode.RGB, device=CUDA)
    assert torch.equal(on_gpu, direct), "decoded by nvJPEG, not by the CPU fallback"
    on_cpu = torch.from_numpy(decode(data, DecodePlan(max_side=4096)).pixels)
    assert tuple(on_gpu.shape) == tuple(on_cpu.shape) == (3, 2160, 3840)
    difference = (on_gpu.cpu().to(torch.int16) - on_cpu.to(torch.int16)).abs().float()
    other = torch.from_numpy(decode(image_bytes(3840, 2160, seed=4), DecodePlan()).pixels)
    unrelated = (other.to(torch.int16) - on_cpu.to(torch.int16)).abs().float().mean()
    record_property("mean_abs_difference", round(float(difference.mean()), 3))
    record_property(
        "p99_abs_difference",
        float(difference.flatten().kthvalue(int(0.99 * difference.numel())).values),
    )
    record_property("max_abs_difference", float(difference.max()))
    record_property("share_off_by_more_than_16", round(float((difference > 16).float().mean()), 5))
    record_property("another_image_mean_abs_difference", round(float(unrelated), 1))
    assert float(difference.mean()) <= 2.0 < float(unrelated)
    assert float((difference > 16).float().mean()) <= 0.01


@pytest.mark.cuda
def test_bfloat16_autocast_keeps_the_top_label_of_float32(record_property):
    """A ResNet-18 (random weights) whose head holds each image's own centred float32
    features as its class: top-1 is the image itself by a clear margin, which bfloat16's
    rounding must not undo."""
    import torchvision

    batch = torch.stack(
        [torch.from_numpy(image.pixels) for image in _photos(32, 320, 240, DecodePlan(size=128))]
    )
    torch.manual_seed(0)
    features = torchvision.models.resnet18(num_classes=1).eval()
    features.fc = nn.Identity()
    width = tuple(f"f{i}" for i in range(512))
    found = _runner(lambda _n: features, width, 128).classifier.logits(batch)
    centre = found.mean(dim=0)
    prototypes = (found - centre) / (found - centre).norm(dim=1, keepdim=True)
    head = nn.Linear(512, len(batch))
    with torch.no_grad():
        head.weight.copy_(prototypes)
        head.bias.copy_(-(prototypes @ centre))
    model = nn.Sequential(features, head).eval()
    labels = tuple(f"image{i}" for i in range(len(batch)))
    logits = {
        precision: _runner(lambda _n: model, labels, 128, precision=precision).classifier.logits(
            batch
        )
        for precision in ("float32", "bfloat16")
    }
    reference, reduced = logits["float32"], logits["bfloat16"]
    agreement = float((reference.argmax(1) == reduced.argmax(1)).float().mean())
    record_property("images", len(batch))
    record_property("top1_agreement", agreement)
    relative = (reduced - reference).abs().max() / reference.abs().max()
    record_property("max_relative_logit_difference", round(float(relative), 4))
    assert torch.equal(reference.argmax(1), torch.arange(len(batch))), "each image its own class"
    assert agreement >= 0.95


@pytest.mark.parametrize(
    "where", [torch.device("cpu"), pytest.param(CUDA, marks=pytest.mark.cuda)], ids=str
)
def test_a_full_size_plan_keeps_a_jpeg_left_encoded_whole_where_it_is_decoded(where):
    data = image_bytes(1200, 800, seed=4)  # over the side bound of 500, under 1,000,000 pixels
    left = encoded_jpeg(data, 500, 1_000_000)
    decoded = decode_on_device(left, where, 500, 1_000_000)
    assert tuple(decoded.pixels.shape) == (3, 800, 1200)
    assert tuple(decode_on_device(left, where, 500).pixels.shape) == (3, 333, 500)
