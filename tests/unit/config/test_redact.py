"""Nothing secret in what the worker writes: URLs are named by scheme, host and path."""

from __future__ import annotations

from config.errors import Failure
from config.redact import redact_url, scrub

PRESIGNED = (
    "https://bucket.s3.amazonaws.com/traps/img.jpg?X-Amz-Algorithm=AWS4-HMAC-SHA256"
    "&X-Amz-Credential=AKIAEXAMPLE%2F20261130&X-Amz-Signature=deadbeefcafe"
)


def test_a_presigned_url_is_shown_without_its_query():
    shown = redact_url(PRESIGNED)
    assert shown == "https://bucket.s3.amazonaws.com/traps/img.jpg?<redacted>"


def test_a_nats_url_is_shown_without_its_password():
    assert redact_url("nats://worker:hunter2@10.0.0.5:4222") == "nats://10.0.0.5:4222"


def test_urls_inside_any_text_are_scrubbed():
    text = f"cannot read {PRESIGNED}: timed out; also token=abc123 and nats://u:pw@h:4222"
    scrubbed = scrub(text)
    for secret in ("AKIAEXAMPLE", "deadbeefcafe", "abc123", "pw@"):
        assert secret not in scrubbed


def test_stored_error_messages_are_scrubbed_and_capped():
    error = Failure("http_error", f"HTTP 403 for {PRESIGNED} " + "x" * 5000).as_dict()
    assert "deadbeefcafe" not in error["message"] and len(error["message"]) <= 1000


def test_an_authorization_credential_echoed_in_a_page_is_masked() -> None:
    page = "<pre>Authorization: Token s3cr3t-antenna-token-7f1c2a9e\nX: Bearer abc.def-123</pre>"
    shown = scrub(page)
    assert "s3cr3t-antenna-token-7f1c2a9e" not in shown and "abc.def-123" not in shown
    assert "Token <redacted>" in shown
