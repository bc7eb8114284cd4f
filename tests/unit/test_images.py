from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from config.errors import PermanentError, TransientError
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


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF", "WEBP", "ICO"])
def test_formats_other_than_jpeg_and_png_are_refused_without_being_parsed(fmt):
    out = io.BytesIO()
    Image.new("RGB", (10, 10)).save(out, format=fmt)
    with pytest.raises(PermanentError) as refused:
        decode_resized(out.getvalue(), 64)
    assert refused.value.kind == "unsupported_format"


def test_a_phones_mpo_jpeg_decodes_as_a_jpeg():
    out = io.BytesIO()
    first, second = Image.new("RGB", (320, 240), (200, 30, 30)), Image.new("RGB", (320, 240))
    first.save(out, format="MPO", save_all=True, append_images=[second])
    assert Image.open(io.BytesIO(out.getvalue())).format == "MPO"
    array = decode_resized(out.getvalue(), 32)
    assert array.shape == (3, 32, 32) and round(float(array[0].mean())) == pytest.approx(200, abs=4)


def test_a_decompression_bomb_is_too_large_not_decoded():
    out = io.BytesIO()
    Image.new("1", (12_000, 12_000)).save(out, format="PNG")  # 144 Mpx in a few kB
    assert len(out.getvalue()) < 100_000
    with pytest.raises(PermanentError) as refused:
        decode_resized(out.getvalue(), 64)
    assert refused.value.kind == "too_large"


def test_an_unreachable_http_source_is_transient():
    with pytest.raises(TransientError):
        read_bytes("http://127.0.0.1:9/x.jpg", SourceConfig(allowed_hosts=frozenset({"127.0.0.1"})))
