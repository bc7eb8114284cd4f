"""Posting results to ``POST jobs/{id}/result/``: gathered per job, split under the size cap,
retried with the identical body.

The results of one batch arrive together (the orchestrator settles a batch's tasks at once):
they are gathered per job for ``_GATHER_S`` and posted in as few bodies as the cap allows.
A body is joined from its entries as the renderer encoded them (``render.Entry``), never
encoded again, and retried as it is (never re-inferred) on connection errors, 429 and 5xx (503
included), with backoff, until the earliest reservation in it runs out; each body is tried once
at least. Antenna's answers that no retry can change:

- 413 (the proxy's body limit): the body is halved and each half posted; a single result is
  replaced by an error result for its image;
- 400 (a body Antenna's schema refuses): each result is posted alone; one refused alone is
  replaced by an error result for its image;
- 401, 403, 404: the results are not posted (``PostFailed``): their tasks are left to
  Antenna's redelivery, said in the log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from worker.antenna.answers import Reply
from worker.antenna.client import AntennaClient, AntennaUnreachable
from worker.antenna.render import ENVELOPE_BYTES, Entry, encoded, error_entry
from worker.core.tasks import Task

log = structlog.get_logger(__name__)
_GATHER_S = 0.05
_FIRST_RETRY_S = 0.5
_MAX_RETRY_S = 10.0
_FINAL = frozenset({400, 401, 403, 404, 413})


class PostFailed(Exception):
    """The result was not posted; Antenna will deliver its task again."""


@dataclass(eq=False)
class _Pending:
    task: Task
    entry: Entry
    deadline: float  # time.monotonic() by which the post must be done
    done: asyncio.Future[Entry]

    @property
    def body(self) -> bytes:
        return self.entry.body


class Poster:
    def __init__(
        self,
        client: AntennaClient,
        max_post_bytes: int,
        post_timeout_s: float,
        retried: Callable[[], None] = lambda: None,
        split: Callable[[], None] = lambda: None,
        client_info: dict[str, Any] | None = None,
    ) -> None:
        self._client = client
        # Each body: {"results":[...],"client_info":{...}} (Antenna's optional worker identity).
        self._tail = (
            b"]}" if client_info is None else b'],"client_info":' + encoded(client_info) + b"}"
        )
        self.envelope_bytes = ENVELOPE_BYTES - len(b"]}") + len(self._tail)
        self._max_bytes = max_post_bytes
        self._timeout_s = post_timeout_s
        self.on_retry = retried
        self.on_split = split
        self._pending: dict[int, list[_Pending]] = {}
        self._flushes: dict[int, asyncio.Task[None]] = {}
        self._waiting = 0
        self._closed = False

    async def post(self, job_id: int, task: Task, entry: Entry, deadline: float) -> Entry:
        """Post ``entry`` for ``task`` with the others gathered; what was posted for it (an
        error result in its place after a 400 or 413); PostFailed if nothing was."""
        if self._closed:
            raise PostFailed("the worker stopped before posting it")
        pending = _Pending(task, entry, deadline, asyncio.get_running_loop().create_future())
        self._waiting += 1
        pending.done.add_done_callback(self._resolved)
        self._pending.setdefault(job_id, []).append(pending)
        if job_id not in self._flushes:
            self._flushes[job_id] = asyncio.create_task(self._flush(job_id), name=f"post-{job_id}")
        return await asyncio.shield(pending.done)

    def _resolved(self, done: asyncio.Future[Entry]) -> None:
        self._waiting -= 1
        # Its settle may be gone (cancelled by a drain, past the shield): the failure is then
        # nobody's to read, and asyncio would log it as "never retrieved" at exit.
        if not done.cancelled():
            done.exception()

    async def close(self) -> None:
        """Stop posting: what is not posted fails (its tasks are redelivered by Antenna)."""
        self._closed = True
        for flush in list(self._flushes.values()):
            flush.cancel()
        await asyncio.gather(*self._flushes.values(), return_exceptions=True)
        for group in self._pending.values():
            _fail(group, "the worker stopped before posting it")
        self._pending.clear()

    async def _flush(self, job_id: int) -> None:
        """Post what is gathered for ``job_id`` until nothing is. Every result taken here
        ends resolved: posted, replaced, or failed (``PostFailed``), whatever happens to the
        post, a cancel included."""
        group: list[_Pending] = []
        try:
            await asyncio.sleep(_GATHER_S)
            while self._pending.get(job_id):
                group = self._pending.pop(job_id)
                bodies = self._bodies(group)
                if len(bodies) > 1:
                    for _ in bodies[1:]:
                        self.on_split()
                for body in bodies:
                    try:
                        await self._send(job_id, body)
                    except Exception as error:  # the poster's boundary: every result resolves
                        log.exception("result_post_failed", job_id=job_id, count=len(body))
                        _fail(body, f"posting failed: {type(error).__name__}")
                group = []
        finally:
            _fail(group, "the worker stopped before posting it")
            self._flushes.pop(job_id, None)
            if self._pending.get(job_id) and not self._closed:
                self._flushes[job_id] = asyncio.create_task(
                    self._flush(job_id), name=f"post-{job_id}"
                )

    def waiting(self) -> int:
        """Results handed to the poster and not yet posted or failed."""
        return self._waiting

    def _bodies(self, group: list[_Pending]) -> list[list[_Pending]]:
        """``group`` in bodies of at most the cap (a result over it alone: ``fit`` made it
        fit already, or Antenna's 413 decides)."""
        bodies: list[list[_Pending]] = []
        size = self._max_bytes
        for pending in group:
            grown = size + len(pending.body) + 1
            if not bodies or grown > self._max_bytes:
                bodies.append([pending])
                size = self.envelope_bytes + len(pending.body)
            else:
                bodies[-1].append(pending)
                size = grown
        return bodies

    async def _send(self, job_id: int, group: list[_Pending]) -> None:
        body = b'{"results":[' + b",".join(p.body for p in group) + self._tail
        reply = await self._post_until(job_id, body, min(p.deadline for p in group), len(group))
        if reply is not None and reply.ok:
            for pending in group:
                if not pending.done.done():
                    pending.done.set_result(pending.entry)
            return
        if reply is not None and reply.status in (400, 413):
            await self._narrowed(job_id, group, reply)
            return
        reason = reply.why() if reply is not None else "Antenna unreachable"
        log.error(
            "results_not_posted",
            job_id=job_id,
            count=len(group),
            reason=reason,
            action="left to Antenna's redelivery",
        )
        _fail(group, reason)

    async def _narrowed(self, job_id: int, group: list[_Pending], reply: Reply) -> None:
        """A 400 or 413: smaller bodies, down to one result, then its image's error result."""
        if len(group) > 1:
            half = len(group) // 2 if reply.status == 413 else 1
            parts = [group[:half], group[half:]] if reply.status == 413 else [[p] for p in group]
            for _ in parts[1:]:
                self.on_split()
            for part in parts:
                await self._send(job_id, part)
            return
        (pending,) = group
        if pending.entry.error is not None:
            log.error("error_result_refused", job_id=job_id, reason=reply.why())
            _fail(group, reply.why())
            return
        message = f"Antenna refused this image's result ({reply.why()})"
        log.warning(
            "result_replaced_by_error",
            job_id=job_id,
            image_id=pending.task.image_id,
            reason=reply.why(),
        )
        replacement = _Pending(
            pending.task,
            error_entry(pending.task, message),
            pending.deadline,
            pending.done,
        )
        await self._send(job_id, [replacement])

    async def _post_until(
        self, job_id: int, body: bytes, deadline: float, count: int
    ) -> Reply | None:
        """Post ``body`` until an answer no retry changes, or ``deadline`` (one try at least)."""
        delay_s = _FIRST_RETRY_S
        while True:
            reply: Reply | None = None
            try:
                reply = await self._client.post(
                    f"jobs/{job_id}/result/", "result", body, self._timeout_s
                )
                # Every Antenna that answers results_queued (its ``result`` action, since it
                # counts at all) queues each result of a body it accepts and counts them all;
                # a body it refuses is a 400 as a whole. An older one filtered the count by
                # status "queued", but queued nothing else. So fewer is not a partial success
                # to build on: the answer is not understood, and the body is posted again.
                queued = reply.body.get("results_queued") if reply.ok else None
                if reply.ok and queued != count:
                    why = f"Antenna queued {queued} of the {count} results posted"
                    reply = None  # not an answer that says they are kept
                elif reply.ok or reply.status in _FINAL:
                    return reply
                else:
                    why = reply.why()
            except AntennaUnreachable as error:
                why = str(error)
            if time.monotonic() + delay_s > deadline:
                return reply
            self.on_retry()
            log.warning(
                "result_post_retried",
                job_id=job_id,
                count=count,
                bytes=len(body),
                reason=why,
                retry_in_s=delay_s,
            )
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, _MAX_RETRY_S)


def _fail(group: list[_Pending], reason: str) -> None:
    for pending in group:
        if not pending.done.done():
            pending.done.set_exception(PostFailed(reason))
