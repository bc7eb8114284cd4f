"""The settings slices the assembly hands out say what the settings say."""

from __future__ import annotations

from config.settings import load_settings
from worker.process.slices import core_settings


def test_the_cores_slice_takes_this_processs_device_and_the_held_task_cap():
    s = load_settings(
        for_worker=False,
        loader={"batch_size": 8, "prefetch_batches": 4, "max_inflight_bytes": 10 * 1000},
        model={"device": "cuda:0, cuda:1", "hold_per_load": 2.5},
        health={"drain_timeout_s": 12},
        process_index=3,
    )
    core = core_settings(s, image_bytes=1000)
    assert core.device == "cuda:1"
    assert core.max_held == 10  # the byte cap: ten images, under 8 x 4
    assert (core.batch_size, core.hold_per_load, core.drain_timeout_s) == (8, 2.5, 12)
