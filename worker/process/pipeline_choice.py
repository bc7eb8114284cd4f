"""Which pipelines this process serves, checked, and none its source refuses: refused at start
(ConfigError, exit 2) before anything starts. Their memory budget is worked out in
``pipelines.setup.budget_bytes`` and kept by ``pipelines.cache``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import structlog

from config.errors import ConfigError
from config.settings import Settings
from pipelines.declare import Pipeline
from pipelines.setup import Chosen, choose_all
from worker.process.device_claim import device_type

log = structlog.get_logger(__name__)


def choose(
    s: Settings, device: str, refusals: Callable[[list[Pipeline]], list[str]]
) -> list[Chosen]:
    """Every served pipeline, checked, and none the source refuses (``refusals``: one line
    each); JPEGs left encoded only where CUDA decodes them."""
    chosen = choose_all(s)
    refused = refusals([c.pipeline for c in chosen])
    if refused:
        raise ConfigError("\n".join(refused))
    if any(c.plan.encoded for c in chosen) and device_type(device) != "cuda":
        log.warning("device_decode_without_cuda", hint="JPEGs are decoded by the loader")
        chosen = [replace(c, plan=replace(c.plan, encoded=False)) for c in chosen]
    return chosen
