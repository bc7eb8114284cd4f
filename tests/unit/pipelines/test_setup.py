"""Choosing the pipeline at start: the bytes one image can take, against the memory cap."""

from __future__ import annotations

import pytest

from config.errors import ConfigError
from pipelines.models import save_detector


def test_the_bytes_cap_counts_the_largest_image_a_detector_pipeline_can_load(tmp_path):
    from config.derived import max_held_tasks
    from config.settings import load_settings
    from pipelines.setup import choose

    weights = save_detector("fasterrcnn_mobilenet_v3_large_fpn", ["moth"], str(tmp_path))
    per_image = 3 * 800 * 800
    settings = load_settings(
        model={"pipeline": "fasterrcnn-mobilenet-detector", "weights": weights},
        loader={"max_side": 800, "batch_size": 4, "max_inflight_bytes": 6 * per_image},
    )
    chosen = choose(settings)
    assert chosen.plan.max_image_bytes() == per_image
    assert max_held_tasks(settings, chosen.plan.max_image_bytes()) == 6
    with pytest.raises(ConfigError, match="MAX_INFLIGHT_BYTES"):
        choose(
            settings.model_copy(
                update={"loader": settings.loader.model_copy(update={"max_side": 2000})}
            )
        )


def _touched_mirror(root, slug):
    """Empty files at the paths of ``slug``'s files: enough for choosing, not for loading."""
    from pipelines.ami import catalogue

    for relative in (
        catalogue.DETECTOR.weights,
        catalogue.model_of(slug).weights,
        str(catalogue.model_of(slug).labels),
    ):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).touch()
    return root


def test_an_ami_pipeline_holds_trap_camera_images_whole_within_the_bytes_cap(tmp_path):
    from config.derived import max_held_tasks
    from config.settings import load_settings
    from datasets.images import decode
    from pipelines.setup import choose
    from worker.commands.demo_images import image_bytes

    pixels = 24_000_000  # a 6000x4000 camera's images, and no larger, at full size
    model = {
        "pipeline": "moth_binary",
        "files_mirror": str(_touched_mirror(tmp_path, "moth_binary")),
        "published_digests": False,
    }
    loader = {"batch_size": 2, "max_pixels": pixels, "max_inflight_bytes": 3 * 3 * pixels}
    settings = load_settings(model=model, loader=loader)
    chosen = choose(settings)
    held = max_held_tasks(settings, chosen.plan.max_image_bytes())
    assert chosen.plan.max_image_bytes() == 3 * pixels and held == 3

    image = decode(image_bytes(6000, 4000, seed=1), chosen.plan)
    assert image.pixels.shape == (3, 4000, 6000)  # whole: 72 MB
    assert held * image.pixels.nbytes <= settings.loader.max_inflight_bytes
    below_one_batch = {**loader, "max_inflight_bytes": 2 * 3 * pixels - 1}
    with pytest.raises(ConfigError, match="MAX_INFLIGHT_BYTES"):
        choose(load_settings(model=model, loader=below_one_batch))
    default = choose(load_settings(model=model))
    assert default.plan.max_image_bytes() == 3 * 64_000_000  # the decoder's own cap
