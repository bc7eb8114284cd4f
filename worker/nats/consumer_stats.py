"""What the job consumers' lifecycle did (counted by ``worker.nats.job_state``, read as a copy),
for the metrics and /healthz, and the one reading of a consumer its parts share: how far it
has delivered."""

from __future__ import annotations

from dataclasses import dataclass

from nats.js import api


@dataclass
class ConsumerStats:
    """What the lifecycle did, for the metrics and /healthz."""

    made: int = 0
    deleted: int = 0
    refused: int = 0
    existing: int = 0  # job consumers of ours, as last listed
    bound: int = 0  # the most that may exist at once
    refusal: str | None = None  # the server's last refusal, while jobs still wait for room
    updated: int = 0  # listed with other delivery settings, and given ours


def delivered_seq(info: api.ConsumerInfo) -> int:
    """The last stream sequence the consumer ``info`` has delivered (0: none)."""
    return int(info.delivered.stream_seq or 0) if info.delivered else 0
