"""What the Antenna unit tests share: the served pipeline, a client, a source and its parts on
the fake Antenna, tasks, detections and the core's way to settle them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from pipelines.models import Algorithm
from tests.antenna_fake import FakeAntenna
from worker.antenna.catalog import Catalog
from worker.antenna.client import AntennaClient
from worker.antenna.job_listing import JobRotation
from worker.antenna.parts import AntennaParts
from worker.antenna.post import Poster
from worker.antenna.render import (
    AntennaPipeline,
    antenna_key,
)
from worker.antenna.reservations import Reservations
from worker.antenna.settle import AntennaSettler
from worker.antenna.source import AntennaSource
from worker.core.outcome import Outcome
from worker.core.results import ResultMaker
from worker.core.tasks import Task
from worker.core.verdicts import NO_BACKOFF, decide
from worker.health.liveness import Liveness
from worker.health.metrics import Metrics

TOKEN = "unit-token-5b7d"
SLUG = "moths"
LABELS = ("a", "b", "c")
DETECTOR = Algorithm("det", "Detector", "detection", "cd" * 32, ("object",))
CLASSIFIER = Algorithm("clf", "Classifier", "classification", "ab" * 32, LABELS)
SERVED = AntennaPipeline(SLUG, "", (DETECTOR, CLASSIFIER))
DETECTOR_KEY = antenna_key(DETECTOR)


def client_of(fake: FakeAntenna, token: str = TOKEN) -> AntennaClient:
    return AntennaClient(fake.url, SecretStr(token), 5.0)


def source_of(
    fake: FakeAntenna, token: str = TOKEN, size: int = 10, idle_wait_s: float = 0.0
) -> AntennaSource:
    client = client_of(fake, token)
    jobs = JobRotation(client, (SLUG,), 0.05, 100)
    return AntennaSource(
        client,
        jobs,
        Reservations(fake.ttr_s, 60.0, size, batch_size=size),
        reservation_size=size,
        wait_s=0.05,
        max_deliver=2,
        idle_wait_s=idle_wait_s,
    )


def images(n: int, prefix: str = "i") -> list[tuple[str, str]]:
    return [(f"{prefix}{i}", f"http://127.0.0.1:1/{prefix}{i}.jpg") for i in range(n)]


def detection(
    image: str, key: str, scores: list[float], x1: float = 1.0, by: str = DETECTOR_KEY
) -> dict[str, Any]:
    """A box found by the detector ``by``, classified by ``key``."""
    return {
        "source_image_id": image,
        "bbox": {"x1": x1, "y1": 1.0, "x2": 5.0, "y2": 5.0},
        "inference_time": 0.01,
        "algorithm": {"name": "Detector", "key": by},
        "timestamp": "2026-12-01T00:00:00+00:00",
        "crop_image_url": None,
        "classifications": [
            {
                "classification": "a",
                "scores": scores,
                "logits": None,
                "algorithm": {"name": "Classifier", "key": key},
                "terminal": True,
                "timestamp": "2026-12-01T00:00:00+00:00",
            }
        ],
    }


def task_of(delivered: Any) -> Task:
    """The task the source read from Antenna's answer."""
    task = delivered.read.task
    assert task is not None and task.pipeline == SLUG, delivered.read
    return task


class CoreSettle:
    """The orchestrator's way with a finished task: the core's verdict (``verdicts.decide``),
    carried out by the Antenna settler; what it did."""

    def __init__(self, settler: AntennaSettler) -> None:
        self.settler = settler

    async def settle(self, task: Task, delivered: Any, outcome: Outcome) -> str:
        verdict = decide(
            task,
            outcome,
            delivered=delivered.delivered,
            deliveries_left=delivered.deliveries_left,
            results=ResultMaker(),
            backoff=NO_BACKOFF,
        )
        return (await self.settler.settle(delivered, verdict)).kept.value


async def reserve_all(source: AntennaSource, n: int) -> list[Any]:
    got: list[Any] = []
    for _ in range(20):
        got += await source.fetch(n - len(got))
        if len(got) >= n:
            break
    return got


def rules_of(fake: FakeAntenna, max_post_bytes: int) -> CoreSettle:
    poster = Poster(client_of(fake), max_post_bytes, 5.0)
    catalog = Catalog([SLUG])
    catalog.add(SERVED)
    return CoreSettle(AntennaSettler(poster, catalog, max_post_bytes))


def outcome(scores: tuple[float, ...] = (0.7, 0.2, 0.1), detections: int = 1) -> Outcome:
    found = []
    for i in range(detections):
        entry = detection("ignored", "clf", list(scores), x1=float(i), by="det")
        entry.pop("source_image_id", None)
        found.append(entry)
    return Outcome(detections=found, timings_s={"load_s": 0.01, "infer_s": 0.01})


def parts_of(
    configured: Any, registry: CollectorRegistry | None = None, names: tuple[str, ...] = (SLUG,)
) -> AntennaParts:
    """The Antenna source's parts for ``configured`` serving ``names``, counting into metrics
    of their own."""
    served = SimpleNamespace(names=list(names), loaded=lambda _p: None)
    metrics = Metrics(registry or CollectorRegistry(), Liveness(30.0), "antenna")
    return AntennaParts(configured, served, {}, metrics)  # type: ignore[arg-type]
