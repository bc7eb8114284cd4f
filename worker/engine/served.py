"""The pipelines one process serves: their decode plans, their models on demand (one
``ModelCache`` under the memory budget), and what results say of each (``model``).

A task names its pipeline (``Task.pipeline``); "" is the first served one (a source that
names none). A name the process does not serve cannot be loaded: its tasks get an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from config.errors import Failure, ModelLoadFailed
from datasets.images import DecodePlan
from pipelines.cache import ModelCache
from pipelines.runner import Runner
from pipelines.setup import Chosen, estimated_bytes, model_info


class ServedPipelines:
    def __init__(
        self,
        chosen: list[Chosen],
        load: Callable[[Chosen], Runner],
        budget_bytes: int,
        unloaded: Callable[[str], None] = lambda _name: None,
        prefetch: Callable[[Chosen], None] = lambda _chosen: None,
    ) -> None:
        self.chosen = {c.pipeline.name: c for c in chosen}
        self.names = list(self.chosen)
        self.default = self.names[0]
        self.cache: ModelCache[Runner] = ModelCache(
            lambda name: load(self.chosen[name]),
            Runner.weights_bytes,
            budget_bytes,
            estimated_bytes={c.pipeline.name: estimated_bytes(c.pipeline) for c in chosen},
            unloaded=unloaded,
            together=Runner.weights_bytes_together,
            prefetch=lambda name: prefetch(self.chosen[name]),
        )
        self._infos: dict[str, dict[str, Any]] = {}

    def name(self, pipeline: str) -> str:
        return pipeline or self.default

    def detecting(self) -> bool:
        """Whether any served pipeline has a detector (its forward pass outweighs decoding)."""
        return any(c.pipeline.detector is not None for c in self.chosen.values())

    def plans(self) -> dict[str, DecodePlan]:
        return {"": self.chosen[self.default].plan} | {n: c.plan for n, c in self.chosen.items()}

    # -- the engine's Models ------------------------------------------------------------
    def acquire(self, pipeline: str) -> Runner:
        return self.cache.acquire(self._served(pipeline))

    def release(self, pipeline: str) -> None:
        self.cache.release(self.name(pipeline))

    def ready(self, pipeline: str) -> bool:
        return self.cache.ready(self.name(pipeline))

    def load(self, pipeline: str) -> None:
        self.cache.load(self._served(pipeline))

    def _served(self, pipeline: str) -> str:
        name = self.name(pipeline)
        if name not in self.chosen:
            message = f"pipeline {name!r} is not served by this process ({', '.join(self.names)})"
            raise ModelLoadFailed(Failure("pipeline_not_served", message))
        return name

    # -- what results say ---------------------------------------------------------------
    def loaded(self, pipeline: str) -> Runner | None:
        """The pipeline's runner if loaded; its ``model`` info is kept from then on."""
        runner = self.cache.peek(self.name(pipeline))
        if runner is not None:
            self._infos[self.name(pipeline)] = model_info(runner)
        return runner

    def model_info(self, pipeline: str) -> dict[str, Any]:
        """The result's ``model`` for ``pipeline``: its stages' weights once it has been loaded;
        its name alone before (a task that failed before its model ever loaded)."""
        name = self.name(pipeline)
        return self._infos.get(name) or {"name": name, "weights_sha256": None, "stages": []}
