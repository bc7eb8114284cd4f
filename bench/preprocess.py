"""How far the loader's fast path (reduced-scale JPEG decode, PIL resize) moves a classifier's
outputs from the reference path (full decode, then torchvision's transform of the same name),
and what each path costs per image. No downloads: the images are generated camera-trap-like
scenes (textured background, moth-like blobs), the classifiers are randomly initialised with
trained-looking batch norms (a trained model is, if anything, less sensitive).

    .venv/bin/python -m bench.preprocess [--images 40] [--width 4096 --height 2160]
"""

from __future__ import annotations

import argparse
import io
import json
import time

import numpy as np
import torch
from PIL import Image

from datasets.images import DecodePlan, decode
from pipelines.architectures import build_classifier

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

    def cost(step) -> float:
        started = time.process_time()
        for d in data:
            step(d)
        return round((time.process_time() - started) * 1000 / len(data), 1)

    def draft(scale: int):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=40)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--height", type=int, default=2160)
    args = parser.parse_args()
    torch.set_num_threads(2)
    data = [scene(args.width, args.height, seed) for seed in range(args.images)]
    report: dict[str, object] = {
        "images": args.images,
        "size": f"{args.width}x{args.height}",
        "mean_jpeg_bytes": int(np.mean([len(d) for d in data])),
        "decode": decode_costs(data[:10]),
    }
    cases = []
    for architecture, size, resize in CASES:
        torch.manual_seed(0)
        model = trained_looking(build_classifier(architecture, 1000), seed=1)
        fast, fast_ms = timed_decode(data, DecodePlan(size=size, resize=resize, fast=True))
        exact, exact_ms = timed_decode(data, DecodePlan(size=size, resize=resize, fast=False))
        with torch.inference_mode():
            l_fast, l_exact = model(normalised(fast)), model(normalised(exact))
        p_fast, p_exact = torch.softmax(l_fast, dim=1), torch.softmax(l_exact, dim=1)
        # A random network's logits are mostly a constant offset; standardising each class
        # over the reference images leaves the part that depends on the image, so these labels
        # move with the input as a trained model's do (a harsh test of the fast path).
        mean, std = l_exact.mean(0), l_exact.std(0) + 1e-6
        z_fast, z_exact = (l_fast - mean) / std, (l_exact - mean) / std
        between = torch.cdist(l_exact, l_exact).sum() / (len(data) * (len(data) - 1))
        cases.append(
            {
                "model": f"{architecture} {size} {resize}",
                "top1_changed": int((p_fast.argmax(1) != p_exact.argmax(1)).sum()),
                "top1_changed_standardised": int((z_fast.argmax(1) != z_exact.argmax(1)).sum()),
                "of": args.images,
                "logit_shift_vs_between_images": round(
                    float((l_fast - l_exact).norm(dim=1).mean() / between), 3
                ),
                "max_score_diff": round(float((p_fast - p_exact).abs().max()), 5),
                "mean_pixel_diff": round(float(np.abs(fast.astype(int) - exact).mean()), 2),
                "fast_ms_per_image": round(fast_ms, 1),
                "exact_ms_per_image": round(exact_ms, 1),
            }
        )
        print(json.dumps(cases[-1]), flush=True)
    report["cases"] = cases
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
