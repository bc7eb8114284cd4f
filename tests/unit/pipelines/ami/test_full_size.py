"""AMI's pipelines detect an image at its own size, as ``ami worker`` does: a trap camera's
6000x4000 image gets the boxes of AMI's detector run on the whole image, in whole source
pixels, not those of a copy reduced to ``WORKER_LOADER__MAX_SIDE``."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from config.settings import load_settings
from datasets.images import decode
from datasets.uris import SourceConfig
from pipelines.ami import catalogue
from pipelines.runner import load_runner
from pipelines.setup import choose
from tests.ami_files import detector_state, write_mirror
from worker.commands.demo_images import image_bytes

SLUG = "moth_binary"


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mirror(tmp_path_factory.mktemp("ami-mirror"), (SLUG,), detector_state())


def _torchvision_boxes(mirror: Path, data: bytes) -> list[tuple[float, ...]]:
    """AMI's detector as torchvision builds it (frozen batch norms, as a pretrained backbone
    has them), run on the whole image as floats in [0, 1]; boxes scored over 0.8, truncated
    to whole pixels."""
    from torchvision.models.detection import FasterRCNN
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
    from torchvision.ops.misc import FrozenBatchNorm2d

    backbone = resnet_fpn_backbone(
        backbone_name="resnet50", weights=None, norm_layer=FrozenBatchNorm2d, trainable_layers=3
    )
    model: Any = FasterRCNN(backbone, num_classes=2, box_detections_per_img=500)
    checkpoint = torch.load(mirror / catalogue.DETECTOR.weights, weights_only=True)
    model.load_state_dict(checkpoint["model_state_dict"])
    rgb = np.array(Image.open(io.BytesIO(data)).convert("RGB"))
    pixels = torch.from_numpy(rgb).permute(2, 0, 1).float() / 255.0
    with torch.inference_mode():
        (out,) = model.eval()([pixels])
    boxes = out["boxes"][out["scores"] > 0.8].trunc()
    return [tuple(float(v) for v in box) for box in boxes.tolist()]


def test_a_trap_camera_image_is_detected_at_its_own_size_in_whole_pixels(mirror: Path) -> None:
    settings = load_settings(
        model={"pipeline": SLUG, "files_mirror": str(mirror), "published_digests": False}
    )
    chosen = choose(settings)
    data = image_bytes(6000, 4000, seed=5)

    image = decode(data, chosen.plan)
    runner = load_runner(
        chosen.pipeline, SourceConfig(), "cpu", chosen.limits, chosen.response_format
    )
    (detections,) = runner.run([image])

    assert image.pixels.shape == (3, 4000, 6000), "decoded whole, not reduced to MAX_SIDE"
    ours = [(d.bbox.x1, d.bbox.y1, d.bbox.x2, d.bbox.y2) for d in detections]
    assert ours, "the detector found boxes"
    assert all(float(v).is_integer() for box in ours for v in box), ours
    assert sorted(ours) == sorted(_torchvision_boxes(mirror, data))
