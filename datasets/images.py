"""Decode JPEG/PNG bytes and resize to the pipeline's input size as a uint8 CHW array."""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image

from config.errors import PermanentError

# Only these decoders ever see task bytes (Image.open would otherwise try every plugin).
# A phone's MPO (multi-picture JPEG) opens through the JPEG decoder and is read as a JPEG.
DECODERS = ("JPEG", "PNG")
SUPPORTED_FORMATS = frozenset({"JPEG", "MPO", "PNG"})
MAX_PIXELS = 64_000_000


def decode_resized(data: bytes, size: int) -> np.ndarray:
    """``data`` as a (3, size, size) uint8 array; PermanentError for anything not a sound image.

    JPEGs are decoded at a reduced scale (``draft``) when the source is much larger than the
    target, so a 4096x2160 image never exists at full resolution in memory.
    """
    if not data:
        raise PermanentError("empty image file", kind="corrupt_image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=DECODERS)
            if image.format not in SUPPORTED_FORMATS:
                raise PermanentError(
                    f"unsupported image format {image.format}; JPEG and PNG are accepted",
                    kind="unsupported_format",
                )
            if image.width * image.height > MAX_PIXELS:
                raise PermanentError(
                    f"image is {image.width}x{image.height}, over {MAX_PIXELS} pixels",
                    kind="too_large",
                )
            if image.format in ("JPEG", "MPO"):
                image.draft("RGB", (size, size))
            resized = image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
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
    return np.ascontiguousarray(np.asarray(resized, dtype=np.uint8).transpose(2, 0, 1))
