"""How far the loader's default path (reduced-scale JPEG decode leaving twice the input size,
then torchvision's antialiased resize) and its fast path (reduced scale down to about the
input size, PIL's resize) move a classifier's input and outputs from the reference (full
decode, then torchvision's transform of the same name), and what each path costs per image.
No downloads: the images are generated camera-trap-like scenes (textured background,
moth-like blobs; ``--noisy``: with sensor-like noise, 20+ MB JPEGs as a camera trap's), the
classifiers randomly initialised with trained-looking batch norms (a trained model is, if
anything, less sensitive).

    .venv/bin/python -m bench.preprocess [--images 40] [--width 4096 --height 2160] [--noisy]
    .venv/bin/python -m bench.preprocess --smoke     # outcomes only (the test suite runs it)

Tolerance (the default path against the reference; exit 1 and an error line when missed):
mean absolute pixel difference at most ``MEAN_PIXEL_TOLERANCE`` (0-255). Top-1 agreement on
standardised logits is reported beside it, not gated: over a dozen images one label is 8%.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from bench.common.records import date_utc
from bench.outcomes import BenchmarkFailed, refusing
from datasets.images import DecodePlan, decode
from pipelines.architectures import build_classifier

MEAN_PIXEL_TOLERANCE = 0.5
PATHS = {"default": {}, "fast": {"fast": True}}
CASES = [  # (architecture, size, resize) as AMI's classifiers use them
    ("resnet50", 128, "squash"),
    ("resnet50", 300, "shorter_crop"),
    ("resnet18", 224, "squash"),
]


def scene(width: int, height: int, seed: int) -> bytes:
    """A textured background with a few dozen bright, blurred blobs; JPEG quality 90."""
    rng = np.random.default_rng(seed)
    small = rng.uniform(0, 255, size=(height // 64 + 1, width // 64 + 1, 3)).astype(np.uint8)
    background = np.asarray(
        Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32
    )
    background += rng.normal(0, 10, size=(height, width, 1)).astype(np.float32)
    yy, xx = np.mgrid[0:height:8, 0:width:8]
    blobs = np.zeros((*yy.shape, 3), dtype=np.float32)
    for _ in range(30):
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        r = rng.uniform(20, 150)
        colour = rng.uniform(0, 255, size=3)
        weight = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * r * r))[..., None]
        blobs += weight * (colour - 128)
    up = np.asarray(
        Image.fromarray(np.clip(blobs + 128, 0, 255).astype(np.uint8)).resize((width, height)),
        dtype=np.float32,
    )
    pixels = np.clip(0.6 * background + 0.8 * (up - 128) + 40, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def trained_looking(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            n = module.num_features
            assert module.running_mean is not None and module.running_var is not None
            module.running_mean.copy_(torch.randn(n, generator=generator) * 0.5)
            module.running_var.copy_(torch.rand(n, generator=generator) + 0.5)
    return model.eval()


def normalised(batch: np.ndarray) -> torch.Tensor:
    mean = torch.tensor((0.485, 0.456, 0.406)).view(1, 3, 1, 1) * 255
    std = torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1) * 255
    return (torch.from_numpy(batch).float() - mean) / std


def timed_decode(data: list[bytes], plan: DecodePlan) -> tuple[np.ndarray, float]:
    started = time.process_time()
    arrays = [decode(d, plan).pixels for d in data]
    return np.stack(arrays), (time.process_time() - started) * 1000 / len(data)


def decode_costs(data: list[bytes]) -> dict[str, float]:
    """CPU ms per image to get pixels at all: PIL full decode, PIL reduced-scale (1/4 and
    1/8) and torchvision.io.decode_jpeg."""
    from torchvision.io import decode_jpeg

    def cost(step: Callable[[bytes], object]) -> float:
        started = time.process_time()
        for d in data:
            step(d)
        return round((time.process_time() - started) * 1000 / len(data), 1)

    def draft(scale: int) -> Callable[[bytes], None]:
        def step(d: bytes) -> None:
            image = Image.open(io.BytesIO(d))
            image.draft("RGB", (image.width // scale, image.height // scale))
            image.convert("RGB")

        return step

    return {
        "pil_full_ms": cost(lambda d: Image.open(io.BytesIO(d)).convert("RGB")),
        "pil_draft_quarter_ms": cost(draft(4)),
        "pil_draft_eighth_ms": cost(draft(8)),
        "torchvision_decode_jpeg_ms": cost(
            lambda d: decode_jpeg(torch.frombuffer(bytearray(d), dtype=torch.uint8))
        ),
    }


def compare(model: torch.nn.Module, exact: np.ndarray, other: np.ndarray) -> dict[str, float | int]:
    """How far ``other`` (a path's batch) is from ``exact`` (the reference's), in pixels and
    in the classifier's top-1."""
    with torch.inference_mode():
        l_other, l_exact = model(normalised(other)), model(normalised(exact))
    p_other, p_exact = torch.softmax(l_other, dim=1), torch.softmax(l_exact, dim=1)
    # A random network's logits are mostly a constant offset; standardising each class over
    # the reference images leaves the part that depends on the image, so these labels move
    # with the input as a trained model's do (a harsh test).
    mean, std = l_exact.mean(0), l_exact.std(0) + 1e-6
    z_other, z_exact = (l_other - mean) / std, (l_exact - mean) / std
    n = len(exact)
    between = torch.cdist(l_exact, l_exact).sum() / (n * (n - 1))
    diff = np.abs(other.astype(np.int16) - exact.astype(np.int16))
    return {
        "max_pixel_diff": int(diff.max()),
        "mean_pixel_diff": round(float(diff.mean()), 3),
        "top1_changed": int((p_other.argmax(1) != p_exact.argmax(1)).sum()),
        "top1_changed_standardised": int((z_other.argmax(1) != z_exact.argmax(1)).sum()),
        "top1_agreement_standardised": round(
            float((z_other.argmax(1) == z_exact.argmax(1)).float().mean()), 3
        ),
        "logit_shift_vs_between_images": round(
            float((l_other - l_exact).norm(dim=1).mean() / between), 3
        ),
        "max_score_diff": round(float((p_other - p_exact).abs().max()), 5),
    }


def one_case(data: list[bytes], architecture: str, size: int, resize: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = trained_looking(build_classifier(architecture, 1000), seed=1)
    exact, exact_ms = timed_decode(data, DecodePlan(size=size, resize=resize, exact=True))
    row: dict[str, Any] = {
        "model": f"{architecture} {size} {resize}",
        "of": len(data),
        "exact_cpu_ms_per_image": round(exact_ms, 1),
    }
    for name, path in PATHS.items():
        batch, ms = timed_decode(data, DecodePlan(size=size, resize=resize, **path))
        if batch.shape != exact.shape:
            raise BenchmarkFailed(f"{name} path made {batch.shape}, reference {exact.shape}")
        row[name] = {"cpu_ms_per_image": round(ms, 1), **compare(model, exact, batch)}
    return row


def within_tolerance(cases: list[dict[str, Any]]) -> None:
    """``BenchmarkFailed`` when the default path is further from the reference than stated."""
    for row in cases:
        default = row["default"]
        if default["mean_pixel_diff"] > MEAN_PIXEL_TOLERANCE:
            raise BenchmarkFailed(
                f"{row['model']}: the default path is outside its tolerance (mean pixel diff "
                f"{default['mean_pixel_diff']} > {MEAN_PIXEL_TOLERANCE})"
            )


@refusing
def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--images", type=int, default=40)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--height", type=int, default=2160)
    parser.add_argument("--noisy", action="store_true", help="sensor-like noise, 20+ MB JPEGs")
    parser.add_argument("--smoke", action="store_true", help="tiny and quick: outcomes only")
    args = parser.parse_args()
    if args.smoke:
        args.images, args.width, args.height = 4, 640, 480
    torch.set_num_threads(2)
    if args.noisy:
        from bench.network import noisy_jpeg

        data = [noisy_jpeg(args.width, args.height, 95, 18.0, seed) for seed in range(args.images)]
    else:
        data = [scene(args.width, args.height, seed) for seed in range(args.images)]
    report: dict[str, Any] = {
        "images": args.images,
        "size": f"{args.width}x{args.height}",
        "noisy": args.noisy,
        "mean_jpeg_bytes": int(np.mean([len(d) for d in data])),
        "decode": decode_costs(data[:10]),
        "tolerance": {"mean_pixel_diff_at_most": MEAN_PIXEL_TOLERANCE},
        "date": date_utc(),
    }
    cases = []
    for architecture, size, resize in CASES[-1:] if args.smoke else CASES:
        cases.append(one_case(data, architecture, size, resize))
        print(json.dumps(cases[-1]), flush=True)
    report["cases"] = cases
    print(json.dumps(report, indent=2))
    within_tolerance(cases)


if __name__ == "__main__":
    main()
