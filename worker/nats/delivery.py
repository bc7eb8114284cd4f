"""A message from a consumer on the tasks stream, as the core's ``Delivery``: the pipeline
and job its subject names (``tasks.<pipeline>[.<job token>]``), and the server's delivery
count against the consumer's ``max_deliver``. Nothing outside ``worker/nats/`` reads a
subject or JetStream metadata."""

from __future__ import annotations

from typing import Any

from nats.aio.msg import Msg

from worker.nats.subjects import subject_job, subject_pipeline


class NatsDelivery:
    """One task message (``Delivery``); ``msg`` is the JetStream message it adapts."""

    __slots__ = ("delivered", "max_deliver", "msg", "stream_seq")

    def __init__(self, msg: Msg, max_deliver: int) -> None:
        self.msg = msg
        self.max_deliver = max_deliver
        metadata = msg.metadata  # parsed from the reply subject: once
        self.delivered: int = metadata.num_delivered
        self.stream_seq: int = metadata.sequence.stream

    @property
    def data(self) -> bytes:
        return self.msg.data

    @property
    def subject(self) -> str:
        return self.msg.subject

    @property
    def pipeline(self) -> str:
        return subject_pipeline(self.msg.subject)

    @property
    def job_id(self) -> str | None:
        return subject_job(self.msg.subject)

    @property
    def deliveries_left(self) -> int:
        return max(0, self.max_deliver - self.delivered)

    def log_fields(self) -> dict[str, Any]:
        return {"stream_seq": self.stream_seq, "subject": self.msg.subject}

    async def ack(self) -> None:
        await self.msg.ack()

    async def nak(self, delay_s: float | None = None) -> None:
        await self.msg.nak(delay=delay_s)

    async def term(self) -> None:
        await self.msg.term()

    async def in_progress(self) -> None:
        await self.msg.in_progress()


def own(delivery: object) -> NatsDelivery:
    """``delivery`` as this room's: the NATS rules settle only NATS deliveries."""
    if not isinstance(delivery, NatsDelivery):
        raise TypeError(f"not a NATS delivery: {type(delivery).__name__}")
    return delivery
