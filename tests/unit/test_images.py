from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from datasets.errors import PermanentError, TransientError
from datasets.images import decode_resized
from datasets.sources import SourceConfig, read_bytes
from datasets.synthetic import corrupt_bytes, image_bytes, truncated_bytes


@pytest.mark.parametrize(
    ("size", "fmt"), [((4096, 2160), "JPEG"), ((640, 480), "PNG"), ((200, 900), "JPEG")]
)
def test_images_of_any_resolution_become_uint8_at_the_pipeline_size(size, fmt):
    array = decode_resized(image_bytes(*size, seed=1, fmt=fmt), 224)
    assert array.dtype == np.uint8
    assert array.shape == (3, 224, 224)


def test_channels_come_first_in_rgb_order():
    out = io.BytesIO()
    Image.new("RGB", (300, 200), (250, 120, 10)).save(out, format="JPEG", quality=95)
    array = decode_resized(out.getvalue(), 64)
    means = [round(float(array[channel].mean())) for channel in range(3)]
    assert means == pytest.approx([250, 120, 10], abs=3)


def test_grayscale_and_alpha_images_become_rgb():
    for mode in ("L", "RGBA"):
        out = io.BytesIO()
        Image.new(mode, (50, 40)).save(out, format="PNG")
        assert decode_resized(out.getvalue(), 32).shape == (3, 32, 32)


@pytest.mark.parametrize(
    "data", [corrupt_bytes(), truncated_bytes(), b"", b"GIF89a" + b"\x00" * 50]
)
def test_bad_bytes_are_permanent_errors(data):
    with pytest.raises(PermanentError) as error:
        decode_resized(data, 64)
    assert error.value.kind in ("corrupt_image", "unsupported_format")


def test_formats_other_than_jpeg_and_png_are_refused():
    out = io.BytesIO()
    Image.new("RGB", (10, 10)).save(out, format="GIF")
    with pytest.raises(PermanentError, match="unsupported image format GIF"):
        decode_resized(out.getvalue(), 64)


def test_file_sources(tmp_path):
    path = tmp_path / "a.jpg"
    path.write_bytes(b"abc")
    assert read_bytes(f"file://{path}", SourceConfig()) == b"abc"
    with pytest.raises(PermanentError) as missing:
        read_bytes(f"file://{tmp_path}/none.jpg", SourceConfig())
    assert missing.value.kind == "object_missing"
    with pytest.raises(PermanentError, match="unsupported URI scheme"):
        read_bytes("gopher://x/y", SourceConfig())


def test_an_unreachable_http_source_is_transient():
    with pytest.raises(TransientError):
        read_bytes("http://127.0.0.1:9/x.jpg", SourceConfig(http_timeout_s=1))
