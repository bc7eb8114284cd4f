"""The error kinds a result can carry are one declared set, and docs/nats.md lists exactly it."""

from __future__ import annotations

import ast
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


ROOT = Path(__file__).parents[3]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGES = ("worker", "config", "datasets", "pipelines", "testing")
_BUILTIN_BASES = {"Exception", "RuntimeError", "ValueError", "OSError", "KeyError", "TypeError"}


def _error_classes() -> dict[str, Path]:
    """Each exception class the packages define, by name, with its module: a class is one
    when a base is a builtin exception or an exception class found here (to a fixed point)."""
    bases: dict[str, tuple[set[str], Path]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    names = {
                        b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                        for b in node.bases
                    }
                    bases[node.name] = (names, path)
    errors: dict[str, Path] = {}
    known = set(_BUILTIN_BASES)
    while True:
        found = {n: p for n, (b, p) in bases.items() if b & known and n not in errors}
        if not found:
            return errors
        errors.update(found)
        known |= set(found)


def _rooms_that_name(name: str) -> set[str]:
    """The folders of the package modules whose code names ``name``."""
    pattern = re.compile(rf"\b{name}\b")
    return {
        str(path.parent.relative_to(ROOT))
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if pattern.search(path.read_text())
    }


def test_an_error_outside_config_errors_stays_in_its_room_and_the_docs_name_it():
    errors = _error_classes()
    outside = {n: p for n, p in errors.items() if p != ROOT / "config" / "errors.py"}
    assert "TooLarge" in errors and "AntennaUnreachable" in outside  # the scan sees both kinds
    docs = ARCHITECTURE.read_text()
    for name, path in outside.items():
        room = str(path.parent.relative_to(ROOT))
        assert _rooms_that_name(name) == {room}, (
            f"{name} leaves {room}: move it to config/errors.py"
        )
        assert f"`{name}`" in docs, f"docs/architecture.md does not say where {name} lives"
        assert f"`{path.relative_to(ROOT)}`" in docs, f"docs/architecture.md does not name {path}"
