"""Whether an HTTP answer is Antenna's: judged from its status, Location, Content-Type and body
alone, with nothing of the connection that carried it."""

from __future__ import annotations

import pytest

from worker.antenna.answers import NotAntennas, Received, Reply, checked_reply, json_depth

ROOT = "https://antenna.example/api/v2/"
WHERE = "POST https://antenna.example/api/v2/jobs/1/result/"


def masked(text: str) -> str:
    return text.replace("tok3n", "<redacted>")


def judged(status: int, body: bytes, endpoint: str = "result", location: str = "") -> Reply:
    received = Received(status, location, "application/json", body)
    return checked_reply(WHERE, endpoint, received, ROOT, masked)


def test_json_depth_is_counted_without_parsing() -> None:
    assert json_depth(b"[" * 200_000) > 64
    assert json_depth(b'{"a": [1, {"b": "[[[[["}]}') == 3
    assert json_depth(rb'["a\"[[[", [1]]') == 2 and json_depth(rb'["a\\", [[1]]]') == 3


def test_a_redirect_is_not_an_answer_and_names_where_it_pointed_without_credentials() -> None:
    with pytest.raises(NotAntennas) as raised:
        judged(302, b"", location="https://user:pw@elsewhere.example/login?token=x")
    message = str(raised.value)
    assert "HTTP 302, a redirect to https://elsewhere.example/login" in message
    assert "pw" not in message and "token=x" not in message


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (b"", "an empty body"),
        (b"<html>tok3n</html>", "not JSON"),
        (b"[" * 100, "nested deeper than 64"),
        (b'{"status": "accepted"}', "job_id"),
    ],
)
def test_a_2xx_without_its_endpoints_json_is_not_an_answer(body: bytes, named: str) -> None:
    with pytest.raises(NotAntennas) as raised:
        judged(200, body)
    assert named in str(raised.value) and "tok3n" not in str(raised.value)


def test_an_error_answer_is_a_reply_saying_what_antenna_said_with_the_token_masked() -> None:
    reply = judged(403, b'{"detail": "tok3n may not post here"}')
    assert not reply.ok
    assert reply.body == {"detail": "tok3n may not post here"}
    assert reply.why() == "HTTP 403: <redacted> may not post here"


def test_a_2xx_with_its_endpoints_json_is_believed_extra_fields_and_all() -> None:
    body = b'{"status": "accepted", "job_id": 1, "results_queued": 0, "extra": [1]}'
    reply = judged(200, body)
    assert reply.ok and reply.body["extra"] == [1]
