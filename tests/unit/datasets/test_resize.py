"""The loader's resize, crop and JPEG decoder, which do without importing torchvision, give
torchvision's own pixels (the reference the pipelines were trained with)."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from datasets import jpeg
from datasets.resize import center_crop, resized, shorter_side_to

SHAPES = [(3, 480, 640), (3, 641, 479), (3, 37, 1000), (3, 224, 224), (3, 7, 5), (1, 3, 99, 120)]


def _images(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    uint8 = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    channels_last = uint8.reshape(-1, *shape[-3:]).contiguous(memory_format=torch.channels_last)
    return [uint8, channels_last.reshape(shape), uint8.float() / 255]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("size", [224, 96, 1000])
def test_resize_and_crop_give_torchvisions_pixels(shape, size):
    from torchvision.transforms.v2 import functional as F

    for pixels in _images(shape):
        squashed = resized(pixels, size, size)
        assert torch.equal(squashed, F.resize(pixels, [size, size], antialias=True))
        oblong = resized(pixels, size, size * 2 // 3 + 1)
        assert torch.equal(oblong, F.resize(pixels, [size, size * 2 // 3 + 1], antialias=True))
        assert squashed.is_contiguous(memory_format=torch.channels_last) == F.resize(
            pixels, [size, size], antialias=True
        ).is_contiguous(memory_format=torch.channels_last)
        shorter = shorter_side_to(pixels, size)
        assert torch.equal(shorter, F.resize(pixels, [size], antialias=True))
        assert torch.equal(center_crop(shorter, size), F.center_crop(shorter, [size, size]))
        assert torch.equal(center_crop(pixels, size), F.center_crop(pixels, [size, size]))


def test_a_uint8_resize_through_float_rounds_as_torchvision_does(monkeypatch):
    """Where torch has no uint8 kernel (a GPU, an older CPU), through float32 and rounding."""
    from torchvision.transforms.v2 import functional as F
    from torchvision.transforms.v2.functional import _geometry

    import datasets.resize as ours

    monkeypatch.setattr(ours, "_native_uint8_bilinear", lambda: False)
    monkeypatch.setattr(_geometry, "_do_native_uint8_resize_on_cpu", lambda _mode: False)
    (pixels, *_rest) = _images((3, 301, 207))
    assert torch.equal(resized(pixels, 96, 96), F.resize(pixels, [96, 96], antialias=True))


def test_the_jpeg_decoder_is_torchvisions_and_reads_what_pil_reads():
    import torchvision.io as tio

    out = io.BytesIO()
    noise = np.random.default_rng(3).integers(0, 256, (300, 401, 3), dtype=np.uint8)
    Image.fromarray(noise).save(out, format="JPEG", quality=90)
    data = torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)
    decode = jpeg.decoder()
    assert decode is not None, "torchvision's image extension is installed with torchvision"
    ours = decode(data)
    assert torch.equal(ours, tio.decode_jpeg(data, mode=tio.ImageReadMode.RGB))
    pil = np.asarray(Image.open(io.BytesIO(out.getvalue())).convert("RGB")).transpose(2, 0, 1)
    assert np.array_equal(ours.numpy(), pil)


def test_the_loaders_modules_and_a_decode_import_no_torchvision():
    """What the loader's fork server preloads, and a JPEG decoded and resized through every
    path, leave torchvision unimported: its import costs each process 1.5 s of CPU."""
    script = (
        "import sys\n"
        "from datasets.loader import FORKSERVER_PRELOAD\n"
        "import importlib\n"
        "for name in FORKSERVER_PRELOAD: importlib.import_module(name)\n"
        "from datasets.images import DecodePlan, decode\n"
        "from worker.commands.demo_images import image_bytes\n"
        "data = image_bytes(1280, 960, 1)\n"
        "for plan in (DecodePlan(size=96), DecodePlan(size=96, exact=True, resize='shorter_crop'),"
        " DecodePlan(max_side=2000), DecodePlan(max_side=500)):\n"
        "    decode(data, plan)\n"
        "from datasets import jpeg\n"
        "assert jpeg.decoder() is not None, 'the extension loads without torchvision'\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchvision'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
