"""torchvision's CPU JPEG decoder (libjpeg-turbo, about 10% less CPU than PIL's on a 4K JPEG)
without importing the torchvision package.

``torchvision.io.decode_jpeg`` on a CPU tensor is one call of the ``image.decode_jpeg`` op
that torchvision's image extension registers with torch (``image_stable`` in torchvision 0.29,
``image`` in 0.25, the oldest pyproject.toml admits). Loading that extension
takes milliseconds; importing torchvision to reach it takes about 1.5 s of CPU in every worker
process and its loader's fork server (``datasets.resize`` says why). So the extension is
loaded by itself, once per process at the first JPEG; where it cannot be (a torchvision
without it, or one whose op has another signature), ``decoder()`` is None and PIL decodes
the same pixels. ``tests/unit/datasets/test_resize.py`` checks the op against ``torchvision.io``.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
import structlog
import torch
from PIL import Image

log = structlog.get_logger(__name__)
_EXTENSIONS = ("image_stable", "image")  # torchvision 0.29's name, then 0.25's
_RGB = 3  # torchvision.io.ImageReadMode.RGB


@functools.cache
def decoder() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A function from a JPEG's bytes (a uint8 tensor) to its (3, H, W) uint8 RGB pixels, or
    None when torchvision's extension is not to be had, or does not decode a probe image to
    PIL's pixels (an op of another signature or meaning)."""
    path = _extension()
    if path is None:
        return None
    try:
        torch.ops.load_library(str(path))
        op = torch.ops.image.decode_jpeg

        def decode(data: torch.Tensor) -> torch.Tensor:
            pixels: torch.Tensor = op(data, _RGB, False)
            return pixels

        why = _probe(decode)
    except (OSError, RuntimeError, AttributeError, TypeError) as error:
        why = f"{type(error).__name__}: {error}"
    if why is not None:
        log.info("jpeg_decoder_unavailable", error=why, effect="PIL decodes JPEGs")
        return None
    return decode


def _extension() -> Path | None:
    """torchvision's image extension, found as Python finds extension modules (the first of
    this interpreter's suffixes present), without importing torchvision."""
    spec = importlib.util.find_spec("torchvision")  # found, not imported
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for name in _EXTENSIONS:
        for folder in folders:
            for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                path = Path(folder) / f"{name}{suffix}"
                if path.is_file():
                    return path
    return None


def _probe(decode: Callable[[torch.Tensor], torch.Tensor]) -> str | None:
    """Why ``decode`` cannot be trusted, or None: a small JPEG must come out as PIL reads it."""
    out = io.BytesIO()
    pattern = (np.arange(16 * 24 * 3, dtype=np.uint16) * 37 % 251).astype(np.uint8)
    Image.fromarray(pattern.reshape(16, 24, 3)).save(out, format="JPEG", quality=90)
    data = out.getvalue()
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).transpose(2, 0, 1)
    got = decode(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if tuple(got.shape) != expected.shape or not np.array_equal(got.numpy(), expected):
        return f"a probe JPEG decoded to {tuple(got.shape)}, not PIL's pixels {expected.shape}"
    return None
