"""The result store's message: the stored document's compact JSON, its ``response`` encoded
once, so a response that goes to the object store is the very bytes the message would hold."""

from __future__ import annotations

import json
from typing import Any

import pytest

from worker.nats.result_store import _encoded_around


def compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    "document",
    [
        {"task_id": "t", "response": {"detections": [{"bbox": None, "scores": [0.5, 1e-7]}]}},
        {"response": {"pipeline": "p\u00e9", "x": [1, 2.5]}, "error": None, "attempt": 2},
        {"task_id": '"response":null', "status": "ok", "response": {"a": "b"}},
        {"task_id": "t", "response": {}},
    ],
)
def test_a_document_with_a_response_is_its_compact_json_and_the_response_its_own(
    document: dict[str, Any],
) -> None:
    payload, response = _encoded_around(document)

    assert payload == compact(document)
    assert response == compact(document["response"])


@pytest.mark.parametrize("document", [{"task_id": "t", "response": None}, {"task_id": "t"}])
def test_a_document_without_a_response_is_encoded_as_it_is(document: dict[str, Any]) -> None:
    assert _encoded_around(document) == (compact(document), None)
