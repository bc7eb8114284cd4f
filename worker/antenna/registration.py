"""``inference-worker register`` and ``check``'s Antenna lines: what Antenna is asked, and what
its answers mean, in one sentence each."""

from __future__ import annotations

import json

from config.names import env_name
from worker.antenna.answers import Reply
from worker.antenna.client import AntennaClient, AntennaUnreachable
from worker.antenna.job_listing import project_params
from worker.antenna.render import AntennaPipeline

_MEANING = {
    401: f"Antenna refuses the token: check {env_name('antenna', 'token')} "
    "(AMI_ANTENNA_API_AUTH_TOKEN)",
    403: "the token's user may not change this project (ask a project manager for access)",
    404: "no such project, or the base URL is not Antenna's API root "
    f"({env_name('antenna', 'base_url')}, e.g. https://host/api/v2)",
    500: "Antenna failed on the registration (it does for a classifier without a category map)",
}


def project_ids(text: str) -> list[int]:
    """``WORKER_ANTENNA__PROJECT_IDS`` as ids; ValueError naming what is not one."""
    ids = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(f"{env_name('antenna', 'project_ids')}: {part!r} is not a project id")
        ids.append(int(part))
    return ids


def meaning(reply: Reply) -> str:
    """One line: the status, what Antenna said when it answered JSON (an HTML page, from a
    proxy or Django's debug view, is not shown), and what that means here."""
    if reply.unknown_scheme:  # why() says the scheme is wrong: not the token
        return reply.why()
    said = reply.why() if reply.body is not None else f"HTTP {reply.status} (an HTML page)"
    return f"{said}: {_MEANING.get(reply.status, 'unexpected answer')}"


async def register(
    client: AntennaClient, pipelines: list[AntennaPipeline], projects: list[int], service_name: str
) -> list[tuple[bool, str]]:
    """Post the pipelines' ``PipelineConfigResponse`` to each project; one (ok, line) each.
    Posting the same again changes nothing in Antenna (keys are write-once)."""
    body = json.dumps(
        {"processing_service_name": service_name, "pipelines": [p.config() for p in pipelines]}
    ).encode()
    slugs = ", ".join(p.slug for p in pipelines)
    lines = []
    for project in projects:
        try:
            reply = await client.post(f"projects/{project}/pipelines/", "register", body)
        except AntennaUnreachable as error:
            lines.append((False, f"project {project}: {error}"))
            continue
        if reply.ok:
            found = reply.body if isinstance(reply.body, dict) else {}
            created = found.get("pipelines_created") or []
            state = "created" if created else "already registered, updated"
            lines.append((True, f"project {project}: {slugs} {state} ({reply.status})"))
        else:
            lines.append((False, f"project {project}: {meaning(reply)}"))
    return lines


_MAY_NOT_RESERVE = (
    "this token's user may not take tasks or post results (Antenna grants that to superusers, "
    "or by the tasks_ml_job/result_ml_job permissions, which no project role gives)"
)


def _not_superuser(listed: object) -> list[str]:
    """With no job to ask about: the jobs listing (no project named) says ``create`` in its
    ``user_permissions`` for a superuser's token only (Antenna's collection permissions), and
    only a superuser may take tasks and post results. An Antenna that says nothing is not
    judged."""
    said = listed.get("user_permissions") if isinstance(listed, dict) else None
    if not isinstance(said, list) or "create" in said:
        return []
    return [f"listing jobs: no superuser permissions: {_MAY_NOT_RESERVE}"]


async def _anonymous(client: AntennaClient) -> str | None:
    """Why a listing showed no superuser's permissions when the key was sent under a scheme
    Antenna does not take: it listed for nobody. Asked of the current user's page (djoser's
    ``users/me/``, which answers nobody 401); None when that is not the reason."""
    try:
        reply = await client.get("users/me/", "me")
    except AntennaUnreachable:  # a bad answer too
        return None
    return f"listing jobs: {reply.why()}" if reply.unknown_scheme else None


async def _a_listed_job(
    client: AntennaClient, params: dict[str, object], projects: list[int], listed: object
) -> int | None:
    """An incomplete job to ask about: the listing's first, or with projects named, the first
    listed in one of them (never another project's job). None when there is none."""
    if not projects:
        return _first_job(listed)
    for project in projects:  # a refused project is said by its own line
        reply = await client.get("jobs/", "jobs", {**params, **project_params(project)})
        job = _first_job(reply.body) if reply.ok else None
        if job is not None:
            return job
    return None


def _first_job(listed: object) -> int | None:
    jobs = listed.get("results") if isinstance(listed, dict) else None
    if not jobs or not isinstance(jobs[0], dict) or not isinstance(jobs[0].get("id"), int):
        return None
    return int(jobs[0]["id"])


async def _may_post_results(client: AntennaClient, job: int | None, listed: object) -> list[str]:
    """Whether the token may post results, asked of a listed job with an empty post (Antenna
    answers 403 before it reads the body; an empty list queues nothing), or, with no job
    listed, read from the listing's permissions."""
    if job is None:  # no incomplete job to ask about
        refused = _not_superuser(listed)
        return [await _anonymous(client) or refused[0]] if refused else []
    reply = await client.post(f"jobs/{job}/result/", "result", b'{"results": []}')
    if reply.status == 403:
        return [f"job {job}: {reply.why()}: {_MAY_NOT_RESERVE}"]
    if reply.status == 401:
        return [f"job {job}: {meaning(reply)}"]
    return []


async def antenna_problems(
    client: AntennaClient, pipelines: list[str], projects: list[int], token_set: bool
) -> list[str]:
    """What stops a worker from taking Antenna's tasks: unreachable, the token refused, a
    project it may not use, a pipeline slug not registered there. Whether the token may post
    results is asked of a job of ``projects`` when they are named."""
    if not token_set:
        return [f"{env_name('antenna', 'token')} (or AMI_ANTENNA_API_AUTH_TOKEN) is not set"]
    try:
        params: dict[str, object] = {
            "pipeline__slug__in": ",".join(pipelines),
            "ids_only": 1,
            "incomplete_only": 1,
            "dispatch_mode": "async_api",
            "limit": 1,
        }
        reply = await client.get("jobs/", "jobs", params)
        if not reply.ok:
            return [f"Antenna at {client.shown()}: listing jobs: {meaning(reply)}"]
        job = await _a_listed_job(client, params, projects, reply.body)
        problems = await _may_post_results(client, job, reply.body)
        for project in projects:
            listed = await client.get(f"projects/{project}/pipelines/", "pipelines")
            if not listed.ok:
                problems.append(f"project {project}: {meaning(listed)}")
                continue
            body = listed.body if isinstance(listed.body, dict) else {}
            known = {str(p.get("slug")) for p in body.get("results") or [] if isinstance(p, dict)}
            problems += [
                f"project {project}: pipeline {slug!r} is not registered; run "
                "`inference-worker register`"
                for slug in pipelines
                if slug not in known
            ]
        return problems
    except AntennaUnreachable as error:
        return [str(error)]
