"""Whether an HTTP answer is Antenna's, and what it says (``checked_reply``): no redirect, a 2xx
only with the JSON body its endpoint answers, no JSON nested past ``MAX_DEPTH``.

What each endpoint must answer with a 2xx, as the worker reads it: field names and types from
Antenna's serializers and schemas (RolnickLab/antenna ``ami/jobs/views.py``,
``ami/jobs/serializers.py``, ``ami/ml/schemas.py``: ``MLJobTasksResponseSerializer``,
``PipelineProcessingTask``, ``MLJobResultsResponseSerializer``). Strict about the fields the
worker uses, tolerant of extra ones. A 2xx whose body does not fit is not an answer
(``NotAntennas`` naming the field, which the client raises as ``BadAnswer``), except for the
tasks of a reservation: Antenna reserved every one of them, so each is checked on its own
(``task_problem``) and one bad task does not lose the others.

Knows no HTTP library and no connection: it reads a status, a Location, a Content-Type and a
body. Imports only config's names and redaction.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import pydantic

from config.names import env_name
from config.redact import redact_url, scrub, shorten

SHOWN_BODY_CHARS = 300
MAX_DEPTH = 64

# A NATS subject: printable ASCII, no spaces (a non-ASCII digit such as '²' is not a digit here).
Subject = Annotated[str, pydantic.StringConstraints(pattern=r"^[!-~]*$", max_length=1024)]


class _Answer(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")


class ListedJob(_Answer):
    id: pydantic.StrictInt
    pipeline_slug: str | None = None


class JobsPage(_Answer):
    """``GET jobs/`` (a DRF page)."""

    count: pydantic.StrictInt | None = None
    next: str | None = None
    results: list[ListedJob]


class JobDetail(_Answer):
    """``GET jobs/{id}/``."""

    status: str | None = None
    pipeline_slug: str | None = None


class ReservedTask(_Answer):
    """``PipelineProcessingTask``."""

    id: str
    image_id: str
    image_url: str
    reply_subject: Subject | None = None


class Reserved(_Answer):
    """``POST jobs/{id}/tasks/``: ``MLJobTasksResponseSerializer``; the envelope only (each task
    is a ``ReservedTask``, checked on its own by the source)."""

    tasks: list[Any]


_USABLE_SUBJECT = pydantic.TypeAdapter(
    Annotated[str, pydantic.StringConstraints(pattern=r"^[!-~]+$", max_length=1024)]
)


def task_problem(task: object) -> str | None:
    """Why one reserved task is not a ``ReservedTask``, by field; None when it is one."""
    try:
        ReservedTask.model_validate(task)
    except pydantic.ValidationError as error:
        return wrong_fields(error)
    return None


def usable_reply_subject(value: object) -> str | None:
    """``value`` when a result can be posted to it (one NATS subject), else None: a result
    without one is never acked by Antenna."""
    try:
        return _USABLE_SUBJECT.validate_python(value, strict=True)
    except pydantic.ValidationError:
        return None


def wrong_fields(error: pydantic.ValidationError) -> str:
    """The fields that are wrong, by path, with what was wrong (no values: they may be long)."""
    parts = []
    for problem in error.errors()[:3]:
        path = ".".join(str(p) for p in problem["loc"]) or "the body"
        parts.append(f"{path}: {problem['msg']}")
    more = error.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


class QueuedResult(_Answer):
    reply_subject: str
    status: str


class ResultsAccepted(_Answer):
    """``POST jobs/{id}/result/``: ``MLJobResultsResponseSerializer``; Antenna answers 200
    only once every result in the body is queued."""

    status: Literal["accepted"]
    job_id: pydantic.StrictInt
    results_queued: pydantic.StrictInt
    tasks: list[QueuedResult] = []


class Registered(_Answer):
    """``POST projects/{id}/pipelines/``."""

    pipelines_created: list[str] | None = None


class ListedPipeline(_Answer):
    slug: str


class PipelinesPage(_Answer):
    """``GET projects/{id}/pipelines/``."""

    results: list[ListedPipeline]


BY_ENDPOINT: dict[str, type[pydantic.BaseModel]] = {
    "jobs": JobsPage,
    "job": JobDetail,
    "tasks": Reserved,
    "result": ResultsAccepted,
    "register": Registered,
    "pipelines": PipelinesPage,
}


class NotAntennas(Exception):
    """An answer that cannot be believed: a redirect, a 2xx that is not the endpoint's JSON."""


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any  # the parsed JSON as Antenna sent it (checked against its endpoint's schema
    # when 2xx), or None
    text: str  # the start of the answer, scrubbed, the token masked: for messages
    said: str = ""  # its ``detail`` or ``error``, scrubbed, the token masked: for messages
    # A key was sent with this ``Authorization`` scheme and Antenna answered as to nobody
    # (``anonymous``): no authenticator of Antenna's takes that scheme.
    unknown_scheme: str = ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def why(self) -> str:
        """One line for a log or an error: the status and what Antenna said."""
        said = f"HTTP {self.status}: {shorten(self.said or self.text, SHOWN_BODY_CHARS)}"
        if self.unknown_scheme:
            return f"{said} ({scheme_not_taken(self.unknown_scheme)})"
        return said


# What Django REST framework answers a call no authenticator took (Antenna's main has
# ``TokenAuthentication`` alone, so a key under any other scheme is nobody's).
NOT_PROVIDED = "Authentication credentials were not provided."


def anonymous(reply: Reply) -> bool:
    """``reply`` is Antenna's answer to a caller it took for nobody."""
    return reply.status == 401 and reply.said.startswith(NOT_PROVIDED[:-1])


def scheme_not_taken(scheme: str) -> str:
    """What an answer to nobody means when a key was sent: the scheme, not the key."""
    return (
        f"the key was sent as `Authorization: {scheme} ...` and Antenna took the call as "
        f"anonymous: it does not take the {scheme!r} scheme; set "
        f"{env_name('antenna', 'auth_scheme')} to the one it takes (`Token` on Antenna's main)"
    )


_STRUCTURE = re.compile(rb'["\[\]{}]')
# The rest of a string after its opening quote. Possessive: matched once, from a known start,
# in linear time or not at all (a pattern that may backtrack, tried at every offset, went
# quadratic on an unterminated string of escaped quotes, holding the GIL: the process froze).
_STRING_REST = re.compile(rb'(?:[^"\\]++|\\.)*+"', re.DOTALL)
_QUOTE = ord('"')
_OPENS = frozenset(b"[{")


def json_depth(raw: bytes) -> int:
    """How deeply ``raw``'s arrays and objects nest (strings skipped), without parsing it: one
    pass, linear whatever ``raw`` holds, stopping once past ``MAX_DEPTH`` or at a string that
    never ends (then it is not JSON, as ``json.loads`` says next)."""
    depth = deepest = 0
    at = 0
    while (found := _STRUCTURE.search(raw, at)) is not None:
        byte, at = raw[found.start()], found.end()
        if byte == _QUOTE:
            rest = _STRING_REST.match(raw, at)
            if rest is None:
                return deepest
            at = rest.end()
        elif byte in _OPENS:
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_DEPTH:
                    return deepest
        else:
            depth -= 1
    return deepest


def _parsed(raw: bytes) -> tuple[Any, str]:
    """The JSON in ``raw`` and "", or None and why it is not JSON the worker reads."""
    if not raw:
        return None, "an empty body"
    if json_depth(raw) > MAX_DEPTH:
        return None, f"JSON nested deeper than {MAX_DEPTH}"
    try:
        return json.loads(raw), ""
    except (ValueError, RecursionError):
        return None, "not JSON"


@dataclass(frozen=True)
class Received:
    """One HTTP answer as it came: what ``checked_reply`` judges."""

    status: int
    location: str
    content_type: str
    body: bytes


def checked_reply(
    where: str, endpoint: str, received: Received, root: str, masked: Callable[[str], str]
) -> Reply:
    """``received`` as a ``Reply`` when it is Antenna's answer to ``endpoint``, else
    NotAntennas naming what is wrong. The body is parsed as it came; only what is shown
    (``text``, ``said``) is masked."""
    status, raw = received.status, received.body
    # Masked before it is cut, so that a token across the cut shows none of itself.
    head = masked(raw[: SHOWN_BODY_CHARS * 4].decode("utf-8", "replace"))
    text = scrub(head[:SHOWN_BODY_CHARS])
    if 300 <= status < 400:
        location = received.location
        pointed = redact_url(urllib.parse.urljoin(root, location)) if location else "nowhere"
        raise NotAntennas(
            f"Antenna answered {where} with HTTP {status}, a redirect to {pointed}: redirects "
            f"are not followed (is {env_name('antenna', 'base_url')} Antenna's own address?)"
        )
    body, why = _parsed(raw)
    said = body.get("detail") or body.get("error") if isinstance(body, dict) else None
    shown = shorten(scrub(masked(str(said))), SHOWN_BODY_CHARS) if said else ""
    if not 200 <= status < 300:
        return Reply(status, body, text, shown)
    if body is None:
        raise NotAntennas(
            f"Antenna answered {where} with HTTP {status} and {why} "
            f"({received.content_type or 'no Content-Type'}): {shorten(text, 120)}"
        )
    schema = BY_ENDPOINT.get(endpoint)
    if schema is not None:
        try:
            schema.model_validate(body)
        except pydantic.ValidationError as error:
            raise NotAntennas(
                f"Antenna answered {where} with HTTP {status} and a body that is not its "
                f"{endpoint} answer: {wrong_fields(error)}"
            ) from None
    return Reply(status, body, text, shown)
