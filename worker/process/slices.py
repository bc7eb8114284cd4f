"""The settings slices the parts take, each built once here from the validated ``Settings``:
a part reads what it uses, never the whole model (the assembly, ``app.py``, hands them out)."""

from __future__ import annotations

from config.derived import chosen_device, max_held_tasks
from config.settings import Settings
from worker.core.ports import CoreSettings


def core_settings(s: Settings, image_bytes: int) -> CoreSettings:
    """The core's slice; ``image_bytes``: the most host bytes one loaded image of the served
    pipelines can take (it bounds the tasks held)."""
    return CoreSettings(
        batch_size=s.loader.batch_size,
        max_held=max_held_tasks(s, image_bytes),
        hold_per_load=s.model.hold_per_load,
        drain_timeout_s=s.health.drain_timeout_s,
        device=chosen_device(s),
        load_deadline_s=s.model.load_deadline_s,
    )
