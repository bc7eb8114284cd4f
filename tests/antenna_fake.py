"""A fake Antenna: its worker-facing HTTP API as a real HTTP server on 127.0.0.1, for tests.

Written from Antenna's documented and observed behaviour (issue #24; requests and answers seen
on a running Antenna, /work/antenna-real/OBSERVED.md), not from its code:

- ``GET jobs/?pipeline__slug__in=..&ids_only=1&incomplete_only=1&dispatch_mode=async_api``:
  DRF's limit/offset page ``{count, next, previous, results: [{id, pipeline_slug}],
  user_permissions}``; with ``ids_only`` one job per call unless ``limit`` is given, in a
  random order unless ``ordering=created_at``; ``status=`` filters exactly;
  ``incomplete_only`` still lists CREATED, PENDING and CANCELING jobs. A token that is not a
  superuser's sees every job twice (``count`` too); a superuser's listing says ``create`` in
  its ``user_permissions`` (no project named). Anonymous calls may list; a wrong token gets
  401 everywhere. ``project_id=<id>`` (the active project, ``ami/base/views.py``
  ``get_active_project``: one integer, 400 otherwise) lists that project's jobs only, and an id
  no project has lists every project's (no project found, no filter); ``project=<id>`` (the
  jobs filterset's field) lists that project's jobs and answers 400 for an id no project has.
  Neither takes several ids.
  Without ``ids_only`` each job as ``JobListSerializer`` gives it: ``status``, ``pipeline``
  (nested, with its ``slug``) and ``progress`` (``JobProgress``: ``collect`` with
  ``total_images``; ``process`` with ``processed``, ``remaining`` and ``failed`` once a result
  was processed, none before).
- ``GET jobs/{id}/``: the job with its ``status`` and ``progress``; 404 for an unknown job.
- ``client_info`` (``ProcessingServiceClientInfo``: any JSON object, optional) may come with
  ``tasks/`` and ``result/`` bodies; anything but an object (or null) is a 400. Antenna
  validates it and keeps nothing of it; the fake records it in ``client_infos``.
- ``POST jobs/{id}/tasks/`` ``{"batch_size": N}``: ``{"tasks": [...]}``, each reserved for
  ``ttr_s`` and delivered at most ``max_deliver`` (2) times; ``[]`` for a job that is not
  STARTED/RETRY or has nothing left to reserve; 503 while ``tasks_unavailable``.
- ``POST jobs/{id}/result/``: 413 above ``max_body_bytes``; 400 for a body the schema refuses;
  503 while ``results_unavailable`` (or for the next ``fail_results`` posts); else 200
  ``{"status": "accepted", ...}``, and then, as Antenna's background save does: every result
  of a pipeline registered without a detection algorithm (task type detection, localization
  or segmentation) is dropped ("Pipeline does not have a detection algorithm"); a result
  naming an unregistered detection algorithm key, another pipeline's slug, or scores that do
  not index the category map is dropped (not saved, not acked: its task comes back once); an
  unregistered classification key saves the detections only, and does not ack. Otherwise the
  detections are saved on the image named in ``source_images`` (even when it is not the
  task's: that image counts as done and the task is acked, so the task's own image stays
  pending with no message left); detections dedupe on (image, bbox). An error result with
  ``image_id`` marks that image failed; without one it is acked and counts nothing. Results for
  a job that is no longer active are accepted and ignored. A job whose images are all done
  ends SUCCESS, or FAILURE when more than half failed. A classification is saved with its
  ``scores`` and ``logits`` as sent (``create_classification``); ``maskable`` says whether
  Antenna's class masking would use it (logits stored, one per category).
- ``POST projects/{id}/pipelines/``: registers pipelines (201; ``pipelines_created`` lists the
  new slugs and algorithm keys, empty on a repeat); algorithm keys are global and write-once
  (a known key with another version: 500); a new classifier without a category map: 500;
  no ``version``: 400. ``GET projects/{id}/pipelines/`` lists them.
- Jobs not dispatched as ``async_api``: 400 on ``tasks/``. A bad ``tasks/`` body gets its 400
  before the job is looked up; ``result/`` looks the job up first.
- Authorization ``<scheme> <key>``: the schemes in ``schemes`` (``Token`` alone, as DRF's
  ``TokenAuthentication`` on Antenna's main; ``Api-Key`` where a test adds it, as Antenna's
  processing-service key branch does). A header of another scheme is no credential (DRF's
  authenticators pass it over): the call is anonymous. No token or a wrong one: 401.
  ``tasks/`` and ``result/`` need ``tasks_ml_job`` and
  ``result_ml_job``, which no role grants: any token but a superuser's gets 403 there.
  Registering needs the project's manager (``tokens``) or a superuser: else 403.

What the field plays besides Antenna (a proxy in front, a half-broken deployment, a slow link)
is asked for by endpoint with ``misbehave`` (``jobs``, ``job``, ``tasks``, ``result``,
``register``, ``pipelines``), for the next ``times`` calls or until ``behave``: ``redirect``
(302 to ``location``, as a login page or another origin would), ``html`` (200 text/html, a
maintenance page), ``json`` (``body``, with 200 or ``status``), ``deep`` (200,000 nested
``[``), ``cut`` (the call is served, then its answer is cut mid-body), ``badstatus`` (a line
that is not HTTP), ``slow`` (the call is served and its whole answer dripped one byte every
``interval_s``), ``late`` (the call is served and its whole answer sent ``interval_s``
later: a proxy or a busy Antenna holding the answer), ``down`` (the connection closed
unanswered: the server behind a proxy stopped), ``drop`` (the call is served, then the
connection closed unanswered: Antenna acted, and its answer was lost on the way back, as when
a proxy or a link drops mid-call), ``hints``
(the call is served, its answer preceded by ``100 Continue`` unasked and ``interim`` answers
``103 Early Hints``, as a CDN or proxy in front sends them). Everything else stays as the real
server does it.
``spoil`` changes the fields of one image's task in the reservations that hold it (a proxy or
a broken deployment garbling one task of several: the others are reserved as Antenna does).
``connections`` counts the TCP connections accepted.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import ssl
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pydantic

ACTIVE = {"STARTED", "RETRY"}
FINAL = {"SUCCESS", "FAILURE", "REVOKED"}
_NOT_FOUND_PAGE = (
    '<!doctype html>\n<html lang="en">\n<head>\n  <title>Not Found</title>\n</head>\n<body>\n'
    "  <h1>Not Found</h1><p>The requested resource was not found on this server.</p>\n</body>"
)
DETECTION_TYPES = {"detection", "localization", "segmentation"}  # Algorithm.detection_task_types


# Antenna's request schema for results, as the fake checks it (field names from Antenna's docs).
class _Ref(pydantic.BaseModel):
    name: str
    key: str


class _Classification(pydantic.BaseModel):
    classification: str
    labels: list[str] | None = None
    scores: list[float] = []
    logits: list[float] | None = None
    algorithm: _Ref
    terminal: bool = True
    timestamp: str


class _Detection(pydantic.BaseModel):
    source_image_id: str
    bbox: dict[str, float] | None = None
    algorithm: _Ref
    timestamp: str
    classifications: list[_Classification] = []


class _Image(pydantic.BaseModel):
    id: str
    url: str


class _Results(pydantic.BaseModel):
    pipeline: str
    total_time: float
    source_images: list[_Image]
    detections: list[_Detection]


class _Error(pydantic.BaseModel):
    error: str
    image_id: str | None = None


class _Item(pydantic.BaseModel):
    reply_subject: str
    result: _Results | _Error


class _Post(pydantic.BaseModel):
    results: list[_Item]


@dataclass(frozen=True)
class _User:
    projects: frozenset[int]  # the projects it manages (may register pipelines in)
    superuser: bool

    def __contains__(self, project: object) -> bool:
        return self.superuser or project in self.projects


@dataclass
class Misbehaviour:
    kind: str  # redirect, html, json, deep, cut, badstatus, slow, late, down, drop, hints
    times: int | None = None
    body: bytes = b""
    status: int = 200  # json: the status it is answered with
    location: str = ""
    interval_s: float = 3.0
    drip_bytes: int = 600  # slow: how much of the answer is sent before the connection closes
    interim: int = 1  # hints: how many 103 Early Hints come before the answer
    used: int = 0


def endpoint_of(method: str, path: str) -> str:
    """The client's name for the endpoint ``path`` is (``jobs``, ``job``, ``tasks``, ...)."""
    parts = [p for p in path.split("/") if p][2:]
    if parts == ["jobs"]:
        return "jobs"
    if len(parts) == 2 and parts[0] == "jobs":
        return "job"
    if len(parts) == 3 and parts[0] == "jobs":
        return parts[2]
    if len(parts) == 3 and parts[0] == "projects":
        return "register" if method == "POST" else "pipelines"
    return ""


@dataclass
class FakeTask:
    image_id: str
    url: str
    seq: int
    delivered: int = 0
    reserved_until: float = 0.0
    acked: bool = False


@dataclass
class FakeJob:
    id: int
    project: int
    pipeline: str
    status: str
    tasks: dict[str, FakeTask]
    done: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    saved: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    result_times: list[float] = field(default_factory=list)  # when a result was saved
    dispatch_mode: str = "async_api"


class FakeAntenna:
    def __init__(
        self,
        *,
        token: str = "fake-token-0123456789abcdef",
        ttr_s: float = 300.0,
        max_deliver: int = 2,
        max_body_bytes: int = 10**9,
    ) -> None:
        self.token = token
        self.ttr_s = ttr_s
        self.max_deliver = max_deliver
        self.max_body_bytes = max_body_bytes
        self.lock = threading.RLock()
        self.tokens: dict[str, set[int]] = {token: {1}}  # token -> projects it manages
        self.superusers = {token}  # only a superuser's token may reserve tasks and post results
        self.projects: dict[int, dict[str, dict[str, Any]]] = {1: {}}  # pipelines per project
        self.algorithms: dict[str, dict[str, Any]] = {}  # global, write-once
        self.jobs: dict[int, FakeJob] = {}
        self.images: dict[str, bytes] = {}  # served at /media/<name>
        self.tasks_unavailable = False
        self.results_unavailable = False
        self.fail_results = 0  # the next N result posts answer 503
        self.requests: list[tuple[str, str, int]] = []  # method, path, status
        self.bodies: list[bytes] = []  # every result body received
        self.headers_seen: list[str] = []
        self.schemes = {"Token"}  # the Authorization schemes Antenna's authenticators take
        self.client_infos: list[tuple[str, Any]] = []  # (endpoint, client_info) as received
        self.connections = 0
        self.modes: dict[str, Misbehaviour] = {}
        self.spoiled: dict[str, tuple[Callable[[dict[str, Any]], Any], int | None]] = {}
        self._next_job = 1
        self._seq = 0
        self._server: ThreadingHTTPServer | None = None
        self.tls: ssl.SSLContext | None = None  # set before ``running``: HTTPS (benchmarks)

    # -- set-up ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None
        return f"{self._scheme}://127.0.0.1:{self._server.server_address[1]}/api/v2"

    def media_url(self, name: str) -> str:
        assert self._server is not None
        return f"{self._scheme}://127.0.0.1:{self._server.server_address[1]}/media/{name}"

    @property
    def _scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def register_direct(self, project: int, config: dict[str, Any]) -> None:
        """As ``POST projects/{id}/pipelines/`` would (for tests that do not register)."""
        with self.lock:
            self._register(project, {"processing_service_name": "t", "pipelines": [config]})

    def add_job(
        self,
        pipeline: str,
        images: list[tuple[str, str]],
        *,
        project: int = 1,
        status: str = "STARTED",
    ) -> int:
        with self.lock:
            job_id = self._next_job
            self._next_job += 1
            tasks = {}
            for image_id, url in images:
                self._seq += 1
                tasks[image_id] = FakeTask(image_id, url, self._seq)
            self.jobs[job_id] = FakeJob(job_id, project, pipeline, status, tasks)
            return job_id

    @contextmanager
    def running(self, port: int = 0, bound: socket.socket | None = None) -> Iterator[FakeAntenna]:
        """Serve on ``port`` (0: any free one), or on ``bound`` (a socket of ``reserved_port``:
        Antenna down, then up, on one port no other process could take meanwhile), until the
        block ends (``bound`` is closed then)."""
        fake = self

        class Handler(_Handler):
            antenna = fake

        if bound is None:
            self._server = _Server(("127.0.0.1", port), Handler)
        else:
            self._server = _Server(bound.getsockname(), Handler, bind_and_activate=False)
            self._server.socket.close()
            self._server.socket = bound
            self._server.server_name, self._server.server_port = bound.getsockname()[:2]
            self._server.server_activate()
        self._server.daemon_threads = True
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
            thread.join(10)

    def misbehave(self, endpoint: str, kind: str, times: int | None = None, **how: Any) -> None:
        """Answer ``endpoint``'s next ``times`` calls (all, when None) the ``kind`` way."""
        with self.lock:
            self.modes[endpoint] = Misbehaviour(kind, times, **how)

    def spoil(
        self, image_id: str, change: Callable[[dict[str, Any]], Any], times: int | None = None
    ) -> None:
        """In the next ``times`` reservations of ``image_id``'s task (all, when None), answer
        ``change(task)`` in its place; the task is reserved (and counted delivered) all the
        same."""
        with self.lock:
            self.spoiled[image_id] = (change, times)

    def _spoiled(self, image_id: str, task: dict[str, Any]) -> Any:
        change, times = self.spoiled.get(image_id, (None, None))
        if change is None:
            return task
        if times is not None:
            if times <= 1:
                del self.spoiled[image_id]
            else:
                self.spoiled[image_id] = (change, times - 1)
        return change(dict(task))

    def behave(self, endpoint: str | None = None) -> None:
        """Answer ``endpoint`` (every endpoint, when None) as Antenna does again."""
        with self.lock:
            if endpoint is None:
                self.modes.clear()
            else:
                self.modes.pop(endpoint, None)

    def _mode_for(self, endpoint: str) -> Misbehaviour | None:
        with self.lock:
            mode = self.modes.get(endpoint)
            if mode is None:
                return None
            if mode.times is not None:
                mode.times -= 1
                if mode.times <= 0:
                    del self.modes[endpoint]
            mode.used += 1
            return mode

    # -- what a test reads ---------------------------------------------------------------
    def pending(self, job_id: int) -> set[str]:
        with self.lock:
            job = self.jobs[job_id]
            return set(job.tasks) - job.done - job.failed

    def lost(self, job_id: int) -> set[str]:
        """Images no one will ever be given again: delivered ``max_deliver`` times, not acked,
        reservation run out (Antenna then fails them when the job goes stale)."""
        now = time.monotonic()
        with self.lock:
            job = self.jobs[job_id]
            return {
                t.image_id
                for t in job.tasks.values()
                if not t.acked
                and t.delivered >= self.max_deliver
                and t.reserved_until <= now
                and t.image_id not in job.done | job.failed
            }

    @staticmethod
    def maskable(classification: dict[str, Any], categories: int) -> bool:
        """Whether Antenna's class masking would re-score this saved classification: it takes
        only those with scores and logits stored, and reads the logits alone, one per category
        (``ami/ml/post_processing/class_masking.py``)."""
        logits = classification.get("logits")
        return (
            classification.get("scores") is not None
            and isinstance(logits, list)
            and len(logits) == categories
            and all(isinstance(v, int | float) for v in logits)
        )

    def expire_reservations(self) -> None:
        """Let every reservation run out now (as ``ttr_s`` passing would)."""
        with self.lock:
            for job in self.jobs.values():
                for task in job.tasks.values():
                    task.reserved_until = min(task.reserved_until, time.monotonic())

    # -- the API -------------------------------------------------------------------------
    def handle(
        self, method: str, path: str, query: dict[str, str], auth: str | None, body: bytes
    ) -> tuple[int, Any]:
        parts = [p for p in path.split("/") if p]
        if parts[:2] != ["api", "v2"]:  # outside the API: Django's HTML page
            return 404, _NOT_FOUND_PAGE
        parts = parts[2:]
        user = self._user(auth)
        if isinstance(user, str):
            return 401, {"detail": "Invalid token."}
        with self.lock:
            if method == "GET" and parts == ["users", "me"]:  # djoser's current user
                if user is None:
                    return 401, {"detail": "Authentication credentials were not provided."}
                return 200, {"id": 1, "email": "worker@example.org", "name": "worker"}
            if method == "GET" and parts == ["jobs"]:
                return self._list(query, user)
            if method == "GET" and len(parts) == 2 and parts[0] == "jobs":
                job = self._job(parts[1])
                if job is None:
                    return 404, {"detail": "Not found."}
                return 200, {
                    "id": job.id,
                    "status": job.status,
                    "pipeline_slug": job.pipeline,
                    "progress": self._progress(job),
                }
            if method == "GET" and len(parts) == 3 and parts[0] == "projects":
                project = int(parts[1]) if parts[1].isdigit() else -1
                if project not in self.projects or parts[2] != "pipelines":
                    return 404, {"detail": "Not found."}
                found = [
                    {"id": i, "name": p["config"].get("name"), "slug": slug}
                    for i, (slug, p) in enumerate(self.projects[project].items(), 1)
                ]
                return 200, {"count": len(found), "next": None, "previous": None, "results": found}
            if method == "POST" and len(parts) == 3 and parts[0] in ("jobs", "projects"):
                if user is None:
                    return 401, {"detail": "Authentication credentials were not provided."}
                return self._post(parts, user, body)
        return 405 if method == "GET" else 404, {"detail": "Not found."}

    def _user(self, auth: str | None) -> _User | str | None:
        if not auth:
            return None
        scheme, _, key = auth.partition(" ")
        if scheme not in self.schemes:
            return None  # no authenticator takes it: anonymous
        if key not in self.tokens:
            return "invalid"
        return _User(frozenset(self.tokens[key]), key in self.superusers)

    def _job(self, text: str) -> FakeJob | None:
        return self.jobs.get(int(text)) if text.isdigit() else None

    def _projects_of(self, query: dict[str, str]) -> set[int] | tuple[int, Any]:
        """The projects ``project_id`` and ``project`` name (an empty set: every project), or
        Antenna's 400 answer."""
        named: set[int] = set()
        active = query.get("project_id")
        if active:
            if not active.isdigit():
                return 400, {"project_id": ["A valid integer is required."]}
            if int(active) in self.projects:  # an unknown id filters nothing
                named.add(int(active))
        chosen = query.get("project")
        if chosen:
            if not chosen.isdigit() or int(chosen) not in self.projects:
                return 400, {
                    "project": [
                        "Select a valid choice. That choice is not one of the available choices."
                    ]
                }
            if named and int(chosen) not in named:
                return {-1}  # both filters: no job is in two projects
            named = {int(chosen)}
        return named

    def _list(self, query: dict[str, str], user: _User | None = None) -> tuple[int, Any]:
        slugs = set(query.get("pipeline__slug__in", "").split(",")) - {""}
        projects = self._projects_of(query)
        if isinstance(projects, tuple):
            return projects
        jobs = [
            j
            for j in sorted(self.jobs.values(), key=lambda j: j.id)  # created in id order
            if (not slugs or j.pipeline in slugs)
            and (not projects or j.project in projects)
            and not (query.get("incomplete_only") in ("1", "true") and j.status in FINAL)
            and query.get("dispatch_mode", j.dispatch_mode) == j.dispatch_mode
            and query.get("status", j.status) == j.status
        ]
        if query.get("ids_only") in ("1", "true") and query.get("ordering") != "created_at":
            random.shuffle(jobs)  # Antenna's ids-only listing: order_by("?")
        superuser = user is not None and user.superuser
        if not superuser:
            jobs = [j for job in jobs for j in (job, job)]  # a join Antenna does not distinct
        limit = int(query.get("limit", 10 if query.get("ids_only") not in ("1", "true") else 1))
        offset = int(query.get("offset", 0))
        listed = jobs[offset : offset + limit]
        if query.get("ids_only") in ("1", "true"):  # MinimalJobSerializer
            results = [
                {"id": j.id, "pipeline_slug": j.pipeline, "user_permissions": []} for j in listed
            ]
        else:  # JobListSerializer
            results = [{**self._full(j), "user_permissions": []} for j in listed]
        more = offset + limit < len(jobs)
        return 200, {
            "count": len(jobs),
            "next": f"{self.url}/jobs/?limit={limit}&offset={offset + limit}" if more else None,
            "previous": None if offset == 0 else f"{self.url}/jobs/?limit={limit}",
            "results": results,
            # add_collection_level_permissions: "create" for a superuser when no project is named
            "user_permissions": ["create"] if superuser else [],
        }

    def _full(self, job: FakeJob) -> dict[str, Any]:
        """A job as ``JobListSerializer`` (the full listing) gives it, the fields the worker
        may read: ``pipeline`` nested, ``progress`` by stage."""
        return {
            "id": job.id,
            "status": job.status,
            "dispatch_mode": job.dispatch_mode,
            "pipeline": {"id": 1, "name": job.pipeline, "slug": job.pipeline},
            "progress": self._progress(job),
        }

    def _progress(self, job: FakeJob) -> dict[str, Any]:
        """``JobProgress``: ``collect`` says ``total_images`` once the job started; the
        ``process`` stage gets ``processed``, ``remaining`` and ``failed`` at each result
        Antenna processes (``_update_job_progress``), and none before the first."""

        def param(key: str, value: Any) -> dict[str, Any]:
            return {"name": key.title(), "key": key, "category": "default", "value": value}

        total = len(job.tasks)
        finished = len(job.done | job.failed)
        process: dict[str, Any] = {"key": "process", "name": "Process", "params": []}
        process.update(status="CREATED", progress=0.0)
        if job.result_times:
            remaining = total - finished
            process["params"] = [
                param("processed", finished),
                param("remaining", remaining),
                param("failed", len(job.failed)),
            ]
            process.update(status="STARTED", progress=finished / total if total else 1.0)
        collect = {
            "key": "collect",
            "name": "Collect",
            "status": "SUCCESS",
            "progress": 1.0,
            "params": [param("total_images", total)],
        }
        return {
            "summary": {"status": job.status, "progress": finished / total if total else 1.0},
            "stages": [collect, process],
            "errors": [],
            "logs": [],
        }

    def _post(self, parts: list[str], user: _User, body: bytes) -> tuple[int, Any]:
        try:
            payload = json.loads(body or b"null")
        except ValueError:
            return 400, {"detail": "JSON parse error"}
        if parts[0] == "projects":
            project = int(parts[1]) if parts[1].isdigit() else -1
            if project not in self.projects:
                return 404, {"detail": "Not found."}
            if project not in user:
                return 403, {"detail": "You do not have permission to perform this action."}
            return self._register(project, payload)
        size = payload.get("batch_size") if isinstance(payload, dict) else None
        if parts[2] == "tasks" and (not isinstance(size, int) or size < 1):
            return 400, {"batch_size": ["Ensure this value is greater than or equal to 1."]}
        if parts[2] == "tasks" and (refused := self._client_info(parts[2], payload)):
            return refused  # the serializer is checked before the job is looked up
        job = self._job(parts[1])
        if job is None:
            return 404, {"detail": "Not found."}
        if not user.superuser:  # tasks_ml_job / result_ml_job: no role grants them
            return 403, {"detail": "You do not have permission to perform this action."}
        if parts[2] == "tasks":
            if job.dispatch_mode != "async_api":
                return 400, ["Only async_api jobs have fetchable tasks"]
            return self._reserve(job, int(size or 0))
        if parts[2] == "result":
            if refused := self._client_info(parts[2], payload):
                return refused
            return self._result(job, payload, body)
        return 404, {"detail": "Not found."}

    def _client_info(self, endpoint: str, payload: Any) -> tuple[int, Any] | None:
        """Antenna's ``SchemaField(ProcessingServiceClientInfo)``: an object or nothing."""
        info = payload.get("client_info") if isinstance(payload, dict) else None
        if info is not None and not isinstance(info, dict):
            return 400, {"client_info": ["Input should be a valid dictionary"]}
        if isinstance(payload, dict) and "client_info" in payload:
            self.client_infos.append((endpoint, info))
        return None

    def _reserve(self, job: FakeJob, size: int) -> tuple[int, Any]:
        if self.tasks_unavailable:
            return 503, {"error": "Task queue temporarily unavailable"}
        if job.status not in ACTIVE:
            return 200, {"tasks": []}
        now = time.monotonic()
        ready = [
            t
            for t in sorted(job.tasks.values(), key=lambda t: t.seq)
            if not t.acked and t.reserved_until <= now and t.delivered < self.max_deliver
        ][:size]
        tasks = []
        for i, task in enumerate(ready):
            task.delivered += 1
            task.reserved_until = now + self.ttr_s
            subject = (
                f"$JS.ACK.job_{job.id}.job-{job.id}-consumer.{task.delivered}.{task.seq}."
                f"{task.seq + i}.{time.time_ns()}.{len(ready) - i - 1}"
            )
            answer = {
                "id": task.image_id,
                "image_id": task.image_id,
                "image_url": task.url,
                "reply_subject": subject,
            }
            tasks.append(self._spoiled(task.image_id, answer))
        return 200, {"tasks": tasks}

    def _result(self, job: FakeJob, payload: Any, body: bytes) -> tuple[int, Any]:
        self.bodies.append(body)
        if self.results_unavailable or self.fail_results > 0:
            self.fail_results = max(0, self.fail_results - 1)
            return 503, {
                "status": "error",
                "job_id": job.id,
                "detail": "Task queue temporarily unavailable",
            }
        try:
            post = _Post.model_validate(payload)
        except pydantic.ValidationError as error:
            return 400, {"results": [str(error)[:300]]}
        for entry in post.results:
            self._save(job, entry)
        subjects = [e.reply_subject for e in post.results]
        return 200, {
            "status": "accepted",
            "job_id": job.id,
            "results_queued": len(subjects),
            # task_id: the id of the background job Antenna queued for the result (a uuid).
            "tasks": [
                {"reply_subject": s, "status": "queued", "task_id": str(uuid.uuid4())}
                for s in subjects
            ],
        }

    def _task_of(self, job: FakeJob, subject: str) -> FakeTask | None:
        tokens = subject.split(".")
        if len(tokens) != 9 or not tokens[5].isdigit():
            return None
        seq = int(tokens[5])
        return next((t for t in job.tasks.values() if t.seq == seq), None)

    def _save(self, job: FakeJob, entry: _Item) -> None:
        """Antenna's background save (see the module's docstring)."""
        task = self._task_of(job, entry.reply_subject)
        if task is None or job.status not in ACTIVE:
            return  # accepted, then ignored
        result = entry.result
        if isinstance(result, _Error):
            task.acked = True
            if result.image_id in job.tasks:
                job.failed.add(result.image_id)
                job.result_times.append(time.monotonic())
            self._maybe_done(job)
            return
        verdict = self._saveable(job, result)
        if verdict == "drop":
            return  # accepted with 200, then not saved, not acked
        for image in result.source_images:
            saved = job.saved.setdefault(image.id, [])
            for detection in result.detections:
                record = detection.model_dump(mode="json", exclude={"timestamp"})
                if verdict == "detections_only":
                    record["classifications"] = []
                if all(r["bbox"] != record["bbox"] for r in saved):
                    saved.append(record)
        if verdict == "detections_only":
            return  # the boxes are saved, the classifications failed: no ack
        job.done.update(i.id for i in result.source_images if i.id in job.tasks)
        job.result_times.append(time.monotonic())
        task.acked = True
        self._maybe_done(job)

    def _saveable(self, job: FakeJob, result: _Results) -> str:
        """``save``, ``drop`` (nothing saved), or ``detections_only`` (an unknown classifier)."""
        registered = self.projects[job.project].get(job.pipeline)
        if result.pipeline != job.pipeline or registered is None:
            return "drop"
        keys = registered["keys"]
        if not any(self.algorithms[k].get("task_type") in DETECTION_TYPES for k in keys):
            return "drop"  # "Pipeline does not have a detection algorithm", after the 200
        verdict = "save"
        for detection in result.detections:
            if detection.algorithm.key not in keys:
                return "drop"
            for c in detection.classifications:
                config = self.algorithms.get(c.algorithm.key)
                if c.algorithm.key not in keys or config is None:
                    verdict = "detections_only"
                    continue
                size = len((config.get("category_map") or {}).get("labels") or [])
                if len(c.scores) != size:
                    return "drop"
        return verdict

    def _maybe_done(self, job: FakeJob) -> None:
        if not self.pending(job.id) and job.status in ACTIVE:
            job.status = "FAILURE" if len(job.failed) > len(job.tasks) / 2 else "SUCCESS"

    def _register(self, project: int, payload: Any) -> tuple[int, Any]:
        if not isinstance(payload, dict) or not isinstance(payload.get("pipelines"), list):
            return 400, {"pipelines": ["This field is required."]}
        if not payload.get("processing_service_name"):
            return 400, {"processing_service_name": ["This field is required."]}
        for pipeline in payload["pipelines"]:
            if "version" not in pipeline:
                return 400, {
                    "pipelines": [{"loc": ["__root__", "0", "version"], "msg": "field required"}]
                }
            for algorithm in pipeline.get("algorithms") or []:
                known = self.algorithms.get(algorithm["key"])
                if (
                    known is None
                    and algorithm.get("task_type") == "classification"
                    and not (algorithm.get("category_map"))
                ):
                    return 500, "PipelineNotConfigured"  # a Django error page
                if known is not None and known.get("version", 1) != algorithm.get("version", 1):
                    return 500, "IntegrityError: ml_algorithm_key_key"
        created: list[str] = []
        for pipeline in payload["pipelines"]:
            keys = set()
            for algorithm in pipeline.get("algorithms") or []:
                if algorithm["key"] not in self.algorithms:
                    self.algorithms[algorithm["key"]] = algorithm  # write-once
                    created.append(algorithm["key"])
                keys.add(algorithm["key"])
            slug = pipeline["slug"]
            old = self.projects[project].get(slug)
            if old is None:
                created.append(slug)
            else:
                keys |= old["keys"]  # a subset does not remove algorithms
            self.projects[project][slug] = {"config": pipeline, "keys": keys}
        return 201, {
            "success": True,
            "error": None,
            "pipelines": payload["pipelines"],
            "pipelines_created": created,
            "algorithms_created": [],
        }


def reserved_port() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1 and not listening: a connection there is
    refused, as by an Antenna that is down, and no other process can bind the port until
    ``FakeAntenna.running(bound=...)`` serves on it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone mid-handshake or mid-answer (a probe, a call given up) is not news."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    antenna: FakeAntenna
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.startswith("/media/"):
            data = self.antenna.images.get(self.path.removeprefix("/media/"))
            self._send(200 if data is not None else 404, data or b"", "image/jpeg")
            return
        self._api("GET", b"")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > self.antenna.max_body_bytes:
            self.rfile.read(length)
            self._send(413, b"<html>413 Request Entity Too Large</html>", "text/html")
            self.antenna.requests.append(("POST", self.path, 413))
            return
        self._api("POST", self.rfile.read(length))

    def setup(self) -> None:
        if self.antenna.tls is not None:  # the handshake on this connection's own thread
            self.request = self.antenna.tls.wrap_socket(self.request, server_side=True)
        super().setup()
        with self.antenna.lock:
            self.antenna.connections += 1

    def _api(self, method: str, body: bytes) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        auth = self.headers.get("Authorization")
        if auth:
            self.antenna.headers_seen.append(auth)
        mode = self.antenna._mode_for(endpoint_of(method, url.path))
        if mode is not None and self._misbehave(mode, method, url.path):
            return
        status, answer = self.antenna.handle(method, url.path, query, auth, body)
        self.antenna.requests.append((method, url.path, status))
        if isinstance(answer, str) and answer.startswith("<!doctype"):
            data, kind = answer.encode(), "text/html"
        elif isinstance(answer, str):
            data, kind = f"<html>{answer}</html>".encode(), "text/html"
        else:
            data, kind = json.dumps(answer).encode(), "application/json"
        if mode is not None and mode.kind == "drop":
            self._raw(b"")
        elif mode is not None and mode.kind == "cut":
            self._raw(self._head(status, kind, len(data)) + data[: len(data) // 2])
        elif mode is not None and mode.kind == "slow":
            self._drip(self._head(status, kind, len(data)) + data, mode)
        elif mode is not None and mode.kind == "late":
            time.sleep(mode.interval_s)
            with contextlib.suppress(OSError):  # the client gave up meanwhile
                self._send(status, data, kind)
        elif mode is not None and mode.kind == "hints":
            hint = b"HTTP/1.1 103 Early Hints\r\nLink: </static/app.css>; rel=preload\r\n\r\n"
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n" + hint * mode.interim)
            self._send(status, data, kind)
        else:
            self._send(status, data, kind)

    def _misbehave(self, mode: Misbehaviour, method: str, path: str) -> bool:
        """Answer as ``mode`` says, before the call is served; False for the kinds that serve
        it first (cut, slow, late, drop, hints)."""
        if mode.kind in ("cut", "slow", "late", "drop", "hints"):
            return False
        self.antenna.requests.append((method, path, -1))
        if mode.kind == "redirect":
            self.send_response(302)
            self.send_header("Location", mode.location)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif mode.kind == "html":
            self._send(200, b"<html><body>Down for maintenance</body></html>", "text/html")
        elif mode.kind == "json":
            self._send(mode.status, mode.body, "application/json")
        elif mode.kind == "deep":
            self._send(200, b"[" * 200_000, "application/json")
        elif mode.kind == "badstatus":
            self._raw(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        elif mode.kind == "down":
            self._raw(b"")
        else:
            raise AssertionError(f"unknown misbehaviour {mode.kind!r}")
        return True

    def _head(self, status: int, kind: str, length: int) -> bytes:
        return (
            f"HTTP/1.1 {status} {self.responses.get(status, ('',))[0]}\r\n"
            f"Content-Type: {kind}\r\nContent-Length: {length}\r\n\r\n"
        ).encode()

    def _raw(self, data: bytes) -> None:
        """``data`` as it is, then the connection closed."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.write(data)
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)

    def _drip(self, data: bytes, mode: Misbehaviour) -> None:
        """``data`` one byte every ``interval_s`` (bounded: ``drip_bytes`` at most, then
        closed)."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            for byte in data[: mode.drip_bytes]:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(mode.interval_s)

    def _send(self, status: int, data: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
