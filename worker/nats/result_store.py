"""The results store: one message per task subject in the results stream, new ones refused.

A result too large for one message (500 detections with 1,000 scores each is about 10 MB)
is still stored whole: its ``response`` goes into the JetStream object store
``WORKER_NATS__RESULT_OBJECTS`` under the result's subject, written before the result, and the
result says where (``response_object``); ``results --job`` puts it back in place. The response
is encoded once (``_encoded_around``): the object holds the bytes the message would have.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

import nats
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from config.errors import ResultRefused, ResultsUnavailable
from worker.nats.jetstream_health import JetStreamAnswers
from worker.nats.subjects import result_subject

# The server's answer when a per-task subject already holds its result.
_ALREADY_STORED = ("maximum messages per subject exceeded",)
_ALREADY_STORED_CODES = {10077}
_TOO_LARGE_CODES = {10054}  # message size exceeds the stream's maximum


# Room left in a message for the headers and the protocol line around the payload.
_HEADER_ROOM_BYTES = 4096
_OBJECT_TIMEOUT_S = 60.0  # one object-store put or get (megabytes in chunks)
_DIRECT_GET_S = 1.0  # a replica answers a direct get in milliseconds (see ``exists``)
_SAFE_SUBJECT = re.compile(r"results(\.[A-Za-z0-9_-]{1,400}){2}")


def unavailable(what: str, error: BaseException) -> ResultsUnavailable:
    return ResultsUnavailable(
        f"{what}: {type(error).__name__} {error}",
        connection_closed=isinstance(error, nats.errors.ConnectionClosedError),
    )


class ResultStore:
    """The results ``stream`` (``WORKER_NATS__RESULTS_STREAM``), with the object store
    ``objects`` (``WORKER_NATS__RESULT_OBJECTS``) for responses too large for a message; each
    publish waits ``publish_timeout_s`` (``WORKER_NATS__PUBLISH_TIMEOUT_S``) for its ack."""

    def max_message_bytes(self) -> int:
        """The largest payload we send: the server's max_payload less room for headers."""
        return self._max_payload_bytes() - _HEADER_ROOM_BYTES

    def __init__(
        self,
        js: JetStreamContext,
        max_payload_bytes: Callable[[], int] = lambda: 1024 * 1024,
        answers: JetStreamAnswers | None = None,
        *,
        stream: str,
        objects: str,
        publish_timeout_s: float,
    ) -> None:
        self._js = js
        self._stream = stream
        self._objects = objects
        self._publish_timeout_s = publish_timeout_s
        self._max_payload_bytes = max_payload_bytes
        self._answers = answers or JetStreamAnswers()  # each write's outcome, for /readyz

    async def store(self, result: dict[str, Any]) -> bool:
        """Store ``result``; True when written now, False when one was already stored.

        Raises ResultsUnavailable when the stream cannot confirm either, ResultRefused when
        no retry could: a message the server would refuse (and close our connection for).
        """
        subject = result_subject(result["job_id"], result["task_id"])
        payload, response = _encoded_around(result)
        if not _SAFE_SUBJECT.fullmatch(subject):
            raise ResultRefused(
                f"no valid result subject for this task ({len(subject)} chars)",
                kind="invalid_result_subject",
            )
        limit = self.max_message_bytes()
        if len(payload) > limit and response is not None:
            payload = _encoded(await self._response_aside(subject, result, response))
        if len(payload) > limit:
            raise ResultRefused(
                f"the result is {len(payload)} bytes, over the {limit} a message can hold",
                kind="result_too_large",
            )
        return await self._written(subject, payload)

    async def _written(self, subject: str, payload: bytes) -> bool:
        """Publish one result, its subject as its dedupe id; False when one was stored."""
        try:
            ack = await self._js.publish(
                subject,
                payload,
                timeout=self._publish_timeout_s,
                stream=self._stream,
                # The subject is the dedupe id: injective, unlike "job/task" joined by hand.
                headers={"Nats-Msg-Id": subject},
            )
        except APIError as error:
            self._answers.failed("store", error)  # a refusal is an answer; a 5xx is not
            if error.err_code in _ALREADY_STORED_CODES or any(
                text in (error.description or "") for text in _ALREADY_STORED
            ):
                return False
            if error.err_code in _TOO_LARGE_CODES:
                raise ResultRefused(
                    f"the results stream refused the size: {error}", kind="result_too_large"
                ) from None
            raise ResultsUnavailable(f"results stream refused the write: {error}") from None
        except nats.errors.MaxPayloadError:
            raise ResultRefused(
                "the result is over the server's max_payload", kind="result_too_large"
            ) from None
        except (TimeoutError, nats.errors.Error) as error:
            self._answers.failed("store", error)
            raise unavailable("results stream unavailable", error) from None
        self._answers.answered()
        return not ack.duplicate

    async def _response_aside(
        self, subject: str, result: dict[str, Any], body: bytes
    ) -> dict[str, Any]:
        """``result`` with its response written to the object store and a pointer in its place.

        The object's name carries the body's sha256 and is never overwritten: a second run of
        the task (redelivered, its result already stored) writes a second object and leaves
        the one the stored result points to as it was. ``body``: the response, encoded.
        """
        sha256 = hashlib.sha256(body).hexdigest()
        bucket = self._objects
        name = f"{subject}/{sha256}"
        try:
            objects = await self._js.object_store(bucket)
            await asyncio.wait_for(objects.put(name, body), _OBJECT_TIMEOUT_S)
        except (TimeoutError, nats.errors.Error) as error:
            raise unavailable(f"object store {bucket} unavailable", error) from None
        pointer = {"bucket": bucket, "name": name, "bytes": len(body), "sha256": sha256}
        return {**result, "response": None, "response_object": pointer}

    async def exists(self, job_id: str, task_id: str) -> bool:
        """Whether the task's result is stored: asked of any replica (a direct get), and of
        the stream's leader when that one does not answer within ``_DIRECT_GET_S``.

        Any replica takes a direct get, and one that went silent (a frozen node, which the
        other nodes keep routing to until they drop it, a minute or more) never answers:
        without the second ask every admission it took waited the whole request timeout. The
        leader is elected among the nodes that answer.
        """
        stream, subject = self._stream, result_subject(job_id, task_id)
        try:
            try:
                await asyncio.wait_for(
                    self._js.get_last_msg(stream, subject, direct=True), _DIRECT_GET_S
                )
            except TimeoutError:
                await self._js.get_last_msg(stream, subject)
        except NotFoundError:
            self._answers.answered()
            return False
        except (TimeoutError, nats.errors.Error) as error:
            self._answers.failed("results read", error)
            raise unavailable("cannot read the results stream", error) from None
        self._answers.answered()
        return True


_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _encoded(value: Any) -> bytes:
    return _ENCODER.encode(value).encode()


def _encoded_around(result: dict[str, Any]) -> tuple[bytes, bytes | None]:
    """``result``'s compact JSON, and its ``response``'s alone (None when it has none), the
    response encoded once: the members before it, it, and those after it, joined."""
    if result.get("response") is None:
        return _encoded(result), None
    keys = list(result)
    at = keys.index("response")
    response = _ENCODER.encode(result["response"])
    before = _ENCODER.encode({k: result[k] for k in keys[:at]})[1:-1]
    after = _ENCODER.encode({k: result[k] for k in keys[at + 1 :]})[1:-1]
    members = [m for m in (before, f'"response":{response}', after) if m]
    return ("{" + ",".join(members) + "}").encode(), response.encode()


async def response_of(js: JetStreamContext, result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with a response kept in the object store put back in place, checked against
    its sha256. A response that cannot be read leaves ``response: null`` and says why in
    ``response_error``, so one unreadable result never hides a job's others."""
    pointer = result.get("response_object")
    if not isinstance(pointer, dict):
        return result
    rest = {k: v for k, v in result.items() if k != "response_object"}
    try:
        objects = await js.object_store(str(pointer["bucket"]))
        found = await asyncio.wait_for(objects.get(str(pointer["name"])), _OBJECT_TIMEOUT_S)
        body = found.data or b""
        if hashlib.sha256(body).hexdigest() != pointer.get("sha256"):
            raise ValueError("its sha256 does not match the result's")
        return {**rest, "response": json.loads(body)}
    except (TimeoutError, nats.errors.Error, ValueError, KeyError) as error:
        why = f"response {pointer.get('name')} unreadable: {type(error).__name__} {error}"
        return {**rest, "response": None, "response_error": why, "response_object": pointer}
