"""Tasks waiting per pipeline on NATS, for ``inference_worker_tasks_waiting``
(``worker.health.tasks_waiting`` reads it every ``WORKER_METRICS__TASKS_WAITING_READ_S``).

One listing of the tasks stream's consumers (``consumers_info``, one request per 256
consumers), and per pipeline the sum of ``num_pending`` of this fleet's consumers
(``WORKER_NATS__CONSUMER``): the shared one (``tasks.<pipeline>``, and with ``FAIR_JOBS=false``
the job subjects too) and every job consumer (``<consumer>-job-<digest>``, filtering
``tasks.<pipeline>.<job>``). KEDA's NATS scaler reads one consumer, so it never sees the job
consumers, where fair share puts most of the work.

Waiting = not yet delivered (``num_pending``). ``num_ack_pending`` is left out: those tasks are
held by a process (its ``inference_worker_inflight_tasks``) or given back and due again after
their ack wait; counting them would make a fleet busy on its backlog look as if it had the
same backlog again. Not counted either: the tasks of a new job whose consumer does not exist
yet (the job waits for room under ``WORKER_NATS__MAX_JOB_CONSUMERS``, or for the next
discovery, ``WORKER_NATS__JOB_DISCOVERY_S``): ``inference_worker_job_consumers`` at its bound
says so.

The shared consumer's count is one number for every pipeline it filters: with one pipeline its
label is that pipeline, with several it is their names joined by ``,`` (the server counts
pending per consumer, not per filter subject; processes that share the consumer serve the same
pipelines, so the label is the same in each).
"""

from __future__ import annotations

from nats.js import JetStreamContext, api

from worker.health.tasks_waiting import WaitingRead
from worker.nats.job_names import is_job_consumer
from worker.nats.subjects import ConsumerNames, subject_pipeline

_PAGE = 256
_MAX_PAGES = 64


async def listed_consumers(js: JetStreamContext, stream: str) -> list[api.ConsumerInfo]:
    """Every consumer of ``stream`` (paged: ``_PAGE`` a request, ``_MAX_PAGES`` at most)."""
    listed: list[api.ConsumerInfo] = []
    for page in range(_MAX_PAGES):
        infos = await js.consumers_info(stream, offset=page * _PAGE)
        listed += infos
        if len(infos) < _PAGE:
            break
    return listed


def waiting_by_pipeline(
    infos: list[api.ConsumerInfo], names: ConsumerNames, pipelines: list[str]
) -> dict[str, int]:
    """Tasks not yet delivered per pipeline label (every served pipeline there, 0 when none)."""
    shared = ",".join(pipelines)
    counts = dict.fromkeys(pipelines, 0)
    for info in infos:
        pending = int(info.num_pending or 0)
        if info.name == names.consumer:
            counts[shared] = counts.get(shared, 0) + pending
        elif is_job_consumer(names, info.name):
            pipeline = subject_pipeline(info.config.filter_subject or "")
            if pipeline in counts:
                counts[pipeline] += pending
    return counts


def nats_waiting_read(
    js: JetStreamContext, names: ConsumerNames, pipelines: list[str]
) -> WaitingRead:
    """The read ``worker.health.tasks_waiting.TasksWaiting`` makes, for this fleet's consumers."""

    async def read() -> dict[str, int]:
        infos = await listed_consumers(js, names.tasks_stream)
        return waiting_by_pipeline(infos, names, pipelines)

    return read
