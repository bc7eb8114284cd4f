"""In-memory fakes of what the orchestrator talks to: messages, the stores, the source, the
engine. They keep what was done to them, for tests to read."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import nats

from config.errors import Failure, ResultRefused, ResultsUnavailable
from config.settings import NatsSettings
from pipelines.found import Detection, Ref
from worker.core.outcome import Outcome
from worker.core.ports import BatchReport
from worker.core.results import Result
from worker.core.tasks import Task
from worker.nats import parts
from worker.nats.delivery import NatsDelivered, delivered
from worker.nats.render import document
from worker.nats.settle import NatsSettler
from worker.nats.subjects import result_subject

_seq = iter(range(1, 1_000_000))


class FakePredictor:
    """What the engine asks of a pipeline besides ``run``: here, nothing copied ahead."""

    copy_ahead_images = 0

    def copy_ahead(self, images):
        return list(images)


@dataclass
class FakeMsg:
    """A JetStream message as nats-py hands it (``worker.nats.delivery`` adapts it)."""

    delivered: int = 1
    seq: int = 7
    data: bytes = b"{}"
    subject: str = "tasks.p"
    actions: list[str] = field(default_factory=list)
    fail_term: bool = False
    kept_alive: int = 0
    nak_delays: list[float | None] = field(default_factory=list)

    @property
    def metadata(self) -> Any:
        return SimpleNamespace(
            num_delivered=self.delivered, sequence=SimpleNamespace(stream=self.seq)
        )

    async def ack(self) -> None:
        self.actions.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.actions.append("nak")
        self.nak_delays.append(delay)

    async def in_progress(self) -> None:
        self.kept_alive += 1

    async def term(self) -> None:
        if self.fail_term:
            raise nats.errors.ConnectionClosedError
        self.actions.append("term")


@dataclass
class FakeStore:
    refuse_over_bytes: int | None = None
    unavailable: bool = False
    stored: list[dict[str, Any]] = field(default_factory=list)

    async def exists(self, job_id: str, task_id: str) -> bool:
        return any(r["job_id"] == job_id and r["task_id"] == task_id for r in self.stored)

    def max_message_bytes(self) -> int:
        return 1024 * 1024 - 4096

    async def store(self, result: dict[str, Any]) -> bool:
        if self.unavailable:
            raise ResultsUnavailable("down")
        if self.refuse_over_bytes is not None and len(str(result)) > self.refuse_over_bytes:
            raise ResultRefused("too big for a message", kind="result_too_large")
        self.stored.append(result)
        return True


@dataclass
class FakeJetStream:
    fail: bool = False
    published: list[tuple[str, bytes, dict[str, str]]] = field(default_factory=list)

    async def publish(self, subject: str, data: bytes, **kwargs: Any) -> None:
        if self.fail:
            raise nats.errors.NoRespondersError
        self.published.append((subject, data, kwargs["headers"]))


def task_msg(
    task_id: str,
    job_id: str = "j",
    url: str = "s3://b/k.jpg",
    delivered: int = 1,
    subject: str = "tasks.p",
):
    data = json.dumps({"id": task_id, "job_id": job_id, "image_id": "i", "image_url": url})
    return FakeMsg(delivered=delivered, seq=next(_seq), data=data.encode(), subject=subject)


def delivery(msg: FakeMsg, max_deliver: int = 2, default_pipeline: str = "p") -> NatsDelivered:
    """``msg`` as the NATS source delivers it to the core: read once."""
    return delivered(msg, max_deliver, default_pipeline)  # type: ignore[arg-type]


def result_document(
    task: Task, detections: list[Detection], timings_s: dict[str, float], pipeline: str = "p"
) -> dict[str, Any]:
    """An ok result for ``task`` as the NATS source stores it."""
    made = Result(replace(task, pipeline=pipeline), detections, None, {}, timings_s, {}, 1)
    return document(made)


def model_of(pipeline: str) -> dict[str, Any]:
    """What the fake results say of a pipeline's models."""
    return {"name": "m", "pipeline": pipeline}


def nats_settler(
    store: Any, js: Any, *, store_retry_s: float = 0.0, default_pipeline: str = "p"
) -> NatsSettler:
    """The NATS source's settler over the fake results and dead-letter streams, built as the
    source builds it (``worker.nats.parts.nats_settler``)."""
    settings = NatsSettings(store_retry_s=store_retry_s, nak_backoff_base_s=0.01)
    return parts.nats_settler(js, settings, store, default_pipeline, model_of)


@dataclass
class FakeSource:
    """A NATS-shaped task source that hands out its messages as the NATS source's deliveries,
    then nothing; those of ``runnable`` pipelines (``tasks.<pipeline>``) first, as a source of
    one consumer per job can."""

    msgs: list[FakeMsg] = field(default_factory=list)
    fetches: int = 0
    max_deliver: int = 2
    default_pipeline: str = "p"  # for a task on ``tasks`` alone

    async def fetch(
        self, batch: int, runnable: Any = None, available: Any = None
    ) -> Sequence[NatsDelivered]:
        import asyncio

        self.fetches += 1
        taken = self.msgs[:batch]
        if runnable is not None:
            ready = (m for m in self.msgs if runnable(m.subject.split(".")[1]))
            taken = list(itertools.islice(ready, batch)) or taken
        gone = {id(m) for m in taken}
        self.msgs = [m for m in self.msgs if id(m) not in gone]
        if not taken:
            await asyncio.sleep(0.01)
        return [delivery(m, self.max_deliver, self.default_pipeline) for m in taken]

    async def close(self) -> Sequence[NatsDelivered]:
        return []

    async def idle(self) -> bool:
        return not self.msgs


@dataclass
class FakeEngine:
    """Loads nothing; each batch's tasks get one prediction, or the failure set for a URL."""

    failures: dict[str, Failure] = field(default_factory=dict)
    gives_up: BaseException | None = None
    urls: dict[int, str] = field(default_factory=dict)
    batches: list[list[int]] = field(default_factory=list)

    pipelines: dict[int, str] = field(default_factory=dict)
    load_failures: dict[str, Failure] = field(default_factory=dict)  # by pipeline
    loaded: list[str] = field(default_factory=list)
    fail_once: dict[str, Failure] = field(default_factory=dict)  # by URL: the first run only
    # What each task's image is found to hold.
    found: list[Detection] = field(
        default_factory=lambda: [Detection(None, 0.0, Ref("Fake", "fake"), "2026-12-01T00:00:00")]
    )

    def submit(self, requests: Sequence[tuple[int, str]], pipeline: str = "") -> None:
        self.urls.update(requests)
        self.pipelines.update((key, pipeline) for key, _ in requests)

    def ready(self, pipeline: str) -> bool:
        return pipeline in self.loaded

    def load(self, pipeline: str) -> Failure | None:
        failure = self.load_failures.get(pipeline)
        if failure is None:
            self.loaded.append(pipeline)
        return failure

    def run_batch(self, keys: Sequence[int], pipeline: str = "") -> BatchReport:
        if self.gives_up is not None:
            raise self.gives_up
        assert {self.pipelines[key] for key in keys} == {pipeline}, "a batch mixed pipelines"
        self.batches.append(list(keys))
        outcomes = {}
        for key in keys:
            url = self.urls[key]
            failure = self.failures.get(url) or self.fail_once.pop(url, None)
            outcomes[key] = (
                Outcome(failure=failure) if failure else Outcome(detections=list(self.found))
            )
        return BatchReport(outcomes, 0.0, 0.0, 0)

    def forget(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.urls.pop(key, None)


def stored_by_subject(store: FakeStore) -> dict[str, dict[str, Any]]:
    return {result_subject(r["job_id"], r["task_id"]): r for r in store.stored}
