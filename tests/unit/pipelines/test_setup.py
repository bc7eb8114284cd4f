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
