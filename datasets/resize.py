"""The antialiased bilinear resize and the centre crop of torchvision's v2 transforms, without
importing torchvision.

Importing torchvision costs about 1.5 s of CPU (its ``ops`` pull in ``torch._dynamo``), paid by
every worker process and by its loader's fork server, for two kernels that are torch's own:
torchvision's ``resize`` on a tensor is ``torch.nn.functional.interpolate`` (bilinear,
``align_corners=False``, antialiased), on uint8 directly where torch has a uint8 kernel (a CPU
with AVX2 or AVX512, or ARM), through float32 and rounding elsewhere (a GPU); its
``center_crop`` is a slice at rounded offsets, zero-padded when the crop is larger. These are
the same steps, the same pixels (``tests/unit/datasets/test_resize.py`` compares them with
torchvision's own on CPU).
"""

from __future__ import annotations

import functools
import platform

import torch

# The integer types torchvision rounds after a float resize (others it truncates).
_ROUNDED = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def resized(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(..., C, H, W) to (..., C, height, width): bilinear, antialiased, as torchvision's
    ``Resize((height, width))`` makes it."""
    shape = pixels.shape
    channels, old_height, old_width = shape[-3:]
    if (height, width) == (old_height, old_width):
        return pixels
    if pixels.numel() == 0:
        return pixels.reshape((*shape[:-2], height, width))
    dtype = pixels.dtype
    image = pixels.reshape(-1, channels, old_height, old_width)
    strides = image.stride()
    if (
        image.is_contiguous(memory_format=torch.channels_last)
        and image.shape[0] == 1
        and image.numel() != strides[0]
    ):
        # One channels-last image: restrided so interpolate keeps its output channels-last
        # (torch allocates it contiguous otherwise, and a uint8 bilinear output is repacked).
        restrided = (image.numel(), *strides[1:])
        image = image.as_strided((1, channels, old_height, old_width), restrided)
    cast = dtype not in (torch.float32, torch.float64) and not (
        dtype == torch.uint8 and image.device.type == "cpu" and _native_uint8_bilinear()
    )
    if cast:
        image = image.to(dtype=torch.float32)
    image = torch.nn.functional.interpolate(
        image, size=[height, width], mode="bilinear", align_corners=False, antialias=True
    )
    if cast:
        if dtype in _ROUNDED:
            image = image.round_()
        image = image.to(dtype=dtype)
    return image.reshape((*shape[:-3], channels, height, width))


def shorter_side_to(pixels: torch.Tensor, size: int) -> torch.Tensor:
    """The shorter side to ``size``, the longer in proportion, truncated: torchvision's
    ``Resize(size)``."""
    height, width = pixels.shape[-2:]
    if width <= height:
        return resized(pixels, int(size * height / width), size)
    return resized(pixels, size, int(size * width / height))


def center_crop(pixels: torch.Tensor, size: int) -> torch.Tensor:
    """The central ``size`` x ``size``, zero-padded where the image is smaller: torchvision's
    ``CenterCrop(size)``."""
    height, width = pixels.shape[-2:]
    if pixels.numel() == 0:
        return pixels.reshape((*pixels.shape[:-2], size, size))
    if size > height or size > width:
        pad_w, pad_h = max(0, size - width), max(0, size - height)
        pixels = torch.nn.functional.pad(
            pixels, [pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2], value=0.0
        )
        height, width = pixels.shape[-2:]
        if (height, width) == (size, size):
            return pixels
    top, left = round((height - size) / 2.0), round((width - size) / 2.0)
    return pixels[..., top : top + size, left : left + size]


@functools.cache
def _native_uint8_bilinear() -> bool:
    """Whether torch resizes uint8 itself here (torchvision's rule for bilinear on a CPU);
    the machine's answer, asked once, not once per crop."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in (
        "aarch64",
        "arm64",
    )
