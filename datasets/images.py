"""Decode JPEG/PNG bytes into the uint8 CHW array a pipeline wants, by a ``DecodePlan``.

Three plans: a classifier-only pipeline gets its square input (``size``), made the way the
model was trained (``squash`` or ``shorter_crop``); a pipeline with a detector gets the
image itself, its longest side bounded by ``max_side``, with the source's size beside it so
boxes can be reported in source pixels; a detector that sees images at their own size (AMI's,
as ``ami worker`` does) gets the image whole, up to ``max_pixels``, and a larger one is
refused (``too_large``) rather than detected at another size than its publisher's.

Three ways to make a classifier's square (docs/data-loading.md, "Preprocessing"):

- ``reduced`` (the default): a JPEG decoded at the smallest of libjpeg's DCT scales (1/2, 1/4,
  1/8, through PIL's ``draft``) that still leaves ``DRAFT_MARGIN`` (2) source pixels per
  output pixel on each side (``FINE_MARGIN``, 4, where that costs no finer scale than 1/4),
  then the reference's antialiased bilinear resize by the true scale, and its crop: within a
  mean 0.2-0.4 (0-255) of the reference on camera-trap-like 4K JPEGs, for about the fast
  path's CPU (BENCHMARKS.md, "Preprocessing"). An image too small to reduce takes the exact
  path, and so gives the reference's pixels;
- ``exact``: the reference: the image decoded whole and resized by torchvision, as
  torchvision's ``Resize``/``CenterCrop`` do in training;
- ``fast``: the old fast path: reduced-scale decode to just the output size, PIL's resize.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image

from config.errors import PermanentError
from config.names import env_name
from datasets import jpeg
from datasets.resize import center_crop, resized, shorter_side_to

# Only these decoders ever see task bytes (Image.open would otherwise try every plugin).
# A phone's MPO (multi-picture JPEG) opens through the JPEG decoder and is read as a JPEG.
DECODERS = ("JPEG", "PNG")
SUPPORTED_FORMATS = frozenset({"JPEG", "MPO", "PNG"})
# What each cap bounds (docs/data-loading.md, "Memory"). MAX_PIXELS: the decoded source (and
# so the decoder's own buffer and its RGB copies). MAX_ASPECT_RATIO: refused from the header,
# before any decode, so no resize of it (here, or the engine's on the device) is made from a
# sliver: a 1 x 4,000,000
# PNG of 16 KB would otherwise ask gigabytes of a resize to 224 x 224. MAX_RESIZE_PIXELS: the
# largest intermediate a square plan's resize makes (one pass of a separable resize, size x the
# longest side; shorter_crop's resized image, size x size x the aspect ratio), checked before it
# runs.
MAX_PIXELS = 64_000_000
MAX_ASPECT_RATIO = 100
MAX_RESIZE_PIXELS = MAX_PIXELS
_SIXTEEN_BIT_GREY = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})
# The reduced path's JPEG scale leaves at least DRAFT_MARGIN source pixels per output pixel on
# each side, and FINE_MARGIN where that still allows 1/4 or less: decoding at 1/4 costs
# little more than at 1/8 (entropy decoding dominates), at 1/2 about a third more.
DRAFT_MARGIN = 2
FINE_MARGIN = 4


@dataclass(frozen=True)
class DecodePlan:
    size: int = 0  # > 0: a square of this side; 0: the image, bounded by max_side
    resize: str = "squash"  # squash | shorter_crop (square plans only)
    max_side: int = 4096
    # > 0 (detector plans): the image at its own size, never reduced; one of more pixels is
    # refused. 0: the image bounded by max_side.
    max_pixels: int = 0
    fast: bool = False  # square plans: the old fast path (reduced scale to ~1x, PIL resize)
    exact: bool = False  # square plans: the reference path (full decode); else ``reduced``
    # Detector pipelines: hand a JPEG over still encoded (checked, not decoded), for the engine
    # to decode on the GPU; anything else is decoded here as usual.
    encoded: bool = False

    def __post_init__(self) -> None:
        if self.fast and self.exact:
            raise ValueError("a decode plan is fast or exact, not both")

    def max_image_bytes(self) -> int:
        """The most host bytes one decoded image can take under this plan."""
        if not self.size and self.max_pixels:
            return 3 * self.max_pixels
        side = self.size or self.max_side
        return 3 * side * side


class Decoded(NamedTuple):
    pixels: Any  # (3, H, W) uint8: a numpy array, or a torch tensor once on a device
    source_width: int
    source_height: int
    encoded: bytes | None = None  # the JPEG itself, when the engine is to decode it


def encoded_jpeg(data: bytes, max_side: int, max_pixels: int = 0) -> Decoded:
    """A JPEG checked (format, size, bombs) but left encoded; other images decoded now."""
    plan = DecodePlan(max_side=max_side, max_pixels=max_pixels)
    try:
        image = _open(data)
    except PermanentError:
        raise
    except Exception:  # noqa: BLE001 - whatever it is, the full decode below says it properly
        return decode(data, plan)
    _check_full_size(image, plan)
    if not _libjpeg_decodable(image):
        return decode(data, plan)
    return Decoded(np.zeros((3, 0, 0), dtype=np.uint8), image.width, image.height, data)


def decode(data: bytes, plan: DecodePlan) -> Decoded:
    """``data`` decoded by ``plan``; PermanentError for anything not a sound image."""
    if plan.encoded and not plan.size:
        return encoded_jpeg(data, plan.max_side, plan.max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = _open(data)
            source = image.size
            if plan.size:
                pixels = _square(image, data, plan)
            elif plan.max_pixels:
                _check_full_size(image, plan)
                pixels = _full(image, data).numpy()
            else:
                pixels = _bounded(image, data, plan.max_side)
    except PermanentError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise PermanentError(f"image too large to decode: {error}", kind="too_large") from None
    except Image.UnidentifiedImageError:
        raise PermanentError(
            "not a JPEG or PNG image; JPEG and PNG are accepted", kind="unsupported_format"
        ) from None
    except (OSError, SyntaxError, ValueError) as error:
        raise PermanentError(f"cannot decode image: {error}", kind="corrupt_image") from None
    return Decoded(pixels, source[0], source[1])


def decode_resized(data: bytes, size: int) -> np.ndarray:
    """``data`` squashed to (3, size, size) by the fast path (benchmarks and tests)."""
    return decode(data, DecodePlan(size=size, fast=True)).pixels


def _open(data: bytes) -> Image.Image:
    """The image's header read by an accepted decoder; PermanentError for an empty file, a
    format we do not take, too many pixels or a decompression bomb."""
    if not data:
        raise PermanentError("empty image file", kind="corrupt_image")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=DECODERS)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
            raise PermanentError(f"image too large to decode: {error}", kind="too_large") from None
    if image.format not in SUPPORTED_FORMATS:
        raise PermanentError(
            f"unsupported image format {image.format}; JPEG and PNG are accepted",
            kind="unsupported_format",
        )
    if image.width * image.height > MAX_PIXELS:
        raise PermanentError(
            f"image is {image.width}x{image.height}, over {MAX_PIXELS} pixels", kind="too_large"
        )
    if max(image.size) > MAX_ASPECT_RATIO * min(image.size):
        raise PermanentError(
            f"image is {image.width}x{image.height}: one side over {MAX_ASPECT_RATIO} times the "
            "other is refused before decoding (resizing such a sliver takes memory out of all "
            "proportion to its bytes)",
            kind="too_large",
        )
    return image


def _check_full_size(image: Image.Image, plan: DecodePlan) -> None:
    """Refuse, from the header, an image over a full-size plan's ``max_pixels``: it would be
    detected at another size than its publisher's worker detects it, or not fit the memory
    bound the plan was counted at."""
    if plan.max_pixels and image.width * image.height > plan.max_pixels:
        raise PermanentError(
            f"image is {image.width}x{image.height} ({image.width * image.height} pixels): this "
            f"pipeline detects at full size, up to {plan.max_pixels} pixels "
            f"({env_name('loader', 'max_pixels')})",
            kind="too_large",
        )


def _check_resize(image: Image.Image, plan: DecodePlan) -> None:
    """Refuse, before it runs, a square plan's resize whose intermediate would pass
    MAX_RESIZE_PIXELS (the source's own pixels are bounded by MAX_PIXELS already)."""
    longest, shortest = max(image.size), min(image.size)
    needed = plan.size * longest
    if plan.resize == "shorter_crop":
        needed = max(needed, plan.size * math.ceil(plan.size * longest / shortest))
    if needed > MAX_RESIZE_PIXELS:
        raise PermanentError(
            f"image is {image.width}x{image.height}: resizing it to {plan.size} ({plan.resize}) "
            f"would take {needed} pixels at once, over {MAX_RESIZE_PIXELS}",
            kind="too_large",
        )


def _rgb(image: Image.Image) -> Image.Image:
    """``image`` as 8-bit RGB. 16-bit grey (PNG's ``I;16``, or ``I``) keeps its high byte, as
    libpng's strip_16 does; PIL's own ``convert`` clips it to 255, an all-white image."""
    if image.mode not in _SIXTEEN_BIT_GREY:
        return image.convert("RGB")
    values = np.asarray(image)
    if image.mode == "I":
        values = np.clip(values, 0, 65535)
    high = (values >> 8).astype(np.uint8)
    return Image.fromarray(high).convert("RGB")


def _chw(image: Image.Image) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(_rgb(image), dtype=np.uint8).transpose(2, 0, 1))


def _libjpeg_decodable(image: Image.Image) -> bool:
    """A JPEG that torchvision's (and nvJPEG's) decoder takes to RGB: not CMYK."""
    return image.format in ("JPEG", "MPO") and image.mode in ("RGB", "L", "YCbCr")


def _full(image: Image.Image, data: bytes) -> torch.Tensor:
    """The whole image as (3, H, W) uint8. A JPEG goes through torchvision's decoder
    (``datasets.jpeg``: the same libjpeg-turbo, the same pixels as PIL's, about 10% less CPU on
    a 24 MB 4K JPEG, BENCHMARKS.md); anything it will not take (CMYK, a truncated or broken
    file) through PIL, which reports what is wrong."""
    decode_jpeg = jpeg.decoder() if _libjpeg_decodable(image) else None
    if decode_jpeg is not None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: only read
                return decode_jpeg(torch.frombuffer(data, dtype=torch.uint8))
        except RuntimeError:
            pass
    return torch.from_numpy(_chw(image))


def _square(image: Image.Image, data: bytes, plan: DecodePlan) -> np.ndarray:
    _check_resize(image, plan)
    if plan.fast:
        return _fast_square(image, plan)
    width, height = resized_size(image.size, plan.size, plan.resize)
    if plan.exact or not _reducible(image, width, height):
        return resize_square(_full(image, data), plan.size, plan.resize).numpy()
    margin = FINE_MARGIN if _room(image, width, height, FINE_MARGIN) >= 4 else DRAFT_MARGIN
    drafted = image.draft("RGB", (margin * width, margin * height))
    if drafted is None:  # the decoder would not take a scale: decode it whole
        return resize_square(_full(image, data), plan.size, plan.resize).numpy()
    # The reduced image covers the source's (W / scale) x (H / scale) pixels, which libjpeg
    # rounds up to whole ones: resize by that true scale, not by the rounded size, so the
    # output's pixels sit where the reference's do.
    _, (_, _, reduced_width, reduced_height) = drafted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only array: only read
        pixels = torch.from_numpy(np.asarray(image.convert("RGB"))).permute(2, 0, 1)
    # Channels-last uint8 in, as torch's antialiased kernel prefers (torchvision's Resize
    # calls the same kernel); the same output size and crop as the reference's.
    square = torch.nn.functional.interpolate(
        pixels[None],
        scale_factor=(height / reduced_height, width / reduced_width),
        mode="bilinear",
        antialias=True,
        align_corners=False,
        recompute_scale_factor=False,
    )[0]
    if tuple(square.shape[-2:]) != (height, width):  # never seen; the reference's size wins
        square = resized(pixels, height, width)
    if plan.resize == "shorter_crop":
        square = center_crop(square, plan.size)
    return np.ascontiguousarray(square.numpy())


def resized_size(source: tuple[int, int], size: int, resize: str) -> tuple[int, int]:
    """(width, height) of the image torchvision's ``Resize`` makes before any crop:
    ``(size, size)`` for squash, the shorter side to ``size`` (the longer truncated, as
    torchvision does) for shorter_crop."""
    if resize != "shorter_crop":
        return size, size
    width, height = source
    if width <= height:
        return size, int(size * height / width)
    return int(size * width / height), size


def _reducible(image: Image.Image, width: int, height: int) -> bool:
    """A JPEG at least twice ``DRAFT_MARGIN`` times the output on each side: libjpeg can
    decode it at 1/2 or less and still leave the margin."""
    if image.format not in ("JPEG", "MPO"):
        return False
    return _room(image, width, height, DRAFT_MARGIN) >= 2


def _room(image: Image.Image, width: int, height: int, margin: int) -> int:
    """How many times the source holds ``margin`` x the output on its tighter side."""
    return min(image.width // (margin * width), image.height // (margin * height))


def _fast_square(image: Image.Image, plan: DecodePlan) -> np.ndarray:
    size = plan.size
    if image.format in ("JPEG", "MPO"):
        image.draft("RGB", (size, size))  # decodes at the smallest scale still >= size a side
    image = _rgb(image)
    if plan.resize == "shorter_crop":
        scale = size / min(image.size)
        width, height = (
            max(size, round(image.width * scale)),
            max(size, round(image.height * scale)),
        )
        image = image.resize((width, height), Image.Resampling.BILINEAR)
        left, top = (width - size) // 2, (height - size) // 2
        image = image.crop((left, top, left + size, top + size))
    else:
        image = image.resize((size, size), Image.Resampling.BILINEAR)
    return _chw(image)


def _bounded(image: Image.Image, data: bytes, max_side: int) -> np.ndarray:
    longest = max(image.size)
    if longest <= max_side:
        return _full(image, data).numpy()
    scale = max_side / longest
    target = (max(1, math.floor(image.width * scale)), max(1, math.floor(image.height * scale)))
    if image.format in ("JPEG", "MPO"):
        image.draft("RGB", target)
    image = _rgb(image)
    if max(image.size) > max_side:
        image = image.resize(target, Image.Resampling.BILINEAR)
    return _chw(image)


def resize_square(pixels: torch.Tensor, size: int, resize: str) -> torch.Tensor:
    """(3, H, W) uint8 to (3, size, size) uint8 the way torchvision's transforms do it:
    ``squash`` is ``Resize((size, size))``; ``shorter_crop`` is ``Resize(size)`` then
    ``CenterCrop(size)``; bilinear with antialiasing."""
    if pixels.shape[-2:] == (size, size):
        return pixels
    if resize == "shorter_crop":
        return center_crop(shorter_side_to(pixels, size), size)
    return resized(pixels, size, size)
