"""Tasks heard of as they are published, so a new job is served at once, not at the next job
discovery.

A JetStream publish is a core NATS message on its subject, so a plain subscription to each
served pipeline's ``tasks.<pipeline>`` and ``tasks.<pipeline>.*`` sees every task as the
stream stores it. Only the subject is read (``JobConsumers.hinted``): a job subject not served
yet makes the next discovery due now. It is a hint and nothing more: the periodic discovery
(``WORKER_NATS__JOB_DISCOVERY_S``) still finds every job, so a hint lost (a slow consumer, a
subscribe permission denied, a reconnect) costs that interval's latency, never a task.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import nats
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from worker.nats.subjects import job_tasks_subject, tasks_subject

log = structlog.get_logger(__name__)
# Messages (and bytes) queued for the hint callback before the client drops them (a hint
# dropped is a discovery interval's latency): far above a burst between two loop turns.
PENDING_MSGS = 65_536
PENDING_BYTES = 64 * 1024 * 1024


class NewJobHints:
    def __init__(self, nc: NATS, pipelines: list[str], hinted: Callable[[str], None]) -> None:
        self._nc = nc
        self._subjects = [
            subject
            for pipeline in pipelines
            for subject in (tasks_subject(pipeline), job_tasks_subject(pipeline, "*"))
        ]
        self._hinted = hinted
        self._subs: list[Any] = []

    async def open(self) -> None:
        async def on_task(msg: Msg) -> None:
            self._hinted(msg.subject)

        try:
            for subject in self._subjects:
                self._subs.append(
                    await self._nc.subscribe(
                        subject,
                        cb=on_task,
                        pending_msgs_limit=PENDING_MSGS,
                        pending_bytes_limit=PENDING_BYTES,
                    )
                )
        except nats.errors.Error as error:
            log.warning(
                "published_tasks_unheard",
                error=f"{type(error).__name__}: {error}",
                effect="new jobs are found by the periodic discovery only",
            )

    def whole(self) -> bool:
        """Every subject subscribed: a new job is heard of, so an idle process may list the
        job consumers less often (``worker.nats.listing_cadence``)."""
        return bool(self._subs) and len(self._subs) == len(self._subjects)

    async def close(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._subs = []
