"""torchvision's CPU JPEG decoder (libjpeg-turbo, about 10% less CPU than PIL's on a 4K JPEG)
without importing the torchvision package.

``torchvision.io.decode_jpeg`` on a CPU tensor is one call of the ``image.decode_jpeg`` op
that torchvision's ``image_stable`` extension registers with torch. Loading that extension
takes milliseconds; importing torchvision to reach it takes about 1.5 s of CPU in every worker
process and its loader's fork server (``datasets.resize`` says why). So the extension is
loaded by itself, once per process at the first JPEG; where it cannot be (a torchvision
without it, or one whose op has another signature), ``decoder()`` is None and PIL decodes
the same pixels. ``tests/unit/test_resize.py`` checks the op against ``torchvision.io``.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)
_EXTENSION = "image_stable"
_RGB = 3  # torchvision.io.ImageReadMode.RGB


@functools.cache
def decoder() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A function from a JPEG's bytes (a uint8 tensor) to its (3, H, W) uint8 RGB pixels, or
    None when torchvision's extension is not to be had."""
    spec = importlib.util.find_spec("torchvision")  # found, not imported
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [path for folder in folders for path in Path(folder).glob(f"{_EXTENSION}*.so")]
    if not found:
        return None
    try:
        torch.ops.load_library(str(found[0]))
        op = torch.ops.image.decode_jpeg
    except (OSError, RuntimeError, AttributeError) as error:
        log.info("jpeg_decoder_unavailable", error=f"{type(error).__name__}: {error}")
        return None

    def decode(data: torch.Tensor) -> torch.Tensor:
        pixels: torch.Tensor = op(data, _RGB, False)
        return pixels

    return decode
