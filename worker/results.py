"""The results store: one message per task subject in the results stream, new ones refused."""

from __future__ import annotations

import json
from typing import Any

import nats
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from config.settings import NatsSettings
from datasets.errors import TransientError
from worker.schemas import subject_token

# The server's answer when a per-task subject already holds its result.
_ALREADY_STORED = ("maximum messages per subject exceeded",)
_ALREADY_STORED_CODES = {10077}


class ResultsUnavailable(TransientError):
    """The results stream did not confirm the write; the task must be retried."""


def result_subject(job_id: str, task_id: str) -> str:
    return f"results.{subject_token(job_id)}.{subject_token(task_id)}"


def job_results_subject(job_id: str) -> str:
    return f"results.{subject_token(job_id)}.>"


class ResultStore:
    def __init__(self, js: JetStreamContext, settings: NatsSettings) -> None:
        self._js = js
        self._settings = settings

    async def store(self, result: dict[str, Any]) -> bool:
        """Store ``result``; True when written now, False when one was already stored.

        Raises ResultsUnavailable when the stream cannot confirm either.
        """
        subject = result_subject(result["job_id"], result["task_id"])
        payload = json.dumps(result, separators=(",", ":")).encode()
        try:
            ack = await self._js.publish(
                subject,
                payload,
                timeout=self._settings.publish_timeout_s,
                stream=self._settings.results_stream,
                headers={"Nats-Msg-Id": f"{result['job_id']}/{result['task_id']}"},
            )
        except APIError as error:
            if error.err_code in _ALREADY_STORED_CODES or any(
                text in (error.description or "") for text in _ALREADY_STORED
            ):
                return False
            raise ResultsUnavailable(f"results stream refused the write: {error}") from None
        except (TimeoutError, nats.errors.Error) as error:
            raise ResultsUnavailable(
                f"results stream unavailable: {type(error).__name__} {error}"
            ) from None
        return not ack.duplicate

    async def exists(self, job_id: str, task_id: str) -> bool:
        try:
            await self._js.get_last_msg(
                self._settings.results_stream, result_subject(job_id, task_id), direct=True
            )
        except NotFoundError:
            return False
        except (TimeoutError, nats.errors.Error) as error:
            raise ResultsUnavailable(f"cannot read the results stream: {error}") from None
        return True
