"""A message from a consumer on the tasks stream, read once into the core's ``Delivered``: the
pipeline and job its subject names (``tasks.<pipeline>[.<job token>]``), and the server's
delivery count against the consumer's ``max_deliver``. The ``NatsHandle`` keeps the message for
this room's settler (``worker.nats.settle``). Nothing outside ``worker/nats/`` reads a subject
or JetStream metadata."""

from __future__ import annotations

from dataclasses import dataclass

from nats.aio.msg import Msg

from worker.core.ports import Delivered
from worker.core.tasks import read_task
from worker.nats.subjects import subject_job, subject_pipeline


@dataclass(frozen=True)
class NatsHandle:
    """The JetStream message a task came in, and where it sits in the stream."""

    msg: Msg
    stream_seq: int


NatsDelivered = Delivered[NatsHandle]


def delivered(msg: Msg, max_deliver: int, default_pipeline: str) -> NatsDelivered:
    """``msg`` read once: its task for the pipeline and job its subject names (the default
    pipeline when it names none), with the server's delivery count. Raises when the message
    has no JetStream metadata (no JetStream reply subject)."""
    metadata = msg.metadata  # parsed from the reply subject: once
    count: int = metadata.num_delivered
    seq: int = metadata.sequence.stream
    subject = msg.subject
    read = read_task(msg.data, subject_pipeline(subject), subject_job(subject), default_pipeline)
    return Delivered(
        read=read,
        delivered=count,
        deliveries_left=max(0, max_deliver - count),
        handle=NatsHandle(msg, seq),
        log_fields={"stream_seq": seq, "subject": subject},
    )
