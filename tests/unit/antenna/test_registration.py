"""Registering pipelines with Antenna and checking a token (`worker.antenna.registration`):
what each refusal means, against the fake Antenna."""

from __future__ import annotations

import json

from pydantic import SecretStr

from pipelines.models import Algorithm
from tests.antenna_fake import FakeAntenna
from tests.unit.antenna.common import (
    SERVED,
    SLUG,
    TOKEN,
    client_of,
    images,
)
from worker.antenna.client import AntennaClient
from worker.antenna.registration import antenna_problems, meaning, register
from worker.antenna.render import (
    AntennaPipeline,
)


async def test_register_says_what_each_refusal_means(fake: FakeAntenna) -> None:
    fake.projects[3] = {}
    fake.tokens["manager"] = {1}  # manages project 1 only (and is no superuser)
    ok = await register(client_of(fake, "manager"), [SERVED], [1], "svc")
    assert ok[0][0] and "already registered" in ok[0][1]  # the fixture registered it
    denied = await register(client_of(fake, "manager"), [SERVED], [3], "svc")
    missing = await register(client_of(fake), [SERVED], [42], "svc")
    bad_token = await register(client_of(fake, "nope"), [SERVED], [1], "svc")
    no_map = AntennaPipeline("x", "", (Algorithm("c2", "C2", "classification", "ef" * 32, ()),))
    unconfigured = AntennaPipeline("x", "", no_map.algorithms)
    config = unconfigured.config()
    del config["algorithms"][0]["category_map"]
    fake_reply = await client_of(fake).post(
        "projects/1/pipelines/",
        "register",
        json.dumps({"processing_service_name": "s", "pipelines": [config]}).encode(),
    )
    assert "403" in denied[0][1] and "may not change this project" in denied[0][1]
    assert "404" in missing[0][1] and "401" in bad_token[0][1]
    assert fake_reply.status == 500


async def test_check_names_an_unreachable_server_a_wrong_token_and_an_unknown_slug(
    fake: FakeAntenna,
) -> None:
    down = AntennaClient("http://127.0.0.1:9/api/v2", SecretStr(TOKEN), 2.0)
    assert "unreachable" in (await antenna_problems(down, [SLUG], [1], True))[0]
    bad = await antenna_problems(client_of(fake, "wrong-token-xyz"), [SLUG], [1], True)
    assert "401" in bad[0] and "wrong-token-xyz" not in bad[0]
    unknown = await antenna_problems(client_of(fake), ["not-registered"], [1], True)
    assert "'not-registered' is not registered" in unknown[0]
    assert await antenna_problems(client_of(fake), [SLUG], [1], True) == []
    fake.add_job(SLUG, images(1))
    fake.tokens["manager"] = {5}  # registers in project 5, may not post results in project 1
    (denied,) = await antenna_problems(client_of(fake, "manager"), [SLUG], [], True)
    assert "403" in denied and "may not take tasks or post results" in denied


async def test_check_says_a_token_that_may_not_reserve_is_not_ready_with_no_job_listed(
    fake: FakeAntenna,
) -> None:
    fake.tokens["member"] = {1}  # manages project 1, is no superuser: 403 on tasks and result
    assert await antenna_problems(client_of(fake), [SLUG], [1], True) == []  # a superuser
    (denied,) = await antenna_problems(client_of(fake, "member"), [SLUG], [1], True)
    assert "no superuser" in denied and "may not take tasks or post results" in denied


async def test_a_scheme_antenna_does_not_take_is_named_not_the_token_or_superuser(
    fake: FakeAntenna,
) -> None:
    """``Api-Key`` against Antenna's main (``Token`` alone): it lists for nobody and answers
    posts "credentials were not provided"; every message once blamed the token, and check said
    "no superuser permissions"."""
    api_key = AntennaClient(fake.url, SecretStr(TOKEN), 5.0, scheme="Api-Key")
    for said in (
        await antenna_problems(api_key, [SLUG], [1], True),  # no job listed: the listing
        [meaning(await api_key.post("projects/1/pipelines/", "register", b"{}"))],
    ):
        (line,) = said
        assert "WORKER_ANTENNA__AUTH_SCHEME" in line and "'Api-Key'" in line, line
        assert "superuser" not in line and "refuses the token" not in line, line
        assert TOKEN not in line
    job = fake.add_job(SLUG, images(1))
    (posting,) = await antenna_problems(api_key, [SLUG], [1], True)  # a job: its result post
    assert "WORKER_ANTENNA__AUTH_SCHEME" in posting and "refuses the token" not in posting
    reserved = await api_key.post(f"jobs/{job}/tasks/", "tasks", b'{"batch_size": 1}')
    assert reserved.status == 401 and "WORKER_ANTENNA__AUTH_SCHEME" in reserved.why()
    (wrong_key,) = await antenna_problems(client_of(fake, "nope"), [SLUG], [1], True)
    assert "AUTH_SCHEME" not in wrong_key  # a key Antenna does not know is the key's fault


async def test_check_asks_about_posting_results_only_of_its_own_projects_jobs(
    fake: FakeAntenna,
) -> None:
    fake.projects[2] = {}
    fake.register_direct(2, SERVED.config())
    theirs = fake.add_job(SLUG, images(1, "b"), project=2)  # listed first without a project

    def posted_to() -> set[str]:
        return {path for method, path, _ in fake.requests if method == "POST"}

    fake.tokens["member"] = {1}  # no superuser: told so from the listing, with no job of ours
    (denied,) = await antenna_problems(client_of(fake, "member"), [SLUG], [1], True)
    assert "no superuser" in denied and posted_to() == set()
    ours = fake.add_job(SLUG, images(1, "a"), project=1)
    assert await antenna_problems(client_of(fake), [SLUG], [1], True) == []
    assert posted_to() == {f"/api/v2/jobs/{ours}/result/"}, (ours, theirs)


async def test_a_404_outside_the_api_is_one_line_without_its_html(fake: FakeAntenna) -> None:
    wrong = AntennaClient(fake.url.replace("/api/v2", "/ami/api/v2"), SecretStr(TOKEN), 5.0)
    ((ok, line),) = await register(wrong, [SERVED], [1], "svc")
    (problem,) = await antenna_problems(wrong, [SLUG], [1], True)
    for said in (line, problem):
        assert "HTTP 404" in said and "base URL" in said
        assert "<" not in said and "\n" not in said and "Not Found" not in said
    assert not ok
