"""Repairing job consumers whose delivery settings drifted from this process's.

A job consumer listed with an ack wait, delivery cap, backoff or ack and pull limits other
than this process's (made by a process started with others) is given ours. One loop serves
both callers; what each does on each outcome is the table ``POLICY``:

- at start (``Caller.OPEN``): every drifted consumer is updated and logged
  ``job_consumer_updated``; one the server will not update is a ConfigError (exit 2) naming it.
- at each discovery (``Caller.DISCOVERY``): a drifted consumer (made since the start) is
  logged ``job_consumer_settings_differ`` once per consumer, updated and counted; one the
  server will not update is logged ``job_consumer_not_updated`` and left as it is.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import replace

import structlog
from nats.js import JetStreamContext, api
from nats.js.errors import APIError

from config.names import env_name
from config.settings import ConfigError
from worker.nats.job_state import JobConsumerState

log = structlog.get_logger(__name__)
DIFFERED_KEPT = 10_000  # consumers remembered as logged with other settings
DELIVERY_FIELDS = ("ack_wait", "max_deliver", "backoff", "max_ack_pending", "max_waiting")


class Caller(enum.Enum):
    OPEN = "open"  # once, before the first discovery
    DISCOVERY = "discovery"  # at each discovery


class Drift(enum.Enum):
    """What the loop meets on a job consumer whose settings are not ours."""

    FOUND = "found"  # listed with other delivery settings
    UPDATED = "updated"  # the server took ours
    REFUSED = "refused"  # the server would not take ours


class Action(enum.Enum):
    NOTHING = "nothing"
    WARN_ONCE = "warn once per consumer"  # job_consumer_settings_differ
    LOG_UPDATED = "log the update"  # job_consumer_updated
    COUNT = "count it"  # the state's updated count, a metric
    EXIT = "raise ConfigError"  # exit 2, naming the consumer
    WARN_AND_KEEP = "warn and leave it"  # job_consumer_not_updated


POLICY: dict[Drift, dict[Caller, Action]] = {
    Drift.FOUND: {Caller.OPEN: Action.NOTHING, Caller.DISCOVERY: Action.WARN_ONCE},
    Drift.UPDATED: {Caller.OPEN: Action.LOG_UPDATED, Caller.DISCOVERY: Action.COUNT},
    Drift.REFUSED: {Caller.OPEN: Action.EXIT, Caller.DISCOVERY: Action.WARN_AND_KEEP},
}


def _same(a: object, b: object) -> bool:
    if isinstance(a, float | int) and isinstance(b, float | int):
        return abs(a - b) < 1e-3
    return a == b or (not a and not b)


def alike(info: api.ConsumerInfo, wanted: api.ConsumerConfig) -> bool:
    """Whether the consumer ``info`` delivers by the ``wanted`` settings."""
    return all(_same(getattr(info.config, f), getattr(wanted, f)) for f in DELIVERY_FIELDS)


class DriftRepair:
    """Gives the job consumers on the tasks ``stream`` this process's delivery settings (those
    of ``config_of``'s consumers), by ``POLICY``."""

    def __init__(
        self,
        js: JetStreamContext,
        state: JobConsumerState,
        *,
        stream: str,
        config_of: Callable[[str], api.ConsumerConfig],
    ):
        self._js = js
        self._state = state
        self._stream = stream
        self._config_of = config_of
        self._differed: set[str] = set()  # consumers logged with other delivery settings

    async def repair(
        self, ours: Mapping[str, api.ConsumerInfo], caller: Caller
    ) -> dict[str, api.ConsumerInfo]:
        """Each consumer of ``ours`` whose settings drifted is given ours; returns what the
        server answered for those it updated. Each outcome handled as ``POLICY`` says for
        ``caller``."""
        wanted = self._config_of("tasks.x.x")
        updated: dict[str, api.ConsumerInfo] = {}
        for name, info in list(ours.items()):
            if alike(info, wanted):
                continue
            self._act(POLICY[Drift.FOUND][caller], name, info, wanted)
            config = replace(info.config, **{f: getattr(wanted, f) for f in DELIVERY_FIELDS})
            try:
                updated[name] = await self._js.add_consumer(self._stream, config)
            except APIError as error:
                self._act(POLICY[Drift.REFUSED][caller], name, info, wanted, error)
                continue
            self._act(POLICY[Drift.UPDATED][caller], name, info, wanted)
        return updated

    def _act(
        self,
        action: Action,
        name: str,
        info: api.ConsumerInfo,
        wanted: api.ConsumerConfig,
        error: APIError | None = None,
    ) -> None:
        if action is Action.WARN_ONCE:
            self._warn_once(name, info, wanted)
        elif action is Action.LOG_UPDATED:
            log.info(
                "job_consumer_updated",
                consumer=name,
                ack_wait_s=wanted.ack_wait,
                max_deliver=wanted.max_deliver,
            )
        elif action is Action.COUNT:
            self._state.count_updated()
        elif action is Action.EXIT:
            reason = (error.description or error) if error is not None else "no answer"
            raise ConfigError(
                f"{env_name('nats', 'ack_wait_s')}, {env_name('nats', 'max_deliver')}: "
                f"job consumer {name} on "
                f"stream {self._stream} keeps ack_wait "
                f"{info.config.ack_wait} s and max_deliver {info.config.max_deliver}: the "
                f"server refused the update ({reason})"
            ) from None
        elif action is Action.WARN_AND_KEEP:
            log.warning("job_consumer_not_updated", consumer=name, error=str(error))

    def _warn_once(self, name: str, info: api.ConsumerInfo, wanted: api.ConsumerConfig) -> None:
        if name in self._differed:
            return
        self._differed.add(name)
        if len(self._differed) > DIFFERED_KEPT:
            self._differed.pop()
        log.warning(
            "job_consumer_settings_differ",
            consumer=name,
            ack_wait_s=info.config.ack_wait,
            max_deliver=info.config.max_deliver,
            ours_ack_wait_s=wanted.ack_wait,
            ours_max_deliver=wanted.max_deliver,
            effect="updated to this process's settings",
        )
