"""The error kinds a result can carry are one declared set, and docs/nats.md lists exactly it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from config.errors import ERROR_KINDS, Failure, PermanentError, TransientError

NATS_DOC = Path(__file__).parents[3] / "docs" / "nats.md"


def _docs_error_types() -> list[str]:
    """Every `snake_case` name in docs/nats.md's list of error types (from "Error types" to
    the section's next heading)."""
    text = NATS_DOC.read_text()
    start = text.index("Error types (")
    end = text.index("\n## ", start)
    return re.findall(r"`([a-z][a-z0-9_]*)`", text[start:end])


def test_the_docs_list_every_declared_error_kind_and_no_other():
    listed = _docs_error_types()
    assert len(listed) == len(set(listed)), f"listed twice: {sorted(listed)}"
    assert set(listed) - ERROR_KINDS == set(), "the docs list kinds the code does not declare"
    assert ERROR_KINDS - set(listed) == set(), "declared kinds the docs do not list"


def test_a_failure_reports_its_kind_as_the_results_error_type():
    error = TransientError("S3 answered 503", kind="s3_unavailable")
    assert error.failure().as_dict() == {
        "type": "s3_unavailable",
        "message": "S3 answered 503",
        "retryable": True,
    }
    assert Failure("object_missing", "gone").as_dict()["retryable"] is False


@pytest.mark.parametrize("family", [PermanentError, TransientError])
def test_an_error_raised_without_a_kind_is_reported_as_internal_error(family):
    assert family("something nobody named").failure().kind == "internal_error"
