"""Generated images for the demo, tests and benchmarks (no downloads anywhere)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def image_bytes(width: int, height: int, seed: int, fmt: str = "JPEG", quality: int = 85) -> bytes:
    """A smooth gradient with noise: compresses like a photo, not like a flat colour."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    base = rng.uniform(0, 255, size=3).astype(np.float32)
    channels = [
        (base[c] + 120 * np.sin((x * (c + 1) + y * (3 - c)) * np.pi)) % 256 for c in range(3)
    ]
    array = np.stack(channels, axis=-1)
    array += rng.normal(0, 12, size=(height, width, 1)).astype(np.float32)
    pixels = np.clip(array, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    if fmt == "JPEG":
        Image.fromarray(pixels).save(out, format="JPEG", quality=quality)
    else:
        Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def corrupt_bytes(seed: int = 0) -> bytes:
    """A JPEG header followed by garbage: looks like an image, decodes as nothing."""
    rng = np.random.default_rng(seed)
    return b"\xff\xd8\xff\xe0" + rng.integers(0, 256, size=2048, dtype=np.uint8).tobytes()


def truncated_bytes(width: int = 640, height: int = 480, seed: int = 0) -> bytes:
    data = image_bytes(width, height, seed)
    return data[: len(data) // 3]


RGB = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}


def rectangles_bytes(
    width: int,
    height: int,
    rectangles: list[tuple[int, int, int, int, str]],
    fmt: str = "JPEG",
) -> bytes:
    """Coloured rectangles (x1, y1, x2, y2 in pixels, end exclusive; colour name) on black:
    images of known content, for checking boxes and crop labels."""
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    for x1, y1, x2, y2, colour in rectangles:
        pixels[y1:y2, x1:x2] = RGB[colour]
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return out.getvalue()
