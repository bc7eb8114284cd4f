"""The pipelines one worker serves, as Antenna knows them, by slug.

A pipeline's Antenna keys need its weights' sha256 and its category maps need its labels, so
an entry is added when the pipeline's models load (at start, or on its first task) and kept
after they are unloaded: the keys of given weights do not change. A result is only made by
loaded models, so every ``ok`` result finds its pipeline here.
"""

from __future__ import annotations

from collections.abc import Iterable

from worker.antenna.render import AntennaPipeline


class Catalog:
    def __init__(self, slugs: Iterable[str]) -> None:
        self.slugs = tuple(slugs)
        if not self.slugs:
            raise ValueError("a catalog of no pipelines")
        self._served: dict[str, AntennaPipeline] = {}

    @property
    def default(self) -> str:
        """The pipeline of a task that names none."""
        return self.slugs[0]

    def add(self, served: AntennaPipeline) -> None:
        if served.slug not in self.slugs:
            raise ValueError(f"pipeline {served.slug!r} is not one of {', '.join(self.slugs)}")
        self._served[served.slug] = served

    def get(self, slug: str) -> AntennaPipeline | None:
        return self._served.get(slug)

    def __contains__(self, slug: object) -> bool:
        return slug in self.slugs
