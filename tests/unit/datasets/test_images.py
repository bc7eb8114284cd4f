from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from config.errors import PermanentError, TransientError
from datasets.images import decode_resized
from datasets.uris import SourceConfig, read_bytes
from worker.commands.demo_images import corrupt_bytes, image_bytes, truncated_bytes


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


def test_a_large_jpeg_is_decoded_at_a_reduced_scale_and_keeps_its_source_size():
    from datasets.images import DecodePlan, decode

    image = decode(image_bytes(4096, 2160, seed=2), DecodePlan(max_side=1024))
    assert image.pixels.shape == (3, 540, 1024)
    assert (image.source_width, image.source_height) == (4096, 2160)


def test_a_png_over_the_maximum_side_is_resized_and_a_small_one_kept_as_it_is():
    from datasets.images import DecodePlan, decode

    big = decode(image_bytes(1000, 400, seed=3, fmt="PNG"), DecodePlan(max_side=500))
    small = decode(image_bytes(300, 200, seed=3, fmt="PNG"), DecodePlan(max_side=500))
    assert big.pixels.shape == (3, 200, 500) and (big.source_width, big.source_height) == (
        1000,
        400,
    )
    assert small.pixels.shape == (3, 200, 300)


@pytest.mark.parametrize("fast", [True, False])
def test_shorter_side_then_centre_crop_keeps_the_middle_of_a_wide_image(fast):
    from datasets.images import DecodePlan, decode
    from worker.commands.demo_images import rectangles_bytes

    # 300x100: red on the left third, green in the middle, blue on the right.
    data = rectangles_bytes(
        300,
        100,
        [(0, 0, 100, 100, "red"), (100, 0, 200, 100, "green"), (200, 0, 300, 100, "blue")],
        fmt="PNG",
    )
    cropped = decode(data, DecodePlan(size=50, resize="shorter_crop", fast=fast)).pixels
    squashed = decode(data, DecodePlan(size=50, resize="squash", fast=fast)).pixels
    assert cropped.shape == squashed.shape == (3, 50, 50)
    assert cropped[1].mean() > 200 and cropped[0].mean() < 30  # all green
    assert squashed[0, :, :10].mean() > 200 and squashed[2, :, -10:].mean() > 200  # all three


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _sliver(length: int) -> bytes:
    """A 1 x ``length`` grey PNG: a few kilobytes, ``length`` pixels."""
    return _png(Image.new("L", (1, length), 128))


@pytest.mark.parametrize(
    "plan",
    [
        {"size": 224, "resize": "squash"},
        {"size": 224, "resize": "shorter_crop"},
        {"size": 224, "resize": "squash", "fast": True},
        {"size": 224, "resize": "shorter_crop", "fast": True},
        {"size": 0, "max_side": 4096},
    ],
)
def test_a_sliver_of_an_image_is_refused_before_decode_and_resize(plan):
    from datasets.images import DecodePlan, decode

    data = _sliver(400_000)  # 1 x 400,000: far under the pixel cap, a resize would not be
    assert len(data) < 64 * 1024
    with pytest.raises(PermanentError) as error:
        decode(data, DecodePlan(**plan))
    assert error.value.kind == "too_large"
    assert "1x400000" in str(error.value)


@pytest.mark.parametrize("resize", ["squash", "shorter_crop"])
def test_a_wide_panorama_within_the_aspect_cap_still_decodes(resize):
    from datasets.images import MAX_ASPECT_RATIO, DecodePlan, decode

    data = _png(Image.new("RGB", (40 * MAX_ASPECT_RATIO // 2, 20), (10, 200, 30)))
    pixels = decode(data, DecodePlan(size=64, resize=resize)).pixels
    assert pixels.shape == (3, 64, 64)
    assert round(float(pixels[1].mean())) == pytest.approx(200, abs=2)


def test_a_resize_whose_intermediate_passes_the_cap_is_refused_before_it_runs():
    from datasets.images import MAX_RESIZE_PIXELS, DecodePlan, decode

    # Within the aspect cap, but a 4096-square resize of its 20,000 px side is 82M pixels.
    data = _png(Image.new("L", (20_000, 400), 7))
    assert MAX_RESIZE_PIXELS < 4096 * 20_000
    with pytest.raises(PermanentError) as error:
        decode(data, DecodePlan(size=4096))
    assert error.value.kind == "too_large"


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("plan_size", [32, 0])
def test_a_16_bit_grey_png_keeps_its_tones(fast, plan_size):
    from datasets.images import DecodePlan, decode

    # Left half dark (a quarter of full scale), right half light (three quarters).
    values = np.zeros((32, 64), dtype=np.uint16)
    values[:, :32], values[:, 32:] = 16384, 49152
    data = _png(Image.fromarray(values))
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    pixels = decode(data, DecodePlan(size=plan_size, fast=fast)).pixels
    width = pixels.shape[2]
    dark, light = pixels[:, :, : width // 4].mean(), pixels[:, :, -width // 4 :].mean()
    assert dark == pytest.approx(64, abs=3) and light == pytest.approx(192, abs=3)


def _scene_jpeg(width: int, height: int, seed: int) -> bytes:
    """A camera-trap-like scene: smooth background, sensor noise, a few bright blobs."""
    rng = np.random.default_rng(seed)
    small = rng.uniform(0, 255, size=(height // 64 + 1, width // 64 + 1, 3)).astype(np.uint8)
    pixels = np.asarray(
        Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32
    )
    pixels += rng.normal(0, 10, size=(height, width, 1)).astype(np.float32)
    for _ in range(8):
        x, y = int(rng.uniform(0, width - 200)), int(rng.uniform(0, height - 200))
        pixels[y : y + 150, x : x + 200] = rng.uniform(0, 255, size=3)
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


@pytest.mark.parametrize(
    ("source", "size", "resize"),
    [
        ((4096, 2160), 224, "squash"),
        ((4096, 2160), 300, "shorter_crop"),
        ((1920, 1080), 128, "squash"),
        ((1333, 2001), 160, "shorter_crop"),  # portrait, sides not multiples of 8
    ],
)
def test_the_default_path_is_within_tolerance_of_the_reference(source, size, resize):
    """The default (reduced-scale decode leaving twice the input size, then torchvision's
    antialiased resize) against the reference (full decode, then the same resize): same
    shape, mean absolute difference at most 0.5 of 255 (docs/data-loading.md, Preprocessing)."""
    from datasets.images import DecodePlan, decode

    data = _scene_jpeg(*source, seed=3)
    default = decode(data, DecodePlan(size=size, resize=resize)).pixels
    exact = decode(data, DecodePlan(size=size, resize=resize, exact=True)).pixels
    assert default.shape == exact.shape == (3, size, size)
    assert default.dtype == np.uint8 and default.flags["C_CONTIGUOUS"]
    difference = np.abs(default.astype(np.int16) - exact.astype(np.int16))
    assert difference.mean() <= 0.5
    assert difference.max() <= 32


def test_an_image_too_small_to_reduce_gets_the_reference_pixels():
    """Under 2 x 2 x the input size on a side nothing is gained by a reduced scale: the
    default path gives exactly the reference's output; so does a PNG of any size."""
    from datasets.images import DecodePlan, decode

    for data in (_scene_jpeg(800, 600, seed=1), image_bytes(1600, 1200, seed=2, fmt="PNG")):
        default = decode(data, DecodePlan(size=224)).pixels
        exact = decode(data, DecodePlan(size=224, exact=True)).pixels
        assert np.array_equal(default, exact)


def test_a_plan_is_fast_or_exact_not_both():
    from datasets.images import DecodePlan

    with pytest.raises(ValueError, match="fast or exact"):
        DecodePlan(size=224, fast=True, exact=True)


def test_the_exact_setting_reaches_the_loaders_plan():
    from pipelines.declare import Classifier, Pipeline
    from pipelines.runner import decode_plan

    pipeline = Pipeline("p", classifier=Classifier("c"))
    assert decode_plan(pipeline, 4096, fast=False, exact=True).exact
    default = decode_plan(pipeline, 4096, fast=False)
    assert not default.exact and not default.fast


def test_a_full_size_plan_keeps_the_image_whole_up_to_its_pixel_bound_and_refuses_past_it():
    from datasets.images import DecodePlan, decode

    plan = DecodePlan(max_side=500, max_pixels=1_000_000)
    encoded = DecodePlan(max_side=500, max_pixels=1_000_000, encoded=True)
    data = image_bytes(1200, 800, seed=4)  # 960,000 pixels: over max_side, under the bound
    whole = decode(data, plan)
    assert whole.pixels.shape == (3, 800, 1200)
    assert decode(data, encoded).encoded == data  # left for the device, not reduced
    assert plan.max_image_bytes() == 3 * 1_000_000
    for over in (plan, encoded):
        with pytest.raises(PermanentError) as refused:
            decode(image_bytes(1200, 840, seed=4), over)  # 1,008,000 pixels
        assert refused.value.kind == "too_large"
        message = str(refused.value)
        assert "1200x840" in message and "WORKER_LOADER__MAX_PIXELS" in message
