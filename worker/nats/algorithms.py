"""Each served algorithm's config (its full class list), published to the object store
``WORKER_NATS__ALGORITHMS`` as its models load, and read back by ``results``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nats.js import JetStreamContext

_OBJECT_TIMEOUT_S = 60.0  # one object-store put (a class list can be megabytes)


def algorithm_objects(key: str, weights_sha256: str) -> tuple[str, str]:
    """Where an algorithm's config is published: under its key (the latest), and under its
    key and weights (exact, for results made with older weights under the same key)."""
    return f"algorithms/{key}", f"algorithms/{key}/{weights_sha256}"


async def publish_algorithms(
    js: JetStreamContext, bucket: str, configs: list[dict[str, Any]]
) -> None:
    """Each algorithm's Antenna ``AlgorithmConfigResponse`` (its full class list), written at
    every start to the object store ``bucket``, ``WORKER_NATS__ALGORITHMS`` (kept without expiry):
    classifications with a long class list omit ``labels`` and point here by their key."""
    objects = await js.object_store(bucket)
    for config in configs:
        body = json.dumps(config, separators=(",", ":")).encode()
        for name in algorithm_objects(str(config["key"]), str(config["weights_sha256"])):
            await asyncio.wait_for(objects.put(name, body), _OBJECT_TIMEOUT_S)


async def algorithm_config(
    js: JetStreamContext, bucket: str, key: str, weights_sha256: str = ""
) -> dict[str, Any]:
    """An algorithm's published config (its class list in ``category_map.labels``) in the
    object store ``bucket``: for these weights when given, else the latest under ``key``."""
    latest, exact = algorithm_objects(key, weights_sha256)
    objects = await js.object_store(bucket)
    found = await objects.get(exact if weights_sha256 else latest)
    config: dict[str, Any] = json.loads(found.data or b"{}")
    return config
