"""The Antenna client against the fake Antenna answering as the field does (a proxy in front,
a half-broken deployment, a slow link): no answer but Antenna's own is believed, no redirect
followed, every call ends by its deadline, connections are kept alive."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import SecretStr

from tests.antenna_fake import FakeAntenna
from worker.antenna.client import AntennaClient, AntennaUnreachable, Unanswered

TOKEN = "client-token-9d3e1f"


@pytest.fixture
def fake() -> Iterator[FakeAntenna]:
    antenna = FakeAntenna(token=TOKEN)
    with antenna.running():
        yield antenna


def client_of(fake: FakeAntenna, timeout_s: float = 5.0) -> AntennaClient:
    return AntennaClient(fake.url, SecretStr(TOKEN), timeout_s)


async def test_a_redirect_is_an_error_naming_where_and_the_token_goes_nowhere_else(
    fake: FakeAntenna,
) -> None:
    other = FakeAntenna(token="other")
    with other.running():
        elsewhere = other.url.replace("/api/v2", "") + "/accounts/login/?next=/result/&token=x"
        elsewhere = elsewhere.replace("http://", "http://user:pw@")
        fake.misbehave("result", "redirect", location=elsewhere)
        client = client_of(fake)
        with pytest.raises(AntennaUnreachable) as raised:
            await client.post("jobs/1/result/", "result", b'{"results": []}')
        message = str(raised.value)
        assert "302" in message and "/accounts/login/" in message
        assert "pw" not in message and "token=x" not in message and TOKEN not in message
        assert other.requests == [] and other.headers_seen == []
        assert client.unreachable_since is not None  # no answer from Antenna itself


@pytest.mark.parametrize(
    ("endpoint", "kind", "body", "named"),
    [
        ("result", "html", b"", "not JSON"),
        ("result", "json", b'{"detail": "ok"}', "status"),
        ("tasks", "json", b'{"tasks": 5}', "tasks"),
        ("jobs", "json", b'{"results": 7}', "results"),
        ("tasks", "deep", b"", "nested deeper"),
        ("tasks", "cut", b"", "IncompleteRead"),
        ("jobs", "badstatus", b"", "BadStatusLine"),
        ("jobs", "down", b"", "RemoteDisconnected"),
    ],
)
async def test_an_answer_that_is_not_antennas_is_an_error_naming_what_is_wrong(
    fake: FakeAntenna, endpoint: str, kind: str, body: bytes, named: str
) -> None:
    job = fake.add_job("p", [("a", "http://x/a.jpg")])
    fake.misbehave(endpoint, kind, times=1, body=body)
    client = client_of(fake)
    path = {"jobs": "jobs/", "tasks": f"jobs/{job}/tasks/", "result": f"jobs/{job}/result/"}
    payload = b'{"batch_size": 1}' if endpoint == "tasks" else b'{"results": []}'
    with pytest.raises(AntennaUnreachable) as raised:
        if endpoint == "jobs":
            await client.get(path[endpoint], endpoint, {"limit": 10})
        else:
            await client.post(path[endpoint], endpoint, payload)
    assert named in str(raised.value)
    assert TOKEN not in str(raised.value)
    # The next answer is Antenna's own again, and it is taken.
    if endpoint == "jobs":
        assert (await client.get("jobs/", "jobs", {"limit": 10})).ok
    else:
        assert (await client.post(path[endpoint], endpoint, payload)).ok
    assert client.unreachable_since is None


async def test_a_slow_answer_ends_at_the_calls_deadline(fake: FakeAntenna) -> None:
    fake.misbehave("jobs", "slow", interval_s=0.5)  # ~150 bytes: over a minute in all
    client = client_of(fake, timeout_s=2.0)
    with pytest.raises(AntennaUnreachable, match="no complete answer within 2s"):
        await client.get("jobs/", "jobs", {"limit": 10})
    assert client.unreachable_since is not None


async def test_connections_are_kept_alive_between_calls(fake: FakeAntenna) -> None:
    job = fake.add_job("p", [(f"i{n}", f"http://x/{n}.jpg") for n in range(5)])
    client = client_of(fake)
    for _ in range(5):
        assert (await client.get("jobs/", "jobs", {"limit": 10})).ok
        assert (await client.post(f"jobs/{job}/tasks/", "tasks", b'{"batch_size": 1}')).ok
    assert fake.connections == 1


async def test_an_unterminated_string_of_escaped_quotes_is_judged_not_json(
    fake: FakeAntenna,
) -> None:
    # 2 MB: a depth check whose pattern backtracks takes hours here, holding the GIL.
    unterminated = b"[" + b'"\\' * 1_000_000
    from worker.antenna.answers import json_depth

    assert json_depth(unterminated) == 1
    job = fake.add_job("p", [("a", "http://x/a.jpg")])
    fake.misbehave("tasks", "json", times=1, body=unterminated)
    with pytest.raises(AntennaUnreachable, match="not JSON"):
        await client_of(fake).post(f"jobs/{job}/tasks/", "tasks", b'{"batch_size": 1}')


async def test_the_poster_resolves_every_result_whatever_the_client_raises() -> None:
    import asyncio
    import time

    from worker.antenna.post import Poster, PostFailed
    from worker.core.tasks import Task

    class Broken:
        async def post(self, *_args: object, **_kwargs: object) -> None:
            raise RuntimeError("a bug below the poster")

    poster = Poster(Broken(), 10**6, 5.0)  # type: ignore[arg-type]
    task = Task("t1", "1", "i1", "http://x/1.jpg", reply_subject="s")
    entry = {"reply_subject": "s", "result": {"error": "e", "image_id": "i1"}}
    posting = poster.post(1, task, entry, time.monotonic() + 5)
    with pytest.raises(PostFailed):
        await asyncio.wait_for(posting, 10)
    assert poster.waiting() == 0
    # The next result is posted by a poster still working.
    with pytest.raises(PostFailed):
        await asyncio.wait_for(poster.post(1, task, entry, time.monotonic() + 5), 10)


async def test_a_reservation_whose_connection_drops_after_antenna_acted_is_not_sent_again(
    fake: FakeAntenna,
) -> None:
    """Given a kept-alive connection, when Antenna reserves a task and the connection drops
    before its answer comes back, the call fails and is not made again (that would reserve a
    second task and leave the first with no worker until its TTR, a delivery lost): one
    request per call. A GET whose connection drops the same way is made once more."""
    job = fake.add_job("p", [("t1", "http://x/1.jpg"), ("t2", "http://x/2.jpg")])
    client = client_of(fake)
    assert (await client.get("jobs/", "jobs", {"limit": 10})).ok  # the connection, kept
    fake.misbehave("tasks", "drop", times=1)
    with pytest.raises(Unanswered, match="not sent again"):
        await client.post(f"jobs/{job}/tasks/", "tasks", b'{"batch_size": 1}')
    tasks = [r for r in fake.requests if r[1].endswith("/tasks/")]
    assert tasks == [("POST", f"/api/v2/jobs/{job}/tasks/", 200)]  # one request for one call
    assert {t.image_id: t.delivered for t in fake.jobs[job].tasks.values()} == {"t1": 1, "t2": 0}
    # The next reservation, on a fresh connection, gets the task not yet out.
    reply = await client.post(f"jobs/{job}/tasks/", "tasks", b'{"batch_size": 1}')
    assert [t["image_id"] for t in reply.body["tasks"]] == ["t2"]
    fake.misbehave("jobs", "drop", times=1)
    assert (await client.get("jobs/", "jobs", {"limit": 10})).ok  # idempotent: made again
    assert [r[1] for r in fake.requests].count("/api/v2/jobs/") == 3


async def test_a_reservation_answered_early_hints_first_is_read_as_antennas_200(
    fake: FakeAntenna,
) -> None:
    """Given a proxy in front that sends ``103 Early Hints`` (after an unasked ``100
    Continue``) before Antenna's answer, the reservation is read as Antenna's 200 with its
    tasks, on a connection kept for the next call; interim answers without end are a broken
    answer, not Antenna's."""
    job = fake.add_job("p", [("t1", "http://x/1.jpg"), ("t2", "http://x/2.jpg")])
    client = client_of(fake)
    fake.misbehave("tasks", "hints", times=1, interim=2)
    reply = await client.post(f"jobs/{job}/tasks/", "tasks", b'{"batch_size": 1}')
    assert reply.status == 200 and [t["image_id"] for t in reply.body["tasks"]] == ["t1"]
    assert (await client.get("jobs/", "jobs", {"limit": 10})).ok
    assert fake.connections == 1
    fake.misbehave("jobs", "hints", times=1, interim=1000)
    with pytest.raises(AntennaUnreachable, match="interim answers"):
        await client.get("jobs/", "jobs", {"limit": 10})


async def test_the_token_in_the_data_arrives_intact_and_is_masked_in_what_is_shown(
    fake: FakeAntenna,
) -> None:
    """Given the token ``i1``, a task whose image id contains it arrives as Antenna sent it,
    while an error that quotes Antenna's answer shows the token masked."""
    fake.tokens["i1"] = {1}
    fake.superusers.add("i1")
    job = fake.add_job("p", [("moth-i1-7", "http://x/1.jpg")])
    client = AntennaClient(fake.url, SecretStr("i1"), 5.0)
    reply = await client.post(f"jobs/{job}/tasks/", "tasks", b'{"batch_size": 1}')
    (task,) = reply.body["tasks"]
    assert task["image_id"] == "moth-i1-7" and task["id"] == "moth-i1-7"
    said = b'{"detail": "token i1 may not post results here"}'
    fake.misbehave("result", "json", times=1, status=403, body=said)
    refused = await client.post(f"jobs/{job}/result/", "result", b'{"results": []}')
    assert refused.body == {"detail": "token i1 may not post results here"}  # as it came
    assert refused.why() == "HTTP 403: token <redacted> may not post results here"
    assert "i1" not in refused.text
    fake.misbehave("result", "json", times=1, body=b"<p>i1 is not valid</p>")
    with pytest.raises(AntennaUnreachable) as raised:
        await client.post(f"jobs/{job}/result/", "result", b'{"results": []}')
    assert "not JSON" in str(raised.value) and "<p><redacted> is not valid</p>" in str(raised.value)
    assert "i1" not in str(raised.value)
